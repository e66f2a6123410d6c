"""PReLU with a one-pass backward on the CPU.

``PReLU`` is ``nn.PReLU``: the same parameter (``weight``, so state_dict keys do not change), the same forward
values (``torch.prelu``, in autocast's dtype under autocast, as ``nn.PReLU``). Only where the backward would
run torch's CPU kernel does it take another route: ``utils.cpu_kernels.prelu_backward``, one pass over the
input and the gradient instead of torch's several passes and broadcast reduction (at the demo's widths the
PReLU backward otherwise costs about as much as the convolution beside it). The input's gradient is torch's to
the bit; the slopes' gradient is summed in another order (fp32 here even under bf16 autocast, where torch
rounds it to bf16 first). CUDA, torch.compile, tracing, fp16 and non-contiguous (channels-last) inputs, and
machines without the compiled kernels run ``nn.PReLU`` itself.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from utils import cpu_kernels

__all__ = ["PReLU"]


class _PReLUCompiledBackward(torch.autograd.Function):
    """``torch.prelu(x, weight)`` in ``dtype``; the backward by ``cpu_kernels.prelu_backward``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:  # noqa: D102
        xc, wc = x.to(dtype), weight.to(dtype)  # what autocast casts nn.PReLU's inputs to (no copy without it)
        with torch.autocast("cpu", enabled=False):
            out = torch.prelu(xc, wc)
        ctx.save_for_backward(xc, wc)
        ctx.dtypes = (x.dtype, weight.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # noqa: D102
        xc, wc = ctx.saved_tensors
        gx, gw = cpu_kernels.prelu_backward(xc, grad.to(xc.dtype).contiguous(), wc.float())
        return gx.to(ctx.dtypes[0]), gw.to(ctx.dtypes[1]), None


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype ``nn.PReLU`` computes in: autocast's (prelu is on its lower-precision list) or the input's."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype


class PReLU(nn.PReLU):
    """``nn.PReLU`` whose CPU backward is one compiled pass (see the module's docstring)."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        if self._compiled_backward(x):
            return _PReLUCompiledBackward.apply(x, self.weight, _compute_dtype(x))
        return super().forward(x)

    def _compiled_backward(self, x: Tensor) -> bool:
        if not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return False
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting():
            return False
        if not torch.is_autocast_enabled("cpu") and x.dtype != self.weight.dtype:
            return False  # nn.PReLU refuses mixed dtypes outside autocast: let it say so
        return (x.device.type == "cpu" and x.dim() >= 2 and x.is_contiguous()
                and _compute_dtype(x) in (torch.float32, torch.bfloat16) and self.weight.dtype == torch.float32
                and self.weight.numel() in (1, x.shape[1]) and cpu_kernels.library() is not None)
