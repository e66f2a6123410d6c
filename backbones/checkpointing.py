"""Activation checkpointing that leaves BatchNorm running statistics as they would be without it.

``torch.utils.checkpoint`` re-runs a block's forward during backward. A BatchNorm in training mode
would then update its running mean/var (and ``num_batches_tracked``) a second time with the same batch,
so the running statistics of a checkpointed model drift from those of the same model trained without
checkpointing. The recompute pass below runs with every BatchNorm's momentum at 0 and puts
``num_batches_tracked`` back, so both runs end with identical buffers. Under ``torch.compile`` the
recomputation is traced into the backward graph, which recomputes values without repeating the forward's
buffer updates, so checkpointing there needs no such context.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _frozen_batchnorm_stats(module: nn.Module) -> Iterator[None]:
    """Within the context, BatchNorms in ``module`` normalise with batch statistics but update nothing."""
    saved: list[tuple[_BatchNorm, float | None, torch.Tensor | None]] = []
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.track_running_stats:
            tracked = None if m.num_batches_tracked is None else m.num_batches_tracked.clone()
            saved.append((m, m.momentum, tracked))
            # running = (1 - 0) * running + 0 * batch: unchanged, also when momentum was None (cumulative).
            m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, tracked in saved:
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def maybe_checkpoint(module: nn.Module, x: torch.Tensor, enabled: bool) -> torch.Tensor:
    """``module(x)``, checkpointed when ``enabled`` and the module is training with grad enabled.

    Non-reentrant checkpointing (``use_reentrant=False``) so that gradients reach parameters even when
    ``x`` does not require grad, and so the RNG state (dropout) is replayed exactly.
    """
    if not (enabled and module.training and torch.is_grad_enabled()):
        return module(x)
    if torch.compiler.is_compiling():
        # Under torch.compile the recomputation is part of the traced backward graph, which recomputes values
        # only: the running statistics are updated once, by the forward, without the context above (which
        # dynamo cannot trace).
        return checkpoint(module, x, use_reentrant=False)
    return checkpoint(
        module,
        x,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _frozen_batchnorm_stats(module)),
    )
