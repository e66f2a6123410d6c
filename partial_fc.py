"""Partial FC: a margin-softmax classification head whose class centres are sharded over ranks.

An, Deng et al., "Killing Two Birds With One Stone: Efficient and Robust Training of Face Recognition
CNNs by Partial FC", CVPR 2022. Rank ``r`` owns the class centres ``class_partition(C, W, r)``; every
rank sees the whole global batch (embeddings are all-gathered), computes cosines against its (sampled)
centres only, and a distributed softmax cross-entropy combines the shards in log space. No rank ever
holds the (B_global, C) logits.

Gradient convention (see ``utils.distributed``): ``loss`` is the mean cross-entropy over the *global*
batch; after ``loss.backward()``, ``local_embeddings.grad`` is ``W × ∂loss/∂local_embeddings`` so that
DDP's averaging of the backbone gradients yields the single-process gradient, and ``weight.grad`` is
``∂loss/∂weight`` for this rank's shard (dense at ``sample_rate == 1``; a sparse COO tensor whose rows
are the sampled classes at ``sample_rate < 1``, or dense with zero rows with ``update="all"``).

Sampling (``sample_rate < 1``, the Partial FC method): a step uses every class present in the global batch
plus uniformly drawn negatives; the gathered rows get a sparse gradient, and the head's optimizers
(``optimizers.RowSparseSGD`` / ``RowSparseAdamW``, built by ``optimizers.build_optimizers``) update only
those rows and their state. ``update="all"`` reproduces arcface_torch instead: a dense gradient, so every
row and its optimizer state move every step.

Sub-centres (``sub_centers = K > 1``): each class has K centres, stored side by side in its row of
``weight`` ``(num_local, K·D)``; a class's cosine is the largest of its centres'. Rows stay one per class,
so sharding, sampling, the optimizers' row-wise state and the checkpoints' re-partitioning treat a class's
K centres as one unit.

How a trainer uses it (``train.py`` does exactly this, plus one skip-or-step decision for both optimizers)::

    head = PartialFC(ArcFace(), 512, num_classes, sample_rate=0.1, seed=cfg.seed).to(device)
    opt_backbone, opt_head = build_optimizers("sgd", backbone.parameters(), head, lr, 0.9, 5e-4)
    for step, (images, labels) in ...:
        apply_lr([opt_backbone, opt_head], lr_at(step, lr, warmup_steps, total_steps))  # utils.lr_scheduler
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = head(ddp_backbone(images), labels)
        loss.backward()
        opt_backbone.step(); opt_head.step()
        opt_backbone.zero_grad(set_to_none=True); opt_head.zero_grad(set_to_none=True)

The head is not wrapped in DDP (its parameters are different on every rank). Checkpoints save each
rank's ``weight`` and ``opt_head.state_dict()``; every state tensor has first dimension ``num_local``
so shards can be re-partitioned to another world size row by row. The margin's buffers (AdaFace's running
statistics) are the same on every rank and saved once.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from losses import Margin
from utils.distributed import (EarlyGradient, all_gather_cat, all_gather_sizes, get_rank, get_world_size,
                               sharded_cross_entropy, sharded_log_sum_exp, to_host)

__all__ = ["HEAD_UPDATES", "HeadUpdate", "PartialFC", "class_partition", "sample_size", "softmax_gradient",
           "softmax_statistics"]

_INIT_BLOCK = 1024  # classes per independently seeded block of initial weights
_NORM_EPS = 1e-12  # as F.normalize
_M30 = (1 << 30) - 1
_LIFT = 1 << 62  # added to a positive's sampling key
_M31 = (1 << 31) - 1

HeadUpdate = Literal["sampled", "all"]
HEAD_UPDATES = ("sampled", "all")


def class_partition(num_classes: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(class_start, num_local)`` of the contiguous class ids owned by ``rank``.

    The first ``num_classes % world_size`` ranks own one class more. Raises ``ValueError`` when
    ``num_classes < world_size`` (a rank would own no class) or for an out-of-range rank.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"class_partition: rank={rank} world_size={world_size}; need 0 <= rank < world_size")
    if num_classes < world_size:
        raise ValueError(f"class_partition: num_classes={num_classes} < world_size={world_size}; "
                         f"every rank must own at least one class")
    base, extra = divmod(num_classes, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def sample_size(num_local: int, sample_rate: float, positives: int) -> int:
    """Class centres a rank uses in a step: all ``num_local`` at ``sample_rate == 1``, else
    ``max(int(sample_rate · num_local), positives)`` (every class of the global batch that this rank owns,
    plus negatives up to the sample size), as in the original method."""
    if sample_rate >= 1.0:
        return num_local
    return min(num_local, max(int(sample_rate * num_local), positives))


def _init_rows(seed: int, class_start: int, num_local: int, dim: int) -> Tensor:
    """``normal(0, 0.01)`` rows for classes ``[class_start, class_start + num_local)``.

    Rows come from blocks of ``_INIT_BLOCK`` classes, each drawn from its own generator seeded by
    ``(seed, block)``, so class ``c``'s initial centre depends only on ``seed`` and ``c``: the full
    weight is the same for every world size.
    """
    out = torch.empty(num_local, dim)  # (num_local, D)
    end = class_start + num_local
    generator = torch.Generator()
    for block in range(class_start // _INIT_BLOCK, (end - 1) // _INIT_BLOCK + 1):
        generator.manual_seed((seed * 1_000_003 + block) % (2**63))
        values = torch.randn(_INIT_BLOCK, dim, generator=generator).mul_(0.01)  # (BLOCK, D)
        lo, hi = max(class_start, block * _INIT_BLOCK), min(end, (block + 1) * _INIT_BLOCK)
        out[lo - class_start: hi - class_start] = values[lo - block * _INIT_BLOCK: hi - block * _INIT_BLOCK]
    return out


def _mix31_(x: Tensor, work: Tensor) -> Tensor:
    """A 31-bit integer hash of int64 values in ``[0, 2^31)`` (xor-shift / multiply rounds), in place; ``work`` is
    a tensor of ``x``'s shape and dtype that it overwrites.

    Every product stays below 2^58, so the arithmetic is exact int64 on every device: the CPU and a GPU
    compute the same bits, and so sample the same classes.
    """
    for _ in range(2):
        x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=work)).mul_(0x45D9F3B).bitwise_and_(_M31)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=work))


def _sampling_keys(class_ids: Tensor, seed: Tensor) -> Tensor:
    """Distinct int64 keys whose order is a random permutation of ``class_ids`` for this ``seed (1,)``.

    ``key = hash(class id, seed) · 2^32 + class id``: the hash (30 bits) orders the classes, the class id
    in the low bits makes every key distinct, so ``topk`` has no ties to break and chooses the same set on
    every device. Two ``class_ids``-sized tensors: the keys and one work tensor.
    """
    keys = torch.bitwise_and(class_ids, _M31).bitwise_xor_(seed).bitwise_and_(_M31)  # (L,)
    work = torch.empty_like(keys)  # (L,)
    _mix31_(keys, work).bitwise_xor_((seed * 0x2545F49) & _M31)
    _mix31_(keys, work).bitwise_and_(_M30)
    return keys.bitwise_left_shift_(32).bitwise_or_(class_ids)


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
    ``_NormalizedLinear``). ``ctx`` carries ``compute_dtype``, ``index``, ``sparse``, ``weight_shape``, ``early``
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


class _NormalizedLinear(torch.autograd.Function):
    """Cosines between rows of ``emb (B, D)`` and the centres of rows ``index (C,)`` of ``weight (N, K·D)``:
    ``(B, C·K)`` fp32, and the embedding norms ``|emb| (B,)`` fp32 (not differentiable: margins that read
    them, AdaFace, treat them as constants). The head uses it when its margin changes more than the target
    columns (AdaFace, inter-class filtering, a plain callable) or with sub-centres; otherwise
    ``_MarginSoftmax`` does the same products with the margin and the cross-entropy fused in.

    A weight row holds its class's ``K`` centres (sub-centres) side by side, so ``weight`` is the
    ``(N·K, D)`` matrix of centres with class ``c``'s centres in rows ``c·K … c·K + K − 1``, and column
    ``j·K + k`` of the cosines is centre ``k`` of the ``j``-th selected class. ``index`` (sorted, unique)
    selects the sampled rows; ``None`` uses all ``N`` rows. With an index and ``sparse`` the weight gradient
    is a coalesced sparse ``(N, K·D)`` tensor whose values are this step's gathered copy of the rows,
    overwritten by their gradient (what ``F.embedding(sparse=True)`` gives, without its extra buffers);
    without ``sparse`` it is dense, zero on the rows that were not selected (arcface_torch's gradient).

    Forward: ``cos = (emb / |emb|) @ (weight / |weight|)ᵀ``, computed as ``(ê @ Wᵀ) · diag(1/|W|)`` so the
    normalised weight is never materialised. The products run in ``compute_dtype`` (the ambient autocast
    dtype: bf16/fp16 operands with fp32 accumulation; in fp16 the backward's are ``g`` and ``W / |W|``, which
    stay in fp16's range where ``G`` may not) and everything else in fp32.
    Backward, with ``g = ∂L/∂cos`` and ``G = g · diag(1/|W|)``:
    ``∂L/∂W = Gᵀ ê − diag(Σ_b g⊙cos / |W|²) W`` and ``∂L/∂emb = diag(1/|e|)(G W − diag(Σ_c g⊙cos) ê)``
    (the row dots ``ŵ·∂L/∂ŵ`` equal ``Σ_b g⊙cos``, so no (C, D) temporary is needed). Rows with a norm
    below 1e-12 are divided by 1e-12 instead, as ``F.normalize``. The backward overwrites the cosines with
    ``g⊙cos`` and then ``G`` (they are the head's own temporary), so it can run once.
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


class _MarginSoftmax(torch.autograd.Function):
    """The head's loss in one function when its margin changes only the target columns (ArcFace, CosFace,
    every ``CombinedMarginLoss`` without inter-class filtering) and each class has one centre.

    Inputs as ``_NormalizedLinear`` plus ``target (B,)`` (the sample's column here, -1 where another rank
    holds it), the margin, whose ``target_only_scale()`` is ``s`` and whose ``target_logits(x)`` gives the
    target logits and their slopes, and ``compiled`` (the collective-free parts through ``torch.compile``).
    Output: the mean cross-entropy over the global batch, as ``sharded_cross_entropy(margin(_NormalizedLinear(
    ...)))``.

    The logits are never stored: non-target logits are ``s·cos``, target logits come from the margin, so the
    cosines are reduced to each row's maximum and its exponentials (``softmax_statistics``;
    ``sharded_log_sum_exp`` combines the ranks' sums). The exponentials are kept for the backward, which scales
    them in place into ``g = ∂L/∂cos`` (``s·softmax`` off target, ``slope·(softmax − 1)`` on it, over the batch)
    and reduces ``g⊙cos`` (``softmax_gradient``). A step holds two ``(B, C)`` tensors, the cosines and the
    exponentials (later ``g``, then ``G``), against the unfused chain's logits, their gradient and its
    temporaries; the head's backward, the first of the step's backward, allocates none.
    """

    @staticmethod
    def forward(ctx, emb: Tensor, weight: Tensor, index: Tensor | None, target: Tensor, margin, sparse: bool,
                early: EarlyGradient | None, compiled: bool) -> Tensor:
        statistics, ctx.gradient = _local_functions(compiled)
        prod, _, ctx.compute_dtype, saved = _cosine_products(emb, weight, index)  # (B, C) not yet normalised
        s = margin.target_only_scale()
        here = (target >= 0)[:, None]  # (B, 1)
        col = target.clamp_min(0)[:, None]  # (B, 1)
        target_logit, slope = margin.target_logits(prod.gather(1, col) * saved.inv_w[col])  # (B, 1) each
        exps, local_max, local_sum = statistics(prod, saved.inv_w, s, target_logit, here, col)  # prod: now cos
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
        g, dot_w, dot_e = ctx.gradient(cos, exps, to_softmax * scale, scale, ctx.s, slope, here, col)  # g: exps'
        left, right = _product_operands(ctx.compute_dtype, g, cos, saved.rows, saved.inv_w)  # G: over the cosines
        del cos, exps, g  # only `left` of the (B, C) tensors is read from here on
        return *_cosine_products_backward(ctx, saved, left, right, dot_w, dot_e), None, None, None, None, None, None


class PartialFC(nn.Module):
    """Margin-softmax head with class centres sharded over ranks and optional class sampling.

    Args:
        margin_loss: maps ``(cosines (B, C_sampled), labels (B,) with -1 = elsewhere)`` to scaled logits,
            e.g. ``losses.ArcFace()``. When it has an ``apply_margin`` method (every margin in ``losses``:
            the ``losses.Margin`` protocol), the head calls ``apply_margin(cosines, labels, norms)`` with the
            norms ``(B,)`` of the gathered embeddings (it has checked the labels itself); a plain callable is
            called with ``(cosines, labels)``. A module margin is a submodule: its buffers (AdaFace's running
            statistics) are the head's, the same on every rank. A margin that changes only the target column
            (``target_only_scale()`` is not None: ArcFace, CosFace, ``CombinedMarginLoss`` without inter-class
            filtering) is fused with the cross-entropy when ``sub_centers == 1`` (``_MarginSoftmax``: the
            logits are never stored); the values are those of the unfused chain.
        embedding_size: D.
        num_classes: C over all ranks (>= world size).
        sample_rate: fraction of this rank's classes used per step, in (0, 1]. Below 1, every class in the
            global batch is kept and ``int(sample_rate · num_local)`` classes are used in all (more if the
            batch has more: ``sample_size``); negatives are drawn uniformly without replacement, ordered by
            a hash of (class id, per-step seed) that every device computes alike; the seed is one
            ``torch.randint`` draw from the global torch RNG per step on every rank.
        seed: initial centres are ``normal(0, 0.01)`` and depend only on ``(seed, class id)``, not on the
            world size (see ``_init_rows``).
        sub_centers: K >= 1 centres per class (sub-center ArcFace: Deng et al., "Sub-center ArcFace: Boosting
            Face Recognition by Large-scale Noisy Web Faces", ECCV 2020). A class's cosine is the largest of
            its K centres' (for the target and every other class alike), so noisy images of a class gather
            at a non-dominant centre instead of pulling the dominant one. The K centres of a class live in
            one row of ``weight`` (see ``_NormalizedLinear``): they are owned by one rank, sampled together,
            and share the row's optimizer state; 1 is the plain head.
        update: ``"sampled"`` (default, the original Partial FC method): with ``sample_rate < 1`` the weight
            gradient is sparse, so the row-sparse optimizers update only the sampled rows and their state;
            ``"all"`` (arcface_torch's): the gradient is dense, zero on unsampled rows, so momentum and weight
            decay move every row every step. Both are the same at ``sample_rate == 1``.
        compile: run the fused head's collective-free parts (``softmax_statistics``: cosines → logits → local
            maximum and sum; ``softmax_gradient``: the local part of the backward) through ``torch.compile``,
            which fuses each into loops that need no ``(B, C)`` work tensor (C++ on the CPU, Triton on CUDA).
            The same values to rounding; the first steps pay the compilation.

    Attributes: ``weight`` (num_local, K·D) fp32 Parameter, ``class_start``, ``num_local``, ``sub_centers``.
    ``forward(local_embeddings (B, D), local_labels (B,))`` returns the mean loss over the global batch;
    B may differ between ranks and steps.

    Every operation of a step is a whole-tensor torch operation: their number does not depend on the batch size
    or the class count. Host-device synchronisations per step (``utils.distributed.to_host``): one, reading the
    gathered batch sizes and label checks of every rank (``_check_inputs``); a second only when the positives
    can outnumber the sample (``_sample``). Everything else stays on the device.
    """

    def __init__(self, margin_loss: Margin | Callable[[Tensor, Tensor], Tensor], embedding_size: int,
                 num_classes: int, sample_rate: float = 1.0, *, seed: int = 0, sub_centers: int = 1,
                 update: HeadUpdate = "sampled", compile: bool = False) -> None:
        super().__init__()
        if not callable(margin_loss):
            raise ValueError(f"PartialFC: margin_loss must be callable (e.g. losses.ArcFace()), got {margin_loss!r}")
        if embedding_size < 1:
            raise ValueError(f"PartialFC: embedding_size={embedding_size} must be >= 1")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"PartialFC: sample_rate={sample_rate} must be in (0, 1]")
        if isinstance(sub_centers, bool) or not isinstance(sub_centers, int) or sub_centers < 1:
            raise ValueError(f"PartialFC: sub_centers={sub_centers!r} must be an integer >= 1")
        if update not in HEAD_UPDATES:
            raise ValueError(f"PartialFC: update={update!r} is unknown; expected one of {HEAD_UPDATES}")
        self.world_size = get_world_size()
        self.rank = get_rank()
        self.class_start, self.num_local = class_partition(num_classes, self.world_size, self.rank)
        self.margin_loss = margin_loss
        self.embedding_size = embedding_size
        self.num_classes = num_classes
        self.sample_rate = sample_rate
        self.sub_centers = sub_centers
        self.update: HeadUpdate = update
        self.compile = compile
        # Centre k of class c is centre row c·K + k of the (C·K, D) matrix: its initial value depends only on
        # (seed, c·K + k), so the full weight does not depend on the world size.
        rows = _init_rows(seed, self.class_start * sub_centers, self.num_local * sub_centers, embedding_size)
        self.weight = nn.Parameter(rows.view(self.num_local, sub_centers * embedding_size))  # (num_local, K·D)
        self._grad_rows = -1  # rows of the last step's sparse weight gradient
        self.weight.register_post_accumulate_grad_hook(self._mark_coalesced)

    def _mark_coalesced(self, weight: nn.Parameter) -> None:
        """Once a sparse weight gradient is accumulated: autograd stores it (sorted, unique rows: coalesced) as a
        new tensor without that mark, and coalescing it again would sort and copy every row and, on a GPU, read
        its size on the host. When ``weight.grad`` is exactly one step's gradient, not a sum of micro-batches
        (whose rows would number more), mark it again; the indices and values are shared, not copied."""
        grad = weight.grad
        if grad is not None and grad.is_sparse and not grad.is_coalesced() and grad._nnz() == self._grad_rows:
            weight.grad = torch.sparse_coo_tensor(grad._indices(), grad._values(), grad.shape, is_coalesced=True,
                                                  check_invariants=False)

    def extra_repr(self) -> str:
        return (f"embedding_size={self.embedding_size}, num_classes={self.num_classes}, "
                f"sample_rate={self.sample_rate}, class_start={self.class_start}, num_local={self.num_local}, "
                f"sub_centers={self.sub_centers}, update={self.update!r}, compile={self.compile}")

    def _check_inputs(self, local_embeddings: Tensor, local_labels: Tensor) -> list[int]:
        """Gather every rank's input shapes and label range; raise the same ``ValueError`` on every rank if
        one is bad. Returns the batch size of every rank. The one host-device synchronisation of a step."""
        emb_ok = local_embeddings.dim() == 2 and local_embeddings.shape[1] == self.embedding_size
        labels_ok = not (local_labels.is_floating_point() or local_labels.is_complex()
                         or local_labels.dtype == torch.bool)
        device = local_embeddings.device
        header = torch.tensor([local_embeddings.shape[0] if local_embeddings.dim() else -1, local_labels.numel(),
                               int(emb_ok), int(labels_ok)], dtype=torch.int64).to(device, non_blocking=True)
        if labels_ok and local_labels.numel():
            flat = local_labels.reshape(-1).long()  # (B,)
            bad = (flat < 0) | (flat >= self.num_classes)  # (B,)
            first = torch.argmax(bad.to(torch.uint8))  # () first bad sample, or 0
            where = torch.cat([torch.where(bad.any(), first, -1).reshape(1), flat.gather(0, first.reshape(1))])  # (2,)
        else:
            where = torch.tensor([-1, 0], dtype=torch.int64).to(device, non_blocking=True)  # (2,)
        gathered = all_gather_sizes(torch.cat([header, where]), device)  # W rows of 6 ints, on the host
        for rank, (n_emb, n_lab, e_ok, l_ok, sample, label) in enumerate(gathered):
            if not (e_ok and l_ok and n_emb == n_lab):
                raise ValueError(
                    f"PartialFC.forward on rank {rank}: expected embeddings (B, {self.embedding_size}) and B integer "
                    f"labels; got {n_emb} embedding rows (shape ok: {bool(e_ok)}) and {n_lab} labels "
                    f"(integer: {bool(l_ok)})")
            if sample >= 0:
                raise ValueError(f"PartialFC.forward: label {label} (rank {rank}, sample {sample}) is outside "
                                 f"[0, {self.num_classes})")
        batch = [row[0] for row in gathered]
        if sum(batch) == 0:
            raise ValueError("PartialFC.forward: the global batch is empty (0 samples on every rank)")
        return batch

    def _sample(self, local: Tensor, in_shard: Tensor) -> Tensor:
        """Sorted local rows used this step: every positive plus uniformly drawn negatives, ``(k,)`` with
        ``k = sample_size(num_local, sample_rate, positives)``.

        A fixed number of operations. The number of positives is read on the host (the step's second and
        last synchronisation) only when it can exceed the sample, i.e. when ``int(sample_rate · num_local)``
        is smaller than the global batch (e.g. positive-only sampling); otherwise the size is known.
        """
        device = self.weight.device
        # One draw from the global (CPU) torch RNG per step on every rank keeps the RNG streams aligned;
        # the seed travels to the device without a synchronisation.
        seed = torch.randint(0, _M31, (1,))  # (1,) on the CPU
        ids = torch.arange(self.class_start, self.class_start + self.num_local, device=device)  # (num_local,)
        keys = _sampling_keys(ids, seed.to(device, non_blocking=True))  # (num_local,) distinct, below 2^62
        # Positives go first: 2^62 lifts them above every other key.
        rows = local.clamp(0, self.num_local - 1)  # (B_global,)
        keys.scatter_reduce_(0, rows, keys.gather(0, rows) + torch.where(in_shard, _LIFT, 0), reduce="amax")
        positives = (keys >= _LIFT).sum()  # ()
        k = int(self.sample_rate * self.num_local)
        if k < min(local.shape[0], self.num_local):
            k = sample_size(self.num_local, self.sample_rate, to_host(positives))
        chosen = torch.topk(keys, k, sorted=False).indices  # (k,)
        return chosen.sort().values  # (k,)

    def gradient_rows(self) -> Tensor | None:
        """``weight``'s gradient as a dense ``(rows, D)`` tensor: itself, or the values of the sparse gradient
        (coalesced in place first, so that changing the values changes the gradient); None without one."""
        grad = self.weight.grad
        if grad is None or not grad.is_sparse:
            return grad
        if not grad.is_coalesced():  # a sum over micro-batches
            self.weight.grad = grad = grad.coalesce()
        return grad.values()

    def forward(self, local_embeddings: Tensor, local_labels: Tensor) -> Tensor:
        """Mean margin-softmax cross-entropy over the global batch (the same scalar on every rank).

        Raises ``ValueError`` on every rank when any rank passes a label outside ``[0, num_classes)`` or
        mismatched shapes.
        """
        batch_sizes = self._check_inputs(local_embeddings, local_labels)
        labels = all_gather_cat(local_labels.reshape(-1).long(), sizes=batch_sizes)  # (B_global,)
        # The head's backward starts the embeddings' reduce-scatter as soon as their gradient is known (early).
        early = EarlyGradient()
        embeddings = all_gather_cat(local_embeddings, grad_scale=float(self.world_size), sizes=batch_sizes,
                                    early=early)  # (B_global, D)

        local = labels - self.class_start  # (B_global,)
        in_shard = (local >= 0) & (local < self.num_local)  # (B_global,)
        if self.sample_rate < 1.0:
            index = self._sample(local, in_shard)  # (C_s,) sorted; sparse weight grad on these rows
            self._grad_rows = index.shape[0]
            column = torch.searchsorted(index, local.clamp(0, self.num_local - 1))  # (B_global,)
            target = torch.where(in_shard, column, -1)  # (B_global,)
        else:
            index = None
            target = torch.where(in_shard, local, -1)  # (B_global,)

        sparse = self.update == "sampled"
        if self.sub_centers == 1 and getattr(self.margin_loss, "target_only_scale", lambda: None)() is not None:
            return _MarginSoftmax.apply(embeddings, self.weight, index, target, self.margin_loss, sparse, early,
                                        self.compile)
        cos, norms = _NormalizedLinear.apply(embeddings, self.weight, index, sparse,
                                             early)  # (B_global, C_s·K) fp32, (B_global,)
        if self.sub_centers > 1:
            # A class's cosine is its closest centre's; the gradient goes to that centre (split between exact ties).
            cos = cos.view(cos.shape[0], -1, self.sub_centers).amax(dim=2)  # (B_global, C_s)
        if hasattr(self.margin_loss, "apply_margin"):
            logits = self.margin_loss.apply_margin(cos, target, norms)  # (B_global, C_s)
        else:
            logits = self.margin_loss(cos, target)  # (B_global, C_s)
        return sharded_cross_entropy(logits, target)
