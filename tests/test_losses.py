"""Margin losses: values against a per-sample loop and insightface's formulas, gradients, errors."""
from __future__ import annotations

import math

import pytest
import torch

from losses import AdaFace, ArcFace, CombinedMarginLoss, CosFace
from tests.references import adaface_reference

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


@pytest.mark.parametrize("margins", [(1.0, 0.5, 0.0), (1.0, 0.0, 0.4), (1.35, 0.0, 0.0), (1.2, 0.3, 0.2),
                                     (1.0, 0.0, 0.0)])
@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_forward_matches_loop(margins, threshold):
    g = torch.Generator().manual_seed(1)
    cos = torch.rand(6, 7, generator=g) * 2 - 1
    cos[0, 2] = 1.0  # θ = 0
    cos[1, 4] = -1.0  # θ = π
    labels = torch.tensor([2, 4, -1, 0, 6, -1])
    loss = CombinedMarginLoss(30.0, *margins, interclass_filtering_threshold=threshold)
    out = loss(cos.clone(), labels)
    torch.testing.assert_close(out.double(), _loop_reference(cos, labels, 30.0, *margins, threshold),
                               atol=2e-5, rtol=1e-6)


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
    (dict(s=64.0, m1=1.0, m2=0.0, m3=0.2, interclass_filtering_threshold=1.0),
     r"interclass_filtering_threshold=1.0 is not allowed; expected 0 \(off\) or a cosine in \(0, 1\)"),
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


# ---------------------------------------------------------------------------------------- AdaFace
def _adaface_inputs():
    g = torch.Generator().manual_seed(4)
    cos = torch.rand(7, 5, generator=g, dtype=torch.float64) * 1.8 - 0.9
    labels = torch.tensor([0, 1, -1, 3, 4, 2, 1])
    norms = torch.tensor([60.0, 2.0, 15.0, 25.0, 0.0001, 300.0, 18.0], dtype=torch.float64)
    cos[0, 0] = math.cos(0.2)  # high norm (q = 1): theta - m < eps, the angle clip binds
    cos[1, 1] = -0.99999  # low norm (q = -1): theta + m > pi - eps, the angle clip binds
    cos[3, 0], cos[3, 3] = 1.0, -1.0  # outside the cosine clamp
    cos[4, 1] = 0.9995  # above 1 - eps: clamped
    return cos, labels, norms


@pytest.mark.parametrize("t_alpha, mean0, std0", [(1.0, 20.0, 100.0), (0.01, 20.0, 5.0)])
def test_adaface_values_and_exact_gradient_match_the_paper(t_alpha, mean0, std0):
    cos, labels, norms = _adaface_inputs()
    margin = AdaFace(s=32.0, m=0.4, h=0.333, t_alpha=t_alpha)
    margin.batch_mean.fill_(mean0)
    margin.batch_std.fill_(std0)
    x = cos.float().requires_grad_()
    weights = torch.randn(cos.shape, generator=torch.Generator().manual_seed(5))
    out = margin(x, labels, norms.float())
    (out * weights).sum().backward()
    ref_x = cos.clone().requires_grad_()
    ref, mean, std = adaface_reference(ref_x, labels, norms, mean0, std0, 32.0, 0.4, 0.333, t_alpha)
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, atol=2e-5, rtol=1e-5)
    assert x.grad[3, 0] == 0 and x.grad[3, 3] == 0 and x.grad[4, 1] == 0  # the cosine clamp binds
    if std0 == 5.0:  # q = +1 and -1: the angle clip binds on samples 0 and 1
        assert x.grad[0, 0] == 0 and x.grad[1, 1] == 0
    assert math.isclose(float(margin.batch_mean), mean, rel_tol=1e-6)
    assert math.isclose(float(margin.batch_std), std, rel_tol=1e-6)


def test_adaface_running_statistics():
    """Three batches follow the EMA; eval mode, a one-sample batch and non-finite norms leave them alone."""
    margin = AdaFace(s=16.0, m=0.4, h=0.333, t_alpha=0.3)
    cos, labels, _ = _adaface_inputs()
    mean, std = 20.0, 100.0
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        norms = torch.rand(7, generator=g, dtype=torch.float64) * 30
        out = margin(cos.float(), labels, norms.float())
        ref, mean, std = adaface_reference(cos, labels, norms, mean, std, 16.0, 0.4, 0.333, 0.3)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-6)
    assert math.isclose(float(margin.batch_mean), mean, rel_tol=1e-6)
    assert math.isclose(float(margin.batch_std), std, rel_tol=1e-6)
    saved = [b.clone() for b in margin.buffers()]
    margin.eval()
    margin(cos.float(), labels, torch.full((7,), 50.0))
    margin.train()
    margin(cos[:1].float(), labels[:1], torch.tensor([50.0]))  # std of one sample is undefined
    nan_norms = torch.full((7,), 10.0)
    nan_norms[2] = float("nan")
    margin(cos.float(), labels, nan_norms)
    assert all(torch.equal(b, a) for b, a in zip(margin.buffers(), saved))
    margin(cos.float(), labels, torch.full((7,), float("inf")))  # clipped to 100: finite statistics, used
    torch.testing.assert_close(margin.batch_mean, saved[0] * 0.7 + 30.0)
    torch.testing.assert_close(margin.batch_std, saved[1] * 0.7)
    assert margin.state_dict().keys() == {"batch_mean", "batch_std"}


