"""Learning-rate schedule: linear warm-up, then polynomial decay to zero, as a pure function of the step.

``base_lr * step / warmup_steps`` during warm-up, then ``base_lr * (1 - (step - warmup_steps) /
(total_steps - warmup_steps)) ** power`` (the config's ``lr_power``). ``step`` counts optimizer steps, not
micro-batches, from 0: the step with index ``step`` trains at ``lr_at(step, ...)``. Being a function, not an
object with state, it needs nothing in a checkpoint beyond the step. A run continued with a changed schedule
takes its LR from ``trainer.run_state.step_lr``. How it compares with arcface_torch's schedulers:
docs/training.md#the-learning-rate-schedule.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, power: float = 1.0) -> float:
    """Learning rate for optimizer step ``step`` (0-based): 0 -> ``base_lr`` over warm-up, then decay to 0.

    ``power`` shapes the decay after warm-up (1 = linear, 2 = quadratic). Steps at or past ``total_steps``
    get 0.0. Raises ``ValueError`` for a negative step or count, or a ``power`` that is not finite and > 0.
    """
    if step < 0 or warmup_steps < 0 or total_steps < 0:
        raise ValueError(f"lr_at(step={step}, warmup_steps={warmup_steps}, total_steps={total_steps}): "
                         f"expected all >= 0")
    if not (math.isfinite(power) and power > 0):
        raise ValueError(f"lr_at(power={power}): expected a finite power > 0")
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
