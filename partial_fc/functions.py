"""The head's two autograd Functions and the local parts they share.

``NormalizedLinear``: the cosines between the gathered embeddings and this rank's (sampled) class centres, for
margins that change more than the target column (AdaFace, inter-class filtering, sub-centres). ``MarginSoftmax``:
the cosines, a target-only margin (ArcFace, CosFace) and the softmax cross-entropy over every rank's shard in one
Function, whose logits are never stored. Both normalise without materialising the normalised weight and run their
products in the autocast dtype; ``softmax_statistics`` and ``softmax_gradient`` are ``MarginSoftmax``'s
collective-free parts, which ``compile_head`` runs through ``torch.compile``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from partial_fc.cross_entropy import sharded_log_sum_exp
from utils.distributed import EarlyGradient

__all__ = ["MarginSoftmax", "NormalizedLinear", "softmax_gradient", "softmax_statistics"]

_NORM_EPS = 1e-12  # as F.normalize


class _Saved(NamedTuple):
    """What the forward of both head functions keeps for the backward (fp32; C·K centres, B embeddings)."""

    e_hat: Tensor  # (B, D) unit embeddings
    rows: Tensor  # (C·K, D) the centres used: the weight itself, or this step's gathered copy of its sampled rows
    inv_e: Tensor  # (B,) 1 / |e|
    inv_w: Tensor  # (C·K,) 1 / |w|
    e_ok: Tensor  # (B,) |e| above the clamp: the normalisation is differentiable there
    w_ok: Tensor  # (C·K,) likewise for the centres


def _cosine_products(emb: Tensor, weight: Tensor, index: Tensor | None) -> tuple[Tensor, Tensor, torch.dtype, _Saved]:
    """The forward half both head functions share: ``(prod, e_norm, compute_dtype, saved)``.

    ``prod (B, C·K)`` fp32 is ``ê @ Wᵀ`` for the rows ``index`` of ``weight`` (all rows for ``None``), not yet
    divided by the centre norms (callers scale it by ``saved.inv_w`` in place, so the normalised weight is never
    materialised); ``e_norm (B,)`` fp32. The product runs in the ambient autocast dtype (bf16/fp16 operands, fp32
    accumulation), everything else in fp32.
    """
    device_type = emb.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else torch.float32
    width = emb.shape[1]
    with torch.autocast(device_type, enabled=False):
        rows = weight if index is None else weight.index_select(0, index)  # (C, K·D)
        rows = rows.view(-1, width)  # (C·K, D) one centre per row
        w_norm = torch.linalg.vector_norm(rows, dim=1)  # (C·K,)
        emb = emb.float()
        e_norm = torch.linalg.vector_norm(emb, dim=1)  # (B,)
        inv_e = 1.0 / e_norm.clamp_min(_NORM_EPS)  # (B,)
        inv_w = 1.0 / w_norm.clamp_min(_NORM_EPS)  # (C·K,)
        e_hat = emb * inv_e[:, None]  # (B, D)
        if compute_dtype == torch.float32:
            prod = torch.mm(e_hat, rows.t())  # (B, C·K)
        else:
            prod = torch.mm(e_hat.to(compute_dtype), rows.to(compute_dtype).t()).float()  # (B, C·K)
    return prod, e_norm, compute_dtype, _Saved(e_hat, rows, inv_e, inv_w, e_norm > _NORM_EPS, w_norm > _NORM_EPS)


def _product_operands(cd: torch.dtype, g: Tensor, g_memory: Tensor, rows: Tensor,
                      inv_w: Tensor) -> tuple[Tensor, Tensor]:
    """``(left (B, C·K), right (C·K, D))`` of the backward's products in the compute dtype ``cd``, from ``g =
    ∂L/∂cos``: ``G = g·diag(1/|W|)`` and the centres ``W`` (fp32 and bf16; ``G`` is written into ``g_memory``, a
    ``(B, C·K)`` fp32 tensor the caller no longer needs, or ``g`` itself), or ``g`` and the unit centres ``W/|W|``
    (fp16). Once they are formed the caller may drop ``g``: only ``left`` is read after."""
    if cd == torch.float16:
        # fp16's range ends at 65504: its operands are g (B, C·K) and the unit rows ŵ = W/|W| (C·K, D), as in a head
        # that normalises its weight first. G = g/|w| is 1/|w| larger (~4 at initialisation with D = 512) and,
        # carrying the loss scale, overflows steps that g does not. ∂W's product is scaled by 1/|W| after.
        return g.to(cd), torch.mul(rows, inv_w[:, None], out=torch.empty(rows.shape, dtype=cd, device=rows.device))
    big_g = torch.mul(g, inv_w, out=g_memory)  # (B, C·K) G
    return (big_g, rows) if cd == torch.float32 else (big_g.to(cd), rows.to(cd))  # bf16: fp32's range


def _cosine_products_backward(ctx, saved: _Saved, left: Tensor, right: Tensor, dot_w: Tensor,
                              dot_e: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The backward half both head functions share: ``(∂L/∂emb, ∂L/∂weight)`` from the products' operands
    (``_product_operands``), ``dot_w = Σ_b g⊙cos (C·K,)`` and ``dot_e = Σ_c g⊙cos (B,)`` (``g = ∂L/∂cos``, see
    ``NormalizedLinear``). ``ctx`` carries ``compute_dtype``, ``index``, ``sparse``, ``weight_shape``, ``early``
    and ``needs_input_grad`` (emb first, weight second)."""
    e_hat, rows, inv_e, inv_w, e_ok, w_ok = saved
    cd, index = ctx.compute_dtype, ctx.index
    dot_w.mul_(w_ok)  # (C·K,) ŵ·∂L/∂ŵ
    dot_e.mul_(e_ok)  # (B,) ê·∂L/∂ê
    grad_emb = grad_weight = None
    if ctx.needs_input_grad[0]:
        d_e_hat = torch.mm(left, right) if cd == torch.float32 else torch.mm(left, right).float()  # (B, D)
        grad_emb = d_e_hat.sub_(e_hat * dot_e[:, None]).mul_(inv_e[:, None])  # (B, D)
        if ctx.early is not None:
            ctx.early.start(grad_emb)  # the embeddings' reduce-scatter runs while the weight's gradient is computed
    if ctx.needs_input_grad[1]:
        coef = (dot_w * inv_w * inv_w)[:, None]  # (C·K, 1)
        if cd == torch.float32:
            # −coef·W written once, then the product accumulated onto it: one pass over (C, D) fewer than a
            # product followed by addcmul_. Gathered rows are this step's own copy: they take the gradient.
            values = rows.mul_(coef.neg_()) if index is not None else torch.mul(rows, coef.neg_())  # (C·K, D)
            values.addmm_(left.t(), e_hat)
        else:
            values = torch.mm(left.t(), e_hat.to(cd)).float()  # (C·K, D)
            if cd == torch.float16:
                values.mul_(inv_w[:, None])  # gᵀê back to Gᵀê
            values.addcmul_(rows, coef, value=-1.0)
        values = values.view(-1, ctx.weight_shape[1])  # (C, K·D) back to one row per class
        if index is None:
            grad_weight = values
        elif ctx.sparse:
            grad_weight = torch.sparse_coo_tensor(index[None], values, ctx.weight_shape,
                                                  is_coalesced=True, check_invariants=False)  # (N, K·D)
        else:
            grad_weight = values.new_zeros(ctx.weight_shape).index_copy_(0, index, values)  # (N, K·D)
    return grad_emb, grad_weight


