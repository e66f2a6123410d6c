"""arcface_torch's current learning-rate schedule, written out independently, for tests/test_lr_scheduler.py and
tests/test_recipes.py (imported by tests; not a test module)."""
from __future__ import annotations


def reference_polynomial_warmup(base_lr: float, warmup: int, total: int, power: float, steps: int) -> list[float]:
    """The learning rate of each of the first ``steps`` updates under arcface_torch's current PolynomialLRWarmup.

    Written out independently from its behaviour: a torch scheduler's constructor takes step 0, which returns
    the optimizer's initial lr (the peak); every later step ``l`` returns ``base * l / w`` while ``l <= w`` and
    otherwise multiplies the previous lr by ``((1 - (l - w)/(t - w)) / (1 - (l - 1 - w)/(t - w))) ** power``; past
    ``t`` it keeps the last value. Update ``k`` (0-based) uses the value of step ``k``. ``warmup`` may be
    negative (a recipe's ``warmup_epoch = -1``).
    """
    lrs, lr = [], base_lr
    for step in range(steps):
        if 0 < step <= total:  # step 0 and steps past the end keep the previous value
            if step <= warmup:
                lr = base_lr * step / warmup
            else:
                ratio = (1.0 - (step - warmup) / (total - warmup)) / (1.0 - (step - 1 - warmup) / (total - warmup))
                lr *= ratio ** power
        lrs.append(lr)
    return lrs
