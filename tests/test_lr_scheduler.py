"""utils.lr_scheduler: boundary values for power 1 and 2, shape of the curve, agreement with arcface_torch."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import reference_polynomial_warmup
from utils.lr_scheduler import apply_lr, lr_at


def _reference_poly(step: int, base_lr: float, warmup: int, total: int) -> float:
    """arcface_torch's older PolyScheduler.get_lr written out independently (power 2, last_epoch = step)."""
    if step < warmup:
        return base_lr * float(step) / float(warmup)
    return base_lr * pow(1 - float(step - warmup) / float(total - warmup), 2)


def test_boundaries_with_warmup_power_1():
    assert lr_at(0, 0.1, 10, 100) == 0.0
    assert lr_at(5, 0.1, 10, 100) == pytest.approx(0.05)
    assert lr_at(10, 0.1, 10, 100) == pytest.approx(0.1)  # end of warm-up: the peak
    assert lr_at(55, 0.1, 10, 100) == pytest.approx(0.1 * 0.5)
    assert lr_at(99, 0.1, 10, 100) == pytest.approx(0.1 / 90)
    assert lr_at(100, 0.1, 10, 100) == 0.0
    assert lr_at(10_000, 0.1, 10, 100) == 0.0


def test_boundaries_with_warmup_power_2():
    assert lr_at(0, 0.1, 10, 100, power=2.0) == 0.0
    assert lr_at(5, 0.1, 10, 100, power=2.0) == pytest.approx(0.05)  # warm-up does not depend on the power
    assert lr_at(10, 0.1, 10, 100, power=2.0) == pytest.approx(0.1)
    assert lr_at(55, 0.1, 10, 100, power=2.0) == pytest.approx(0.1 * 0.5 ** 2)
    assert lr_at(99, 0.1, 10, 100, power=2.0) == pytest.approx(0.1 * (1 / 90) ** 2)
    assert lr_at(100, 0.1, 10, 100, power=2.0) == 0.0


def test_default_power_is_linear():
    lrs = [lr_at(s, 1.0, 0, 8) for s in range(9)]
    assert lrs == pytest.approx([1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0])
    assert [lr_at(s, 1.0, 0, 8, power=1.0) for s in range(9)] == lrs


def test_no_warmup_starts_at_peak():
    assert lr_at(0, 0.2, 0, 50) == pytest.approx(0.2)
    assert lr_at(25, 0.2, 0, 50) == pytest.approx(0.2 * 0.5)
    assert lr_at(25, 0.2, 0, 50, power=2.0) == pytest.approx(0.2 * 0.25)


@pytest.mark.parametrize("power", [1.0, 2.0, 0.5])
def test_monotonic_up_then_down(power):
    lrs = [lr_at(s, 1.0, 20, 200, power=power) for s in range(201)]
    assert all(a < b for a, b in zip(lrs[:20], lrs[1:21]))
    assert all(a > b for a, b in zip(lrs[20:200], lrs[21:201]))
    assert max(lrs) == lrs[20] == pytest.approx(1.0)


@pytest.mark.parametrize("warmup,total", [(0, 37), (3, 37), (10, 11), (100, 5000)])
def test_power_2_matches_older_poly_scheduler(warmup, total):
    for step in range(total):
        assert lr_at(step, 0.4, warmup, total, power=2.0) == pytest.approx(
            _reference_poly(step, 0.4, warmup, total), rel=1e-12)


@pytest.mark.parametrize("power", [1.0, 2.0])
@pytest.mark.parametrize("warmup,total", [(0, 37), (3, 37), (10, 11), (100, 5000)])
def test_matches_current_polynomial_warmup(warmup, total, power):
    reference = reference_polynomial_warmup(0.4, warmup, total, power, total + 3)
    ours = [lr_at(step, 0.4, warmup, total, power=power) for step in range(total + 3)]
    # Step 0 with warm-up is the one documented difference (the reference trains it at the peak).
    first = 1 if warmup > 0 else 0
    assert ours[first:] == pytest.approx(reference[first:], rel=1e-9, abs=1e-15)
    if warmup > 0:
        assert (ours[0], reference[0]) == (0.0, 0.4)


def test_power_changes_only_the_decay():
    assert lr_at(50, 1.0, 0, 100, power=1.0) == pytest.approx(0.5)
    assert lr_at(50, 1.0, 0, 100, power=3.0) == pytest.approx(0.125)
    assert lr_at(3, 1.0, 10, 100, power=1.0) == lr_at(3, 1.0, 10, 100, power=3.0)


@pytest.mark.parametrize("power", [0.0, -1.0, math.inf, math.nan])
def test_bad_power_rejected(power):
    with pytest.raises(ValueError, match="power"):
        lr_at(5, 0.1, 0, 10, power=power)


def test_negative_step_rejected():
    with pytest.raises(ValueError, match="step=-1"):
        lr_at(-1, 0.1, 0, 10)


def test_apply_lr_sets_every_group_of_every_optimizer():
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    sgd = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    adamw = torch.optim.AdamW([c], lr=0.1)
    apply_lr([sgd, adamw], 0.0123)
    assert [g["lr"] for g in sgd.param_groups + adamw.param_groups] == [0.0123] * 3
    apply_lr(sgd, 0.5)
    assert [g["lr"] for g in sgd.param_groups] == [0.5, 0.5]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_trainer_applies_lr_power(tmp_path):
    """train.py passes `lr_power` on: the logged lr of each step follows lr_at with that power."""
    import re

    from tests.helpers import train

    output = tmp_path / "out"
    train("configs/debug_cpu", output, "max_steps=6", "frequent=1", "save_every_steps=0", "lr_power=3")
    logged = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+)/6 .*\| lr (\S+) \|",
                                                                       (output / "training.log").read_text())}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6], logged
    # The line of step n reports the lr of update n - 1 (0-based), which lr_at gives.
    for step, lr in logged.items():
        assert lr == pytest.approx(lr_at(step - 1, 0.1, 0, 6, power=3.0), abs=1e-6), (step, lr)
    assert logged[2] != pytest.approx(lr_at(1, 0.1, 0, 6, power=1.0), abs=1e-6)
