"""Margin losses: they turn the cosines between embeddings and class centres into scaled logits.

``losses.margin``: ``CombinedMarginLoss`` (m1/m2/m3), ``ArcFace``, ``CosFace``; ``losses.adaface``: ``AdaFace``
(the margin follows each sample's embedding norm). The cross-entropy itself is ``partial_fc.PartialFC``'s,
across ranks.

The margin protocol (``Margin``): ``forward(cosines (B, C), labels (B,), norms (B,))`` checks its inputs and
returns ``(B, C)`` logits for a softmax cross-entropy; ``apply_margin`` with the same arguments does the same
without the checks (the head has checked every rank's labels already). Labels are column indices, or -1
where the sample's class is not among these columns. ``norms`` are the norms of the embeddings before
normalisation, which the head computes anyway: AdaFace reads them, the angle-only margins ignore them.

``build_margin(cfg)`` builds the configured margin from the table ``MARGINS`` (config key ``margin``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from torch import Tensor, nn

from losses.adaface import AdaFace
from losses.margin import ArcFace, CombinedMarginLoss, CosFace, GradientMode

__all__ = ["MARGINS", "AdaFace", "ArcFace", "CombinedMarginLoss", "CosFace", "GradientMode", "Margin",
           "build_margin"]


class Margin(Protocol):
    """What ``partial_fc.PartialFC`` calls on its margin (every margin of this package)."""

    def apply_margin(self, cosines: Tensor, labels: Tensor, norms: Tensor) -> Tensor: ...

# Optional, for margins that change only the target column (``CombinedMarginLoss`` and so ArcFace and CosFace):
# ``target_only_scale() -> s or None`` (s when every other logit is s·cos) and ``target_logits(x) -> (logits,
# slopes)`` of target cosines. With them the head fuses the margin into its cross-entropy and never stores the
# (B, C) logits (``partial_fc.functions.MarginSoftmax``); AdaFace clamps every column and is applied as above.


# config `margin` -> the margin module built from the config's keys.
MARGINS: dict[str, Callable[[Mapping[str, Any]], nn.Module]] = {
    "combined": lambda cfg: CombinedMarginLoss(cfg["margin_scale"], *cfg["margin_list"],
                                               cfg["interclass_filtering_threshold"], gradient=cfg["margin_gradient"]),
    "adaface": lambda cfg: AdaFace(cfg["margin_scale"], cfg["adaface_m"], cfg["adaface_h"], cfg["adaface_t_alpha"],
                                   gradient=cfg["margin_gradient"]),
}


def build_margin(cfg: Mapping[str, Any]) -> nn.Module:
    """The margin a config asks for (``cfg["margin"]``, a key of ``MARGINS``); ``ValueError`` for another name."""
    name = cfg["margin"]
    if name not in MARGINS:
        raise ValueError(f"margin = {name!r} is unknown; expected one of {sorted(MARGINS)}")
    return MARGINS[name](cfg)
