"""Single-process references of the head's margins and sub-centres, written from the papers' equations with
plain torch operations and autograd (no code of the project's head or margins)."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def adaface_reference(cos: torch.Tensor, labels: torch.Tensor, norms: torch.Tensor, mean: float, std: float,
                      s: float, m: float, h: float, t_alpha: float,
                      update: bool = True) -> tuple[torch.Tensor, float, float]:
    """AdaFace (Kim et al., CVPR 2022) logits in float64 and the statistics after this batch.

    The EMA of the clipped norms' mean and unbiased std is taken first, then the per-sample angular and
    additive margins; norms carry no gradient; cosines are clamped to [-1 + 1e-3, 1 - 1e-3] and the target
    angle clipped to [1e-3, pi - 1e-3], differentiated by autograd. Labels of -1 get no margin.
    """
    eps = 1e-3
    safe = norms.detach().double().clamp(0.001, 100)
    if update:
        mean = t_alpha * safe.mean() + (1 - t_alpha) * mean
        std = t_alpha * safe.std() + (1 - t_alpha) * std
    q = ((safe - mean) / (std + eps) * h).clamp(-1, 1)
    onehot = torch.zeros(cos.shape, dtype=torch.float64)
    rows = labels != -1
    onehot[rows, labels[rows]] = 1.0
    theta = cos.double().clamp(-1 + eps, 1 - eps).acos()
    theta_m = (theta + onehot * (-m * q)[:, None]).clamp(eps, math.pi - eps)
    return (theta_m.cos() - onehot * (m + m * q)[:, None]) * s, float(mean), float(std)


def class_cosines(emb: torch.Tensor, weight: torch.Tensor, sub_centers: int) -> torch.Tensor:
    """``(B, C)`` cosines of ``emb (B, D)`` to classes whose K centres are the rows ``c·K … c·K + K − 1`` of
    ``weight (C·K, D)`` (or, the same memory, ``(C, K·D)``): a class's cosine is its closest centre's
    (sub-center ArcFace, Deng et al., ECCV 2020)."""
    centres = weight.reshape(-1, emb.shape[1])  # (C·K, D)
    cos = F.normalize(emb) @ F.normalize(centres).t()  # (B, C·K)
    return cos.view(emb.shape[0], -1, sub_centers).amax(dim=2)  # (B, C)


def head_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, sub_centers: int,
              margin: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Full-softmax loss of one process: the margin's logits of ``class_cosines``, then ``F.cross_entropy``.
    ``margin(cosines, labels, norms)`` receives the embeddings' norms."""
    logits = margin(class_cosines(emb, weight, sub_centers), labels, emb.norm(dim=1))
    return F.cross_entropy(logits, labels)