def test_adaface_straight_through_gradient_is_s_everywhere():
    cos, labels, norms = _adaface_inputs()
    x = cos.float().requires_grad_()
    weights = torch.randn(cos.shape)
    (AdaFace(s=8.0, gradient="straight_through")(x, labels, norms.float()) * weights).sum().backward()
    torch.testing.assert_close(x.grad, 8.0 * weights)


def test_adaface_h_zero_is_cosface():
    cos, labels, norms = _adaface_inputs()
    cos = cos.float().clamp(-0.99, 0.99)
    torch.testing.assert_close(AdaFace(s=8.0, m=0.3, h=0.0)(cos, labels, norms.float()),
                               CosFace(s=8.0, m=0.3)(cos, labels))


@pytest.mark.parametrize("kwargs, name", [
    (dict(s=-1.0), "s=-1.0"), (dict(m=-0.1), "m=-0.1"), (dict(h=float("nan")), "h=nan"),
    (dict(t_alpha=0.0), "t_alpha=0.0"), (dict(gradient="approx"), "gradient='approx'"),
])
def test_adaface_bad_arguments_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AdaFace(**kwargs)


def test_adaface_checks_labels_and_norms():
    with pytest.raises(ValueError, match="AdaFace: label 5 is outside"):
        AdaFace()(torch.zeros(2, 5), torch.tensor([0, 5]), torch.ones(2))
    with pytest.raises(ValueError, match=r"norms must be \(2,\)"):
        AdaFace()(torch.zeros(2, 5), torch.tensor([0, 1]), torch.ones(2, 1))


def test_build_margin_by_name():
    from losses import MARGINS, build_margin

    settings = {"scale": 30.0, "gradient": "exact", "margin_list": (1.0, 0.0, 0.35),
                "interclass_filtering_threshold": 0.2, "adaface_m": 0.3, "adaface_h": 0.5, "adaface_t_alpha": 0.1}
    combined = build_margin("combined", **settings)
    assert isinstance(combined, CombinedMarginLoss)
    assert (combined.s, combined.m1, combined.m2, combined.m3, combined.gradient) == (30.0, 1.0, 0.0, 0.35, "exact")
    assert combined.interclass_filtering_threshold == 0.2
    ada = build_margin("adaface", **settings | {"gradient": "straight_through"})
    assert isinstance(ada, AdaFace)
    assert (ada.s, ada.m, ada.h, ada.t_alpha, ada.gradient) == (30.0, 0.3, 0.5, 0.1, "straight_through")
    # README: the config's margin_gradient defaults to straight-through; the classes used directly differ.
    assert (AdaFace().gradient, CombinedMarginLoss(64.0, 1.0, 0.5, 0.0).gradient) == ("exact", "straight_through")
    assert sorted(MARGINS) == ["adaface", "combined"]
    with pytest.raises(ValueError, match=r"margin = 'sphereface' is unknown; expected one of \['adaface', 'c"):
        build_margin("sphereface", **settings)


def test_the_trainer_builds_the_margin_its_config_names():
    from trainer.build import build_margin_of
    from utils.config import load_config

    combined = build_margin_of(load_config("configs/debug_cpu", ["margin_list=1,0,0.35", "margin_scale=30",
                                                                 "margin_gradient=exact"]))
    assert isinstance(combined, CombinedMarginLoss)
    assert (combined.s, combined.m1, combined.m2, combined.m3, combined.gradient) == (30.0, 1.0, 0.0, 0.35, "exact")
    ada = build_margin_of(load_config("configs/debug_cpu", ["margin=adaface", "adaface_m=0.3", "adaface_h=0.5",
                                                            "adaface_t_alpha=0.1", "margin_scale=32"]))
    assert isinstance(ada, AdaFace)
    assert (ada.s, ada.m, ada.h, ada.t_alpha, ada.gradient) == (32.0, 0.3, 0.5, 0.1, "straight_through")
