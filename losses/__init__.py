"""Margin losses: they turn the cosines between embeddings and class centres into scaled logits.

``ArcFace``, ``CosFace`` and ``CombinedMarginLoss`` (m1/m2/m3) in ``losses.margin``; ``AdaFace`` (the margin
follows each sample's embedding norm) in ``losses.adaface``; ``build_margin(name, ...)`` builds one by the config's
``margin`` from the table ``MARGINS``. The cross-entropy is ``partial_fc.PartialFC``'s.

The protocol (``Margin``): ``forward(cosines (B, C), labels (B,), norms (B,))`` checks its inputs and returns
``(B, C)`` logits; ``apply_margin`` with the same arguments skips the checks (the head has checked every rank's
labels). A label is a column index, or -1 where the sample's class is not among these columns; ``norms`` are the
embeddings' norms before normalisation (AdaFace reads them). See docs/partial_fc.md#margin-losses.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

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


# config `margin` -> the margin module, from the settings it reads (``build_margin``'s keywords).
MARGINS: dict[str, Callable[..., nn.Module]] = {
    "combined": lambda scale, gradient, margin_list, interclass_filtering_threshold, **_: CombinedMarginLoss(
        scale, *margin_list, interclass_filtering_threshold, gradient=gradient),
    "adaface": lambda scale, gradient, adaface_m, adaface_h, adaface_t_alpha, **_: AdaFace(
        scale, adaface_m, adaface_h, adaface_t_alpha, gradient=gradient),
}


def build_margin(margin: str, *, scale: float, gradient: GradientMode, margin_list: Sequence[float],
                 interclass_filtering_threshold: float, adaface_m: float, adaface_h: float,
                 adaface_t_alpha: float) -> nn.Module:
    """The margin named ``margin`` (a key of ``MARGINS``) with logit scale ``scale`` and ``gradient``: "combined"
    reads ``margin_list`` (m1, m2, m3) and ``interclass_filtering_threshold``, "adaface" the three ``adaface_``
    values (the config keys of the same names). ``ValueError`` for another name."""
    if margin not in MARGINS:
        raise ValueError(f"margin = {margin!r} is unknown; expected one of {sorted(MARGINS)}")
    return MARGINS[margin](scale=scale, gradient=gradient, margin_list=margin_list,
                           interclass_filtering_threshold=interclass_filtering_threshold, adaface_m=adaface_m,
                           adaface_h=adaface_h, adaface_t_alpha=adaface_t_alpha)
