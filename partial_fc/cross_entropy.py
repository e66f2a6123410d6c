"""The softmax cross-entropy over class centres sharded across ranks, combined in log space.

Each rank holds the logits of its own classes for the whole global batch; ``sharded_log_sum_exp`` combines every
rank's row maxima and sums of exponentials with two all-reduces, so that no rank ever holds the global logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from utils.distributed import all_reduce

__all__ = ["sharded_cross_entropy", "sharded_log_sum_exp"]


def sharded_log_sum_exp(local_max: Tensor, local_sum: Tensor, target_logit: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's share of a softmax over columns sharded across ranks, combined: ``(row_max, sum_exp,
    target_logit)``, each ``(B,)`` and the same on every rank.

    Each rank passes, per row, the largest of its logits ``local_max`` (-inf without columns), ``local_sum =
    Σ_j exp(z_j − local_max)`` over its columns and ``target_logit`` (0 where another rank holds the class).
    ``row_max`` is the global maximum (one all-reduce MAX); ``sum_exp = Σ_r local_sum_r · exp(local_max_r −
    row_max)`` and the target logits are summed in one all-reduce SUM. Each rank thus reads its logits once:
    the shift needs no global maximum before the exponentials. With one rank the rescale is by exp(0) = 1.
    """
    row_max = all_reduce(local_max.clone(), dist.ReduceOp.MAX)  # (B,)
    stats = torch.stack([local_sum * torch.exp(local_max - row_max), target_logit])  # (2, B)
    all_reduce(stats)
    return row_max, stats[0], stats[1]


class _ShardedCrossEntropy(torch.autograd.Function):
    """Mean softmax cross-entropy over classes sharded across ranks, in log space.

    Per rank: ``logits (B, C_r)`` fp32 (the same B rows on every rank, rank r holding its C_r columns), ``target
    (B,)`` int64: the sample's column on this rank, or -1 where another rank holds it. Output: the same scalar on
    every rank.
    Forward: ``m_i = max_r max_j z_ij``, ``S_i = Σ_r Σ_j exp(z_ij − m_i)``, ``t_i = z_{i,y_i}``
    (``sharded_log_sum_exp``), ``loss = mean_i(log S_i + m_i − t_i)``. No probability is clamped (insightface's
    1e-30 caps a sample's loss at 69.08 and zeroes its gradient).
    Backward: ``∂loss/∂z_ij = (exp(z_ij − m_i)/S_i − [j = y_i]) / B``, written over ``logits`` (pass a temporary;
    it runs once). No rescaling: each rank's gradient is the exact partial derivative for its own columns. The
    target column is read and written by gather/scatter over every row, so no operation depends on the labels.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor) -> Tensor:
        batch, classes = logits.shape
        here = target >= 0  # (B,) the class is one of this rank's columns
        col = target.clamp(0, max(classes - 1, 0))[:, None]  # (B, 1)
        if classes > 0:
            local_max = torch.amax(logits, dim=1)  # (B,) amax: max(dim) also computes the arg max
            local_sum = (logits - local_max[:, None]).exp_().sum(dim=1)  # (B,)
            target_logit = torch.where(here, logits.gather(1, col)[:, 0], 0.0)  # (B,)
        else:
            local_max = logits.new_full((batch,), float("-inf"))  # (B,)
            local_sum, target_logit = logits.new_zeros((batch,)), logits.new_zeros((batch,))  # (B,) each
        row_max, sum_exp, target_logit = sharded_log_sum_exp(local_max, local_sum, target_logit)
        loss = (torch.log(sum_exp) + row_max - target_logit).mean()
        ctx.save_for_backward(logits, row_max, sum_exp, here, col)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        logits, row_max, sum_exp, here, col = ctx.saved_tensors
        # The logits are a temporary of the head (the margin's output): overwrite them with the gradient.
        # A second backward through this graph fails autograd's version check instead of reading garbage.
        scale = grad_loss / logits.shape[0]
        grad = logits.sub_(row_max[:, None]).exp_().mul_((scale / sum_exp)[:, None])  # (B, C_r) softmax / B
        if grad.shape[1] > 0:
            grad.scatter_add_(1, col, torch.where(here, -scale, 0.0)[:, None].to(grad.dtype))
        return grad, None


def sharded_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits (B, C_local)`` whose classes are sharded over ranks.

    ``target (B,)`` holds each row's local column or -1 where another rank owns the class; every rank
    must pass the same B rows. Returns the same fp32 scalar on every rank (see ``_ShardedCrossEntropy``).
    ``logits`` is overwritten by its gradient during backward: pass a temporary.
    """
    if logits.shape[0] == 0:
        raise ValueError("sharded_cross_entropy: the batch is empty (0 rows); the mean loss is undefined")
    return _ShardedCrossEntropy.apply(logits.float(), target)