class NormalizedLinear(torch.autograd.Function):
    """Cosines between ``emb (B, D)`` and the centres of rows ``index (C,)`` (sorted, unique; None: all N rows) of
    ``weight (N, K·D)``: ``(B, C·K)`` fp32, column ``j·K + k`` being centre k of the j-th selected class, and the
    embedding norms ``(B,)`` fp32 (not differentiable: AdaFace treats them as constants). The head uses it when its
    margin changes more than the target column, or with sub-centres; otherwise ``MarginSoftmax``.

    Forward: ``cos = (ê @ Wᵀ) · diag(1/|W|)``, so the normalised weight is never materialised; the product in the
    autocast dtype with fp32 accumulation, the rest in fp32. Norms below 1e-12 divide by 1e-12, as ``F.normalize``.
    Backward, with ``g = ∂L/∂cos`` and ``G = g · diag(1/|W|)``:
    ``∂L/∂W = Gᵀ ê − diag(Σ_b g⊙cos / |W|²) W`` and ``∂L/∂emb = diag(1/|e|)(G W − diag(Σ_c g⊙cos) ê)``
    (``ŵ·∂L/∂ŵ = Σ_b g⊙cos``: no (C, D) temporary). In fp16 the products' operands are ``g`` and ``W/|W|``, which
    stay in fp16's range where ``G`` may not. With an index and ``sparse`` the weight gradient is a coalesced sparse
    ``(N, K·D)`` tensor over this step's gathered copy of the rows; without ``sparse``, dense and zero on the rows
    not selected. No rescaling. The backward overwrites the cosines (the head's own temporary): it runs once.
    """

    @staticmethod
    def forward(ctx, emb: Tensor, weight: Tensor, index: Tensor | None, sparse: bool,
                early: EarlyGradient | None = None) -> tuple[Tensor, Tensor]:
        prod, e_norm, ctx.compute_dtype, saved = _cosine_products(emb, weight, index)
        cos = prod.mul_(saved.inv_w)  # (B, C·K)
        ctx.early, ctx.index, ctx.sparse, ctx.weight_shape = early, index, sparse, weight.shape
        ctx.save_for_backward(*saved, cos)
        ctx.mark_non_differentiable(e_norm)
        return cos, e_norm

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_norm: Tensor | None):
        *saved, cos = ctx.saved_tensors
        saved = _Saved(*saved)
        prod = cos.mul_(grad)  # (B, C·K) g⊙cos, over the cosines
        dot_w, dot_e = prod.sum(dim=0), prod.sum(dim=1)
        left, right = _product_operands(ctx.compute_dtype, grad, prod, saved.rows, saved.inv_w)
        return *_cosine_products_backward(ctx, saved, left, right, dot_w, dot_e), None, None, None


