"""utils.lr_scheduler: boundary values, shape of the curve, agreement with arcface_torch's formula."""
from __future__ import annotations

import pytest
import torch

from utils.lr_scheduler import apply_lr, lr_at


def _reference_poly(step: int, base_lr: float, warmup: int, total: int) -> float:
    """arcface_torch PolyScheduler.get_lr written out independently (power 2, last_epoch = step)."""
    if step < warmup:
        return base_lr * float(step) / float(warmup)
    return base_lr * pow(1 - float(step - warmup) / float(total - warmup), 2)


def test_boundaries_with_warmup():
    assert lr_at(0, 0.1, 10, 100) == 0.0
    assert lr_at(5, 0.1, 10, 100) == pytest.approx(0.05)
    assert lr_at(10, 0.1, 10, 100) == pytest.approx(0.1)  # end of warm-up: the peak
    assert lr_at(55, 0.1, 10, 100) == pytest.approx(0.1 * 0.5 ** 2)
    assert lr_at(99, 0.1, 10, 100) == pytest.approx(0.1 * (1 / 90) ** 2)
    assert lr_at(100, 0.1, 10, 100) == 0.0
    assert lr_at(10_000, 0.1, 10, 100) == 0.0


def test_no_warmup_starts_at_peak():
    assert lr_at(0, 0.2, 0, 50) == pytest.approx(0.2)
    assert lr_at(25, 0.2, 0, 50) == pytest.approx(0.2 * 0.25)


def test_monotonic_up_then_down():
    lrs = [lr_at(s, 1.0, 20, 200) for s in range(201)]
    assert all(a < b for a, b in zip(lrs[:20], lrs[1:21]))
    assert all(a > b for a, b in zip(lrs[20:200], lrs[21:201]))
    assert max(lrs) == lrs[20] == pytest.approx(1.0)


@pytest.mark.parametrize("warmup,total", [(0, 37), (3, 37), (10, 11), (100, 5000)])
def test_matches_reference_formula(warmup, total):
    for step in range(total):
        assert lr_at(step, 0.4, warmup, total) == pytest.approx(_reference_poly(step, 0.4, warmup, total), rel=1e-12)


def test_power_is_a_parameter():
    assert lr_at(50, 1.0, 0, 100, power=1.0) == pytest.approx(0.5)


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
