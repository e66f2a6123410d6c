"""Learning-rate schedule: linear warm-up, then polynomial decay to zero, as a pure function of the step.

The curve is arcface_torch's ``PolyScheduler`` (power 2): ``base_lr * step / warmup_steps`` during warm-up,
then ``base_lr * (1 - (step - warmup_steps) / (total_steps - warmup_steps)) ** power``. Here ``step`` counts
optimizer steps (not micro-batches: with gradient accumulation the schedule does not run ahead), and the
learning rate for the optimizer step with index ``step`` (0-based) is ``lr_at(step, ...)``. Being a function,
not an object with state, it needs nothing in a checkpoint beyond the step number.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, power: float = 2.0) -> float:
    """Learning rate for optimizer step ``step`` (0-based): 0 -> ``base_lr`` over warm-up, then decay to 0.

    Steps at or past ``total_steps`` get 0.0. Raises ``ValueError`` for a negative step or counts.
    """
    if step < 0 or warmup_steps < 0 or total_steps < 0:
        raise ValueError(f"lr_at(step={step}, warmup_steps={warmup_steps}, total_steps={total_steps}): "
                         f"expected all >= 0")
    if step >= total_steps:
        return 0.0
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    # warmup_steps <= step < total_steps, so the denominator is >= 1.
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return base_lr * (1.0 - progress) ** power


def apply_lr(optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], lr: float) -> None:
    """Set ``lr`` on every parameter group of one optimizer or of several (backbone and head)."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = (optimizers,)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
