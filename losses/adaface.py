"""AdaFace: a margin that follows each sample's image quality, read from its embedding norm.

Kim, Jain and Liu, "AdaFace: Quality Adaptive Margin for Face Recognition", CVPR 2022. With ``ε = 1e-3``:

    n_i     = clip(‖z_i‖, 0.001, 100)                           no gradient flows through the norm
    μ ← α·mean(n) + (1 − α)·μ,   σ ← α·std(n) + (1 − α)·σ        once per forward in training mode, before use;
                                                                 α = t_alpha, std unbiased, μ₀ = 20, σ₀ = 100
    q_i     = clip(h · (n_i − μ) / (σ + ε), −1, 1)               the quality indicator
    g_angle = −m · q_i,    g_add = m + m · q_i
    out[i, y_i] = s · (cos(clip(θ_i + g_angle, ε, π − ε)) − g_add),   θ_i = arccos(x_iy)
    out[i, j]   = s · x_ij,   x = clamp(cos θ, −1 + ε, 1 − ε)     every other column

These are the authors' head's values. A batch of fewer than 2 samples or with a non-finite statistic leaves the
statistics (buffers) as they were. Inside ``PartialFC`` the norms are the global batch's, so every rank keeps the
same statistics without a collective. See docs/partial_fc.md#adaface.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from losses.margin import GradientMode, check_labels

__all__ = ["AdaFace"]

_EPS = 1e-3  # the authors' ε: cosine clamp, angle clip, and the std's guard
_NORM_RANGE = (0.001, 100.0)  # the authors' clip of the norms
_INITIAL_MEAN, _INITIAL_STD = 20.0, 100.0  # the authors' initial statistics
_GRADIENT_MODES = ("straight_through", "exact")


class _AdaFaceFunction(torch.autograd.Function):
    """Scaled logits with per-sample margins ``g_angle, g_add (B, 1)``; one pass over (B, C) each way.

    Forward: ``out = s·clamp(cos, −1+ε, 1−ε)``, on targets ``s·(cos(clip(θ + g_angle, ε, π−ε)) − g_add)``.
    Backward (exact): ``∂out/∂cos = s·[−1+ε <= cos <= 1−ε]``, on targets times ``sin θ_m / sin θ`` where the
    angle clip does not bind (0 where it does); straight-through: ``s`` everywhere.
    Targets are read and written with gather/scatter over every row (a row whose target is -1 reads column 0
    and writes back what is there): a fixed number of operations, no host synchronisation.
    """

    @staticmethod
    def forward(ctx, cos: Tensor, labels: Tensor, g_angle: Tensor, g_add: Tensor, s: float, exact: bool) -> Tensor:
        has = (labels != -1)[:, None]  # (B, 1)
        col = labels.clamp_min(0)[:, None]  # (B, 1)
        work_dtype = torch.promote_types(cos.dtype, torch.float32)
        out = cos.to(work_dtype).clamp(-1.0 + _EPS, 1.0 - _EPS)  # (B, C)
        theta = torch.acos(out.gather(1, col))  # (B, 1)
        shifted = theta + g_angle  # (B, 1)
        theta_m = shifted.clamp(_EPS, math.pi - _EPS)  # (B, 1)
        target = (torch.cos(theta_m) - g_add) * s  # (B, 1)
        out.mul_(s)
        out.scatter_(1, col, torch.where(has, target, out.gather(1, col)))
        ctx.s, ctx.exact = s, exact
        if exact:
            inside = (shifted >= _EPS) & (shifted <= math.pi - _EPS)  # (B, 1) the angle clip passes gradient
            factor = torch.where(has & inside, torch.sin(theta_m) / torch.sin(theta), torch.where(has, 0.0, 1.0))
            ctx.save_for_backward(cos, col, factor)
        return out.to(cos.dtype) if cos.dtype != work_dtype else out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad = grad_out * ctx.s  # (B, C)
        if ctx.exact:
            cos, col, factor = ctx.saved_tensors
            grad.masked_fill_((cos < -1.0 + _EPS) | (cos > 1.0 - _EPS), 0.0)  # clamp: no gradient where it binds
            grad.scatter_(1, col, (grad.gather(1, col) * factor).to(grad.dtype))
        return grad, None, None, None, None, None


class AdaFace(nn.Module):
    """AdaFace's quality-adaptive margin on cosine logits (the formula: the module docstring).

    Args:
        s: scale, > 0 (the paper's 64).
        m: margin, >= 0 (the paper's 0.4).
        h: concentration of the quality indicator, >= 0 (the paper's 0.333; 0 makes it CosFace with ``m``).
        t_alpha: weight of the current batch in the running statistics, in (0, 1] (the paper's 0.01).
        gradient: ``"exact"`` (default, the authors' autograd) or ``"straight_through"``.

    Buffers (identical on every rank inside ``PartialFC``): ``batch_mean`` (1,), ``batch_std`` (1,).
    ``forward(cosines (B, C), labels (B,), norms (B,))`` returns ``(B, C)`` scaled logits; labels are column
    indices or -1 ("target not among these columns"), ``norms`` the embeddings' norms (detached here).
    The statistics advance in training mode only, as batch norm's.
    """

    batch_mean: Tensor
    batch_std: Tensor

    def __init__(self, s: float = 64.0, m: float = 0.4, h: float = 0.333, t_alpha: float = 0.01,
                 gradient: GradientMode = "exact") -> None:
        super().__init__()
        checks = (
            ("s", s, math.isfinite(s) and s > 0, "a finite value > 0"),
            ("m", m, math.isfinite(m) and m >= 0, "a finite value >= 0"),
            ("h", h, math.isfinite(h) and h >= 0, "a finite value >= 0"),
            ("t_alpha", t_alpha, 0 < t_alpha <= 1, "a value in (0, 1]"),
        )
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"AdaFace: {name}={value!r} is not allowed; expected {allowed}")
        if gradient not in _GRADIENT_MODES:
            raise ValueError(f"AdaFace: gradient={gradient!r} is unknown; expected one of {_GRADIENT_MODES}")
        self.s, self.m, self.h, self.t_alpha = float(s), float(m), float(h), float(t_alpha)
        self.gradient: GradientMode = gradient
        self.register_buffer("batch_mean", torch.full((1,), _INITIAL_MEAN))
        self.register_buffer("batch_std", torch.full((1,), _INITIAL_STD))

    def extra_repr(self) -> str:
        return f"s={self.s}, m={self.m}, h={self.h}, t_alpha={self.t_alpha}, gradient={self.gradient!r}"

    def forward(self, cosines: Tensor, labels: Tensor, norms: Tensor) -> Tensor:
        """Scaled logits ``(B, C)``; checks the shapes and labels (reading them on the host), then
        ``apply_margin``. Raises ``ValueError`` naming what is wrong."""
        labels = check_labels("AdaFace", cosines, labels)
        if norms.shape != (cosines.shape[0],):
            raise ValueError(f"AdaFace: norms must be ({cosines.shape[0]},), one per row of the cosines, got shape "
                             f"{tuple(norms.shape)}")
        return self.apply_margin(cosines, labels, norms)

    @torch.no_grad()
    def _update_statistics(self, safe: Tensor) -> None:
        """EMA of the batch mean and unbiased std of ``safe (B,)``, kept as it was when they are not finite."""
        if safe.shape[0] < 2:  # the unbiased std of one sample is undefined
            return
        mean, std = safe.mean(), safe.std()  # () ()
        ok = torch.isfinite(mean) & torch.isfinite(std)  # ()
        alpha = self.t_alpha
        self.batch_mean.copy_(torch.where(ok, mean * alpha + (1.0 - alpha) * self.batch_mean, self.batch_mean))
        self.batch_std.copy_(torch.where(ok, std * alpha + (1.0 - alpha) * self.batch_std, self.batch_std))

    def apply_margin(self, cosines: Tensor, labels: Tensor, norms: Tensor) -> Tensor:
        """``forward`` without the checks (``partial_fc.PartialFC`` has checked every rank's labels)."""
        safe = norms.detach().float().clamp(*_NORM_RANGE)  # (B,)
        if self.training:
            self._update_statistics(safe)
        if cosines.shape[1] == 0:  # no class here (a rank none of whose classes a sampled step uses): no target
            return cosines * self.s
        quality = ((safe - self.batch_mean) / (self.batch_std + _EPS) * self.h).clamp(-1.0, 1.0)[:, None]  # (B, 1)
        g_angle = quality * -self.m  # (B, 1)
        g_add = quality * self.m + self.m  # (B, 1)
        return _AdaFaceFunction.apply(cosines, labels, g_angle, g_add, self.s, self.gradient == "exact")
