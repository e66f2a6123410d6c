"""Conv2d with a compiled backward for narrow convolutions on the CPU.

``Conv2d`` is ``nn.Conv2d``: the same parameters (``weight``, ``bias``: state_dict keys do not change) and the
same forward values (``torch.conv2d``, in autocast's dtype under autocast, as ``nn.Conv2d``). Only a *narrow*
convolution's CPU backward takes another route: ``utils.cpu_kernels.conv2d_backward``. oneDNN, torch's CPU
convolution library, blocks channels in 8s or 16s, so a convolution with two or three channels at 112x112 (the
``tiny`` demo network's first stage) spends its backward on padding: 20-30 ms for 32 images against ~4 ms
forward, and more than half of that network's training step. The loop takes ~2-5 ms.

Narrow: ``in_channels * out_channels <= NARROW_CHANNEL_PAIRS``, one group, no dilation, a square 1x1 or 3x3
kernel with zero padding of at most ``k - 1``, stride 1 or 2, no bias. Wider convolutions are faster in oneDNN
(a 2 -> 16 3x3 convolution already is), so they, CUDA, torch.compile, tracing, fp16, non-contiguous
(channels-last) inputs and machines without the compiled kernels run ``nn.Conv2d`` itself.

The gradients agree with torch's to rounding, not to the bit: the input's is a float sum over the taps in a
fixed order, rounded once (to bf16 under bf16 autocast, as torch rounds it); the weight's is summed in float
lanes and doubles and stays fp32 under autocast (torch rounds it to bf16 first, as for the PReLU slopes).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from utils import cpu_kernels

__all__ = ["NARROW_CHANNEL_PAIRS", "Conv2d"]

# in_channels x out_channels at or below which the compiled backward beats oneDNN's (measured on AVX-512 and
# AVX2 machines: 2 -> 2 and 3 -> 2 at 112x112 5-6x faster, 2 -> 16 3x3 at 56x56 3x slower).
NARROW_CHANNEL_PAIRS = 12


class _Conv2dCompiledBackward(torch.autograd.Function):
    """``torch.conv2d(x, weight, stride=stride, padding=padding)`` in ``dtype``; the backward by
    ``cpu_kernels.conv2d_backward``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, stride: int, padding: int, dtype: torch.dtype) -> Tensor:  # noqa: D102
        xc, wc = x.to(dtype), weight.to(dtype)  # what autocast casts nn.Conv2d's inputs to (no copy without it)
        with torch.autocast("cpu", enabled=False):
            out = torch.conv2d(xc, wc, None, stride, padding)
        ctx.save_for_backward(xc, wc)
        ctx.conv = (stride, padding, x.dtype, weight.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:  # noqa: D102
        xc, wc = ctx.saved_tensors
        stride, padding, x_dtype, w_dtype = ctx.conv
        gx, gw = cpu_kernels.conv2d_backward(xc, grad.to(xc.dtype).contiguous(), wc, stride, padding,
                                             input_grad=ctx.needs_input_grad[0])
        return (None if gx is None else gx.to(x_dtype)), gw.to(w_dtype), None, None, None


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype ``nn.Conv2d`` computes in: autocast's (conv2d is on its lower-precision list) or the input's."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype


class Conv2d(nn.Conv2d):
    """``nn.Conv2d`` whose CPU backward is a compiled loop for narrow convolutions (see the module's docstring)."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        if self._compiled_backward(x):
            return _Conv2dCompiledBackward.apply(x, self.weight, self.stride[0], self.padding[0], _compute_dtype(x))
        return super().forward(x)

    def narrow(self) -> bool:
        """Whether this convolution's shape is one the compiled backward takes (whatever its input)."""
        k = self.kernel_size[0]
        return (self.in_channels * self.out_channels <= NARROW_CHANNEL_PAIRS and self.groups == 1 and self.bias is None
                and self.kernel_size in ((1, 1), (3, 3)) and self.stride in ((1, 1), (2, 2))
                and self.dilation == (1, 1) and self.padding_mode == "zeros" and isinstance(self.padding, tuple)
                and self.padding[0] == self.padding[1] and 0 <= self.padding[0] < k)

    def _compiled_backward(self, x: Tensor) -> bool:
        if not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return False
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting():
            return False
        if not torch.is_autocast_enabled("cpu") and x.dtype != self.weight.dtype:
            return False  # nn.Conv2d refuses mixed dtypes outside autocast: let it say so
        return (x.device.type == "cpu" and x.dim() == 4 and x.is_contiguous() and self.narrow()
                and _compute_dtype(x) in (torch.float32, torch.bfloat16) and self.weight.dtype == torch.float32
                and cpu_kernels.library() is not None)