def softmax_statistics(prod: Tensor, inv_w: Tensor, s: float, target_logit: Tensor, here: Tensor,
                       col: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The fused head's collective-free forward. ``prod (B, C)`` (``ê·Wᵀ``) becomes the cosines in place
    (``· diag(1/|W|)``); the logits are ``s·cos`` with each row's target column (where ``here``) set to
    ``target_logit (B, 1)``. Returns ``(exps (B, C), local_max (B,), local_sum (B,))``: each row's largest logit,
    ``exp(logit − largest)`` and its sum over this rank's columns. ``exps`` is the one ``(B, C)`` tensor besides
    the cosines; the backward turns it into the gradient."""
    cos = prod.mul_(inv_w)  # (B, C)
    logits = _logits(cos, s, target_logit, here, col)  # (B, C)
    local_max = logits.amax(dim=1)  # (B,)
    exps = logits.sub_(local_max[:, None]).exp_()  # (B, C)
    return exps, local_max, exps.sum(dim=1)


def softmax_gradient(cos: Tensor, exps: Tensor, row_coef: Tensor, scale: Tensor, s: float, slope: Tensor,
                     here: Tensor, col: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The fused head's collective-free backward: ``(g, Σ_b g⊙cos (C,), Σ_c g⊙cos (B,))`` with ``g = ∂L/∂cos
    (B, C)``, written over ``exps``: ``s·softmax·scale`` off target and ``slope·(softmax − 1)·scale`` on it, where
    ``softmax = exps · row_coef / scale`` (``row_coef (B,)`` folds the global maximum, the global sum of
    exponentials and ``scale = ∂L/∂loss / B``). ``cos`` is overwritten by ``g⊙cos``: no ``(B, C)`` tensor is
    allocated."""
    p_t = exps.gather(1, col) * row_coef[:, None]  # (B, 1) softmax·scale at the target column
    g = exps.mul_((row_coef * s)[:, None]).scatter_(1, col, torch.where(here, (p_t - scale) * slope, p_t * s))
    prod = cos.mul_(g)  # (B, C) g⊙cos, over the cosines, which are no longer needed
    return g, prod.sum(dim=0), prod.sum(dim=1)


def _logits(cos: Tensor, s: float, target_logit: Tensor, here: Tensor, col: Tensor) -> Tensor:
    """``(B, C)`` logits: ``s·cos``, and on each row's target column (where ``here``) the margin's
    ``target_logit``. Rows whose class another rank holds read and write back column 0, so no operation depends
    on the labels."""
    logits = cos * s  # (B, C)
    return logits.scatter_(1, col, torch.where(here, target_logit, logits.gather(1, col)))


_COMPILED: dict[str, Callable] = {}


def _local_functions(compiled: bool) -> tuple[Callable, Callable]:
    """``(softmax_statistics, softmax_gradient)``, eager or through ``torch.compile`` (compiled once per process)."""
    if not compiled:
        return softmax_statistics, softmax_gradient
    if not _COMPILED:
        _COMPILED.update(statistics=torch.compile(softmax_statistics), gradient=torch.compile(softmax_gradient))
    return _COMPILED["statistics"], _COMPILED["gradient"]


class MarginSoftmax(torch.autograd.Function):
    """The head's loss in one Function when its margin changes only the target column (ArcFace, CosFace,
    ``CombinedMarginLoss`` without inter-class filtering) and each class has one centre.

    Inputs as ``NormalizedLinear`` plus ``target (B,)`` (the sample's column here, -1 where another rank holds it),
    the margin (``target_only_scale()`` is ``s``; ``target_logits(x)`` gives the target logits and their slopes) and
    ``compiled``. Output: the mean cross-entropy over the global batch, the same scalar on every rank, equal to
    ``sharded_cross_entropy(margin(NormalizedLinear(...)))``.
    Forward: logits ``s·cos`` off target and the margin's on it, reduced to each row's maximum and exponentials
    (``softmax_statistics``) and combined over the ranks (``sharded_log_sum_exp``); the logits are never stored.
    Backward: ``g = ∂L/∂cos`` is ``s·softmax/B`` off target and ``slope·(softmax − 1)/B`` on it, written over the
    exponentials (``softmax_gradient``), then ``NormalizedLinear``'s identities. No rescaling. A step holds two
    ``(B, C)`` fp32 tensors, the cosines and the exponentials (docs/partial_fc.md#memory has every phase).
    """

    @staticmethod
    def forward(ctx, emb: Tensor, weight: Tensor, index: Tensor | None, target: Tensor, margin, sparse: bool,
                early: EarlyGradient | None, compiled: bool) -> Tensor:
        statistics, ctx.gradient = _local_functions(compiled)
        prod, _, ctx.compute_dtype, saved = _cosine_products(emb, weight, index)  # (B, C) not yet normalised
        s = margin.target_only_scale()
        here = (target >= 0)[:, None]  # (B, 1)
        col = target.clamp_min(0)[:, None]  # (B, 1)
        if prod.shape[1] > 0:
            target_logit, slope = margin.target_logits(prod.gather(1, col) * saved.inv_w[col])  # (B, 1) each
            exps, local_max, local_sum = statistics(prod, saved.inv_w, s, target_logit, here, col)  # prod: now cos
        else:  # a rank none of whose classes the step samples: no column, no target; the collectives still run
            target_logit = slope = prod.new_zeros((prod.shape[0], 1))  # (B, 1)
            exps, local_max, local_sum = prod, prod.new_full((prod.shape[0],), float("-inf")), prod.new_zeros(
                prod.shape[0])
        row_max, sum_exp, total_target = sharded_log_sum_exp(
            local_max, local_sum, torch.where(here, target_logit, 0.0)[:, 0])
        loss = (torch.log(sum_exp) + row_max - total_target).mean()
        to_softmax = torch.exp(local_max - row_max) / sum_exp  # (B,) exps · to_softmax is the softmax
        ctx.s, ctx.early, ctx.index, ctx.sparse, ctx.weight_shape = s, early, index, sparse, weight.shape
        ctx.save_for_backward(*saved, to_softmax, slope, here, col)
        # The two (B, C) intermediates are the function's own, not inputs or outputs: kept on ctx, so that the
        # backward can release them before it allocates the weight's gradient (a whole shard at sample rate 1).
        ctx.cos, ctx.exps = prod, exps
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        *saved, to_softmax, slope, here, col = ctx.saved_tensors
        saved = _Saved(*saved)
        cos, exps, ctx.cos, ctx.exps = ctx.cos, ctx.exps, None, None
        scale = grad_loss / cos.shape[0]  # ()
        if cos.shape[1] > 0:
            g, dot_w, dot_e = ctx.gradient(cos, exps, to_softmax * scale, scale, ctx.s, slope, here, col)  # g: exps'
        else:  # no column on this rank (see forward)
            g, dot_w, dot_e = exps, cos.new_zeros(0), cos.new_zeros(cos.shape[0])
        left, right = _product_operands(ctx.compute_dtype, g, cos, saved.rows, saved.inv_w)  # G: over the cosines
        del cos, exps, g  # only `left` of the (B, C) tensors is read from here on
        return *_cosine_products_backward(ctx, saved, left, right, dot_w, dot_e), None, None, None, None, None, None
