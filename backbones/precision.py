"""Full-precision regions inside a backbone run under the trainer's autocast.

The trainer chooses mixed precision by wrapping the whole forward in ``torch.autocast``; the models hold
no precision flag. A few computations must not be rounded to float16/bfloat16 all the same: the layers
that produce the embedding (it is what the margin head normalises and compares, and the official models
compute them in fp32 outside their autocast region) and, in the ViT, the attention scores and softmax
(also fp32 in the official model). :func:`full_precision` is the one place that does it, for whatever
device autocast runs on (CPU, CUDA, ...), with public API only.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["full_precision"]


@contextlib.contextmanager
def full_precision(x: torch.Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Yield ``x`` cast to ``dtype`` with autocast disabled for ``x``'s device type inside the block.

    ``dtype`` is the dtype of the parameters the block uses (float32 in normal and mixed-precision
    training), so the block computes in the precision its weights are stored in even when the body ran
    in bfloat16/float16, and a model converted as a whole (``.double()``, ``.half()``) still works.
    The cast is differentiable: gradients flow back to the low-precision body unchanged in value.

        with full_precision(x, self.fc.weight.dtype) as x:   # x: (N, D) float32, autocast off
            x = self.features(self.fc(x))
    """
    device_type = x.device.type
    # Devices without autocast (e.g. ``meta``, used to count parameters and FLOPs) have nothing to disable;
    # torch.autocast refuses them, so only the cast applies there.
    ctx = (torch.autocast(device_type=device_type, enabled=False) if torch.amp.is_autocast_available(device_type)
           else contextlib.nullcontext())
    with ctx:
        yield x.to(dtype)
