"""Margin losses: they turn the cosines between embeddings and class centres into scaled logits.

``losses.margin``: ``CombinedMarginLoss`` (m1/m2/m3), ``ArcFace``, ``CosFace``. A margin is a module whose
``forward(cosines (B, C), labels (B,))`` returns ``(B, C)`` logits for a softmax cross-entropy (the
cross-entropy itself is ``partial_fc.PartialFC``'s, across ranks), and whose ``apply_margin`` does the same
without checking the labels (the head has checked them already).
"""
from losses.margin import ArcFace, CombinedMarginLoss, CosFace, GradientMode

__all__ = ["ArcFace", "CombinedMarginLoss", "CosFace", "GradientMode"]
