"""Conv2d computed by compiled loops for narrow convolutions on the CPU.

``Conv2d`` is ``nn.Conv2d``: the same parameters (``weight``, ``bias``: state_dict keys do not change), the same
arithmetic up to rounding. Only a *narrow* convolution on the CPU takes another route: ``utils.cpu_kernels``'
``conv2d_backward`` and ``conv2d_forward``. oneDNN, torch's CPU convolution library, blocks channels in 8s or 16s,
so a convolution with two or three channels at 112x112 (the ``tiny`` demo network's first stage) spends its time
on padding: its backward takes 20-30 ms for 32 images, more than half of that network's training step, and its
forward 2-4 ms (80-100 ms for 256 images). The loops take 2-5 ms and 1-2 ms (10-15 ms).

Narrow: ``in_channels * out_channels <= NARROW_CHANNEL_PAIRS``, one group, no dilation, a square 1x1 or 3x3
kernel with zero padding of at most ``k - 1``, stride 1 or 2, no bias. Wider convolutions are faster in oneDNN
(a 2 -> 16 3x3 convolution already is), so they, CUDA, torch.compile, tracing (ONNX export), fp16,
non-contiguous (channels-last) inputs and machines without the compiled kernels run ``nn.Conv2d`` itself. A
strided 3x3 narrow convolution keeps oneDNN's forward (faster there) and takes the backward loop.

Values agree with torch's to rounding, not to the bit: each output and input-gradient value is a float sum over
the taps in a fixed order, rounded once (to bf16 under bf16 autocast, as torch rounds it); the weight's gradient
is summed in float lanes and doubles and stays fp32 under autocast (torch rounds it to bf16 first, as for the
PReLU slopes).
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


class _Conv2dCompiled(torch.autograd.Function):
    """The convolution of ``x`` and ``weight`` in ``dtype`` by ``cpu_kernels.conv2d_forward`` (or torch's where
    that is faster, see ``_loop_forward``); the backward by ``cpu_kernels.conv2d_backward``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, stride: int, padding: int, dtype: torch.dtype) -> Tensor:  # noqa: D102
        xc, wc = x.to(dtype), weight.to(dtype)  # what autocast casts nn.Conv2d's inputs to (no copy without it)
        out = _forward(xc, wc, stride, padding)
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


def _loop_forward(kernel: int, stride: int) -> bool:
    """Whether the forward loop beats oneDNN's at this kernel and stride: it does at stride 1 and for 1x1
    kernels (2-8x at 112x112), not for a strided 3x3 (whose loop reads the whole input for a quarter of the
    outputs)."""
    return stride == 1 or kernel == 1


def _forward(x: Tensor, weight: Tensor, stride: int, padding: int) -> Tensor:
    """The narrow convolution of ``x`` and ``weight`` (the same dtype, no autocast in between)."""
    if _loop_forward(weight.shape[-1], stride):
        return cpu_kernels.conv2d_forward(x, weight, stride, padding)
    with torch.autocast("cpu", enabled=False):
        return torch.conv2d(x, weight, None, stride, padding)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype ``nn.Conv2d`` computes in: autocast's (conv2d is on its lower-precision list) or the input's."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype


class Conv2d(nn.Conv2d):
    """``nn.Conv2d`` computed by compiled loops for narrow convolutions on the CPU (see the module's docstring)."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        if not self._loops(x):
            return super().forward(x)
        dtype, stride, padding = _compute_dtype(x), self.stride[0], self.padding[0]
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _Conv2dCompiled.apply(x, self.weight, stride, padding, dtype)
        return _forward(x.to(dtype), self.weight.to(dtype), stride, padding)

    def narrow(self) -> bool:
        """Whether this convolution's shape is one the loops take (whatever its input)."""
        k = self.kernel_size[0]
        return (self.in_channels * self.out_channels <= NARROW_CHANNEL_PAIRS and self.groups == 1 and self.bias is None
                and self.kernel_size in ((1, 1), (3, 3)) and self.stride in ((1, 1), (2, 2))
                and self.dilation == (1, 1) and self.padding_mode == "zeros" and isinstance(self.padding, tuple)
                and self.padding[0] == self.padding[1] and 0 <= self.padding[0] < k)

    def _loops(self, x: Tensor) -> bool:
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting():
            return False
        if not torch.is_autocast_enabled("cpu") and x.dtype != self.weight.dtype:
            return False  # nn.Conv2d refuses mixed dtypes outside autocast: let it say so
        return (x.device.type == "cpu" and x.dim() == 4 and x.is_contiguous() and self.narrow()
                and _compute_dtype(x) in (torch.float32, torch.bfloat16) and self.weight.dtype == torch.float32
                and cpu_kernels.library() is not None)
