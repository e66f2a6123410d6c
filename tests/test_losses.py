"""Margin losses: values against a per-sample loop and insightface's formulas, gradients, errors."""
from __future__ import annotations

import math

import pytest
import torch

from losses import ArcFace, CombinedMarginLoss, CosFace

pytestmark = pytest.mark.timeout(60)


def _loop_reference(cos: torch.Tensor, labels: torch.Tensor, s: float, m1: float, m2: float, m3: float,
                    threshold: float = 0.0) -> torch.Tensor:
    """Plain Python loop over samples and columns, in float64."""
    out = torch.empty(cos.shape, dtype=torch.float64)
    for i in range(cos.shape[0]):
        for j in range(cos.shape[1]):
            x = float(cos[i, j])
            if j == int(labels[i]):
                out[i, j] = s * (math.cos(m1 * math.acos(max(-1.0, min(1.0, x))) + m2) - m3)
            elif threshold > 0 and x > threshold:
                out[i, j] = 0.0
            else:
                out[i, j] = s * x
    return out


@pytest.mark.parametrize("margins", [(1.0, 0.5, 0.0), (1.0, 0.0, 0.4), (1.35, 0.0, 0.0), (1.2, 0.3, 0.2), (1.0, 0.0, 0.0)])
@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_forward_matches_loop(margins, threshold):
    g = torch.Generator().manual_seed(1)
    cos = torch.rand(6, 7, generator=g) * 2 - 1
    cos[0, 2] = 1.0  # θ = 0
    cos[1, 4] = -1.0  # θ = π
    labels = torch.tensor([2, 4, -1, 0, 6, -1])
    loss = CombinedMarginLoss(30.0, *margins, interclass_filtering_threshold=threshold)
    out = loss(cos.clone(), labels)
    torch.testing.assert_close(out.double(), _loop_reference(cos, labels, 30.0, *margins, threshold), atol=2e-5, rtol=1e-6)


def test_insightface_formula_values():
    # ArcFace in insightface's CombinedMarginLoss: s·cos(arccos(x) + m), no easy-margin fallback even past π.
    cos = torch.tensor([[0.8, 0.1], [-0.95, 0.3]])
    labels = torch.tensor([0, 0])
    out = ArcFace(s=64.0, margin=0.5)(cos, labels)
    expected_targets = [64 * math.cos(math.acos(0.8) + 0.5), 64 * math.cos(math.acos(-0.95) + 0.5)]
    torch.testing.assert_close(out[:, 0], torch.tensor(expected_targets))
    torch.testing.assert_close(out[:, 1], 64 * cos[:, 1])
    out = CosFace(s=64.0, m=0.4)(cos, labels)
    torch.testing.assert_close(out[:, 0], 64 * (cos[:, 0] - 0.4))
    # (B, 1) labels as the reference passes them
    torch.testing.assert_close(CosFace()(cos, labels[:, None]), out)


def test_minus_one_rows_untouched_and_input_not_modified():
    cos = torch.rand(4, 5) * 2 - 1
    before = cos.clone()
    out = ArcFace()(cos, torch.tensor([-1, 1, -1, -1]))
    torch.testing.assert_close(out[[0, 2, 3]], 64 * before[[0, 2, 3]])
    assert torch.equal(cos, before)


def test_interclass_filtering_semantics():
    # Every non-target cosine above the threshold is zeroed, also on rows whose target is elsewhere (-1);
    # the target itself is never filtered; filtered entries get no gradient.
    cos = torch.tensor([[0.9, 0.5, 0.1], [0.9, 0.5, 0.1]], requires_grad=True)
    loss = CombinedMarginLoss(2.0, 1.0, 0.0, 0.0, interclass_filtering_threshold=0.4)
    out = loss(cos, torch.tensor([0, -1]))
    torch.testing.assert_close(out.detach(), torch.tensor([[1.8, 0.0, 0.2], [0.0, 0.0, 0.2]]))
    out.sum().backward()
    torch.testing.assert_close(cos.grad, torch.tensor([[2.0, 0.0, 2.0], [0.0, 0.0, 2.0]]))


def test_straight_through_gradient_is_s_everywhere():
    cos = (torch.rand(5, 6) * 2 - 1).requires_grad_()
    weights = torch.randn(5, 6)
    (ArcFace(s=16.0)(cos, torch.tensor([0, 5, -1, 2, 3])) * weights).sum().backward()
    torch.testing.assert_close(cos.grad, 16.0 * weights)


@pytest.mark.parametrize("margins", [(1.0, 0.5, 0.0), (1.0, 0.0, 0.4), (1.7, 0.0, 0.0), (1.3, 0.4, 0.1)])
def test_exact_gradcheck(margins):
    # θ near 0 (0.01, 0.03), mid-range, and past m1·θ + m2 > π (θ = 2.9, 3.0).
    thetas = torch.tensor([0.01, 0.03, 0.7, 1.6, 2.9, 3.0], dtype=torch.float64)
    cos = torch.rand(6, 4, dtype=torch.float64) * 1.6 - 0.8
    labels = torch.tensor([0, 1, 2, 3, 0, -1])
    cos[torch.arange(5), labels[:5]] = torch.cos(thetas[:5])
    cos[5, 1] = math.cos(3.0)
    cos.requires_grad_()
    loss = CombinedMarginLoss(4.0, *margins, gradient="exact")
    assert torch.autograd.gradcheck(lambda c: loss(c, labels), (cos,), eps=1e-7, atol=1e-5)


def test_exact_gradient_values_and_saturation():
    x = torch.tensor([[math.cos(0.4)], [1.0], [-1.0]], requires_grad=True)
    ArcFace(s=2.0, margin=0.5, gradient="exact")(x, torch.tensor([0, 0, 0])).sum().backward()
    assert math.isclose(float(x.grad[0, 0]), 2.0 * math.sin(0.9) / math.sin(0.4), rel_tol=1e-5)
    assert torch.isfinite(x.grad).all(), x.grad
    # m1 = 1, m2 = 0 (CosFace): exactly s, also at θ = 0.
    y = torch.tensor([[1.0], [0.3]], requires_grad=True)
    CombinedMarginLoss(3.0, 1.0, 0.0, 0.2, gradient="exact")(y, torch.tensor([0, 0])).sum().backward()
    torch.testing.assert_close(y.grad, torch.full((2, 1), 3.0))


@pytest.mark.parametrize("kwargs, name", [
    (dict(s=0.0, m1=1.0, m2=0.5, m3=0.0), "s=0.0"),
    (dict(s=64.0, m1=0.9, m2=0.5, m3=0.0), "m1=0.9"),
    (dict(s=64.0, m1=1.0, m2=-0.1, m3=0.0), "m2=-0.1"),
    (dict(s=64.0, m1=1.0, m2=1.6, m3=0.0), "m2=1.6"),
    (dict(s=64.0, m1=1.0, m2=0.0, m3=-0.2), "m3=-0.2"),
    (dict(s=64.0, m1=1.0, m2=0.0, m3=0.2, interclass_filtering_threshold=-0.5), "interclass_filtering_threshold=-0.5"),
    (dict(s=64.0, m1=1.0, m2=0.0, m3=0.2, gradient="approx"), "gradient='approx'"),
])
def test_bad_arguments_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CombinedMarginLoss(**kwargs)


def test_bad_labels_raise():
    with pytest.raises(ValueError, match="label 5 is outside"):
        ArcFace()(torch.zeros(2, 5), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="label -2"):
        ArcFace()(torch.zeros(2, 5), torch.tensor([-2, 0]))
