"""ArcFace, CosFace and their combination: margins that turn cosines into scaled logits.

``partial_fc.PartialFC`` takes the cross-entropy. For a sample ``i`` whose target ``y_i`` is among the columns
(label -1: it is not, and the row is only scaled):

    out[i, y_i] = s · (cos(m1·θ + m2) − m3),   θ = arccos(cos θ)       (target)
    out[i, j]   = s · cos θ_ij                                          (every other column)

``m1``: SphereFace's multiplicative angular margin; ``m2``: ArcFace's additive angular margin (Deng et al., CVPR
2019); ``m3``: CosFace's additive cosine margin (Wang et al., CVPR 2018). Forward values equal arcface_torch's
``CombinedMarginLoss``. ``gradient="straight_through"`` (its behaviour) treats the margin as a constant in the
backward, ``"exact"`` differentiates it. Where it differs from the reference on purpose, the exact gradient near
θ = 0 and inter-class filtering: docs/partial_fc.md#margin-losses.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

__all__ = ["ArcFace", "CombinedMarginLoss", "CosFace", "GradientMode", "check_labels"]

GradientMode = Literal["straight_through", "exact"]
_GRADIENT_MODES = ("straight_through", "exact")


def _target_margin(x: Tensor, m1: float, m2: float, m3: float) -> Tensor:
    """``cos(m1·arccos(x) + m2) − m3`` for cosines ``x`` (any shape), computed in fp32 or better."""
    if m1 == 1.0 and m2 == 0.0:
        return x - m3  # CosFace: no arccos/cos round trip, so values equal the reference's bit for bit
    theta = torch.acos(x.clamp(-1.0, 1.0))
    return torch.cos(theta * m1 + m2) - m3


def _exact_factor(x: Tensor, m1: float, m2: float) -> Tensor:
    """``d/dx cos(m1·arccos(x) + m2) = m1·sin(m1θ + m2)/sin θ``, saturated near ``x = ±1``."""
    delta = 8.0 * torch.finfo(x.dtype).eps
    theta = torch.acos(x.clamp(-1.0 + delta, 1.0 - delta))
    # sin(theta) from the same theta, so that m1 = 1, m2 = 0 gives exactly 1.
    return m1 * torch.sin(theta * m1 + m2) / torch.sin(theta)


def check_labels(owner: str, cosines: Tensor, labels: Tensor) -> Tensor:
    """``labels`` as ``(B,)`` int64 after checking them against ``cosines (B, C)``: one label per row, each in
    ``[-1, C)`` (-1 = the row's class is not among these columns). Reads the labels on the host.
    Raises ``ValueError`` naming ``owner``, the shapes or the first bad label."""
    if cosines.dim() != 2:
        raise ValueError(f"{owner}: cosines must be (B, C), got shape {tuple(cosines.shape)}")
    flat = labels.reshape(-1)
    if flat.numel() != cosines.shape[0] or flat.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{owner}: labels must be {cosines.shape[0]} int64 values for cosines of "
                         f"shape {tuple(cosines.shape)}, got shape {tuple(labels.shape)} dtype {labels.dtype}")
    flat = flat.long()
    bad = (flat < -1) | (flat >= cosines.shape[1])  # (B,)
    if bool(bad.any()):
        raise ValueError(f"{owner}: label {int(flat[bad][0])} is outside [-1, {cosines.shape[1]}) "
                         f"(-1 = target not in these {cosines.shape[1]} columns)")
    return flat


class _MarginFunction(torch.autograd.Function):
    """Scaled logits with the target margin; one pass over (B, C) forward and backward.

    Forward: ``out = s·cos`` except ``out[i, y_i] = s·(cos(m1θ + m2) − m3)`` and filtered entries 0.
    Backward: ``∂out/∂cos = s`` (0 where filtered); on targets ``s·factor`` in exact mode.
    Target entries are read and written with gather/scatter over every row (a row whose target is -1
    reads column 0 and writes back what is there), so nothing depends on how many rows have a target
    here: no host synchronisation and a fixed number of operations on any device.
    """

    @staticmethod
    def forward(ctx, cos: Tensor, labels: Tensor, s: float, m1: float, m2: float, m3: float,
                threshold: float, exact: bool) -> Tensor:
        has = (labels != -1)[:, None]  # (B, 1)
        col = labels.clamp_min(0)[:, None]  # (B, 1)
        work_dtype = torch.promote_types(cos.dtype, torch.float32)
        x_t = cos.gather(1, col).to(work_dtype)  # (B, 1)
        if threshold > 0:
            keep = cos <= threshold  # (B, C) bool
            keep.scatter_(1, col, keep.gather(1, col) | has)
            out = cos.masked_fill(~keep, 0.0).mul_(s)  # (B, C)
        else:
            keep = None
            out = cos * s  # (B, C)
        target = (_target_margin(x_t, m1, m2, m3) * s).to(out.dtype)  # (B, 1)
        out.scatter_(1, col, torch.where(has, target, out.gather(1, col)))
        ctx.s = s
        ctx.exact = exact and not (m1 == 1.0 and m2 == 0.0)
        ctx.m1, ctx.m2 = m1, m2
        ctx.save_for_backward(has, col, x_t, keep)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        has, col, x_t, keep = ctx.saved_tensors
        grad = grad_out * ctx.s  # (B, C)
        if keep is not None:
            grad.masked_fill_(~keep, 0.0)
        if ctx.exact:
            factor = torch.where(has, _exact_factor(x_t, ctx.m1, ctx.m2), 1.0)  # (B, 1)
            grad.scatter_(1, col, (grad.gather(1, col).to(factor.dtype) * factor).to(grad.dtype))
        return grad, None, None, None, None, None, None, None


class CombinedMarginLoss(nn.Module):
    """Scaled cosine logits with margins ``s·(cos(m1·θ + m2) − m3)`` on each sample's target.

    Args:
        s: scale, > 0.
        m1: multiplicative angular margin, >= 1 (1 disables it).
        m2: additive angular margin in [0, π/2) (0 disables it).
        m3: additive cosine margin, >= 0 (0 disables it).
        interclass_filtering_threshold: 0 disables; in (0, 1) zeroes every non-target cosine above it.
        gradient: ``"straight_through"`` (the reference's: ∂out/∂cos = s on the target) or ``"exact"``
            (the true derivative, saturated near θ = 0 and θ = π); see docs/partial_fc.md#margin-losses.

    ``forward(cosines (B, C), labels (B,) or (B, 1) int64)`` returns ``(B, C)`` scaled logits; labels
    are column indices into ``cosines`` or ``-1`` for "target not among these columns".
    Raises ``ValueError`` for a bad margin, mode or label.
    """

    def __init__(self, s: float, m1: float, m2: float, m3: float, interclass_filtering_threshold: float = 0.0,
                 gradient: GradientMode = "straight_through") -> None:
        super().__init__()
        checks = (
            ("s", s, math.isfinite(s) and s > 0, "a finite value > 0"),
            ("m1", m1, math.isfinite(m1) and m1 >= 1.0, "a finite value >= 1 (1 = no multiplicative margin)"),
            ("m2", m2, 0.0 <= m2 < math.pi / 2, "a value in [0, pi/2)"),
            ("m3", m3, math.isfinite(m3) and m3 >= 0.0, "a finite value >= 0"),
            ("interclass_filtering_threshold", interclass_filtering_threshold,
             0.0 <= interclass_filtering_threshold < 1.0, "0 (off) or a cosine in (0, 1)"),
        )
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"CombinedMarginLoss: {name}={value!r} is not allowed; expected {allowed}")
        if gradient not in _GRADIENT_MODES:
            raise ValueError(f"CombinedMarginLoss: gradient={gradient!r} is unknown; expected one of {_GRADIENT_MODES}")
        self.s = float(s)
        self.m1 = float(m1)
        self.m2 = float(m2)
        self.m3 = float(m3)
        self.interclass_filtering_threshold = float(interclass_filtering_threshold)
        self.gradient: GradientMode = gradient

    def extra_repr(self) -> str:
        return (f"s={self.s}, m1={self.m1}, m2={self.m2}, m3={self.m3}, "
                f"interclass_filtering_threshold={self.interclass_filtering_threshold}, gradient={self.gradient!r}")

    def forward(self, logits: Tensor, labels: Tensor, norms: Tensor | None = None) -> Tensor:
        """Scaled logits ``(B, C)`` from cosines ``logits (B, C)`` and ``labels (B,)``/``(B, 1)`` (-1 = absent).

        Checks shapes, dtype and the label range (reading the labels on the host), then ``apply_margin``.
        ``norms`` is accepted for the common margin protocol (see ``losses``) and not used.
        """
        return self.apply_margin(logits, check_labels(type(self).__name__, logits, labels))

    def target_only_scale(self) -> float | None:
        """``s`` when every non-target logit is ``s·cos`` (no inter-class filtering), so that a head may fuse
        this margin into its cross-entropy through ``target_logits``; None otherwise."""
        return self.s if self.interclass_filtering_threshold == 0 else None

    def target_logits(self, cosines: Tensor) -> tuple[Tensor, Tensor]:
        """``(logits, slopes)`` of target cosines ``cosines`` (any shape): ``s·(cos(m1·θ + m2) − m3)`` and the
        derivative the backward uses, ``s`` (straight-through) or ``s·m1·sin(m1·θ + m2)/sin θ`` (exact), as
        ``apply_margin`` computes them on the target columns."""
        x = cosines.to(torch.promote_types(cosines.dtype, torch.float32))
        logits = _target_margin(x, self.m1, self.m2, self.m3) * self.s
        if self.gradient == "exact" and not (self.m1 == 1.0 and self.m2 == 0.0):
            return logits, _exact_factor(x, self.m1, self.m2) * self.s
        return logits, torch.full_like(logits, self.s)

    def apply_margin(self, logits: Tensor, labels: Tensor, norms: Tensor | None = None) -> Tensor:
        """``forward`` without the checks (which read the labels on the host), for callers that built ``labels
        (B,) int64`` in range themselves, as ``partial_fc.PartialFC`` does. ``norms`` is not used: these margins
        depend on the angle only."""
        if logits.shape[1] == 0:  # no class here (a rank none of whose classes a sampled step uses): no target
            return logits * self.s
        return _MarginFunction.apply(logits, labels, self.s, self.m1, self.m2, self.m3,
                                     self.interclass_filtering_threshold, self.gradient == "exact")


class ArcFace(CombinedMarginLoss):
    """ArcFace: ``s·cos(θ + margin)`` on the target (``CombinedMarginLoss(s, 1, margin, 0)``)."""

    def __init__(self, s: float = 64.0, margin: float = 0.5, gradient: GradientMode = "straight_through") -> None:
        super().__init__(s, 1.0, margin, 0.0, gradient=gradient)


class CosFace(CombinedMarginLoss):
    """CosFace: ``s·(cos θ − m)`` on the target (``CombinedMarginLoss(s, 1, 0, m)``)."""

    def __init__(self, s: float = 64.0, m: float = 0.4, gradient: GradientMode = "straight_through") -> None:
        super().__init__(s, 1.0, 0.0, m, gradient=gradient)
