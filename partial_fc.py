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

import logging
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from losses import Margin
# The head's optimizers live in optimizers.py; their names stay importable from here, as README showed them.
from optimizers import RowSparseAdamW, RowSparseSGD, build_head_optimizer
from utils import cpu_kernels
from utils.distributed import (EarlyGradient, Tactic, all_gather_cat, all_gather_sizes, get_rank, get_world_size,
                               resolve_tactic, rows_per_block, sharded_cross_entropy, sharded_log_sum_exp, to_host)

__all__ = ["HEAD_UPDATES", "HeadUpdate", "PartialFC", "PartialFC_V2", "RowSparseAdamW", "RowSparseSGD",
           "build_head_optimizer", "class_partition", "sample_size"]

logger = logging.getLogger(__name__)

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


def _mix31(x: Tensor) -> Tensor:
    """A 31-bit integer hash of int64 values in ``[0, 2^31)`` (xor-shift / multiply rounds).

    Every product stays below 2^58, so the arithmetic is exact int64 on every device: the CPU and a GPU
    compute the same bits, and so sample the same classes.
    """
    for _ in range(2):
        x = torch.bitwise_xor(x, x >> 16)
        x = (x * 0x45D9F3B) & _M31
    return torch.bitwise_xor(x, x >> 16)


def _sampling_keys(class_ids: Tensor, seed: Tensor) -> Tensor:
    """Distinct int64 keys whose order is a random permutation of ``class_ids`` for this ``seed (1,)``.

    ``key = hash(class id, seed) · 2^32 + class id``: the hash (30 bits) orders the classes, the class id
    in the low bits makes every key distinct, so ``topk`` has no ties to break and chooses the same set on
    every device.
    """
    hashed = _mix31(torch.bitwise_xor(class_ids & _M31, seed) & _M31)
    hashed = _mix31(torch.bitwise_xor(hashed, (seed * 0x2545F49) & _M31)) & _M30
    return (hashed << 32) | class_ids


def _cosine_products(emb: Tensor, weight: Tensor, index: Tensor | None, out: Tensor | None = None,
                     rows_out: Tensor | None = None,
                     tactic: str = "fixed_ops") -> tuple[Tensor, Tensor, torch.dtype, tuple]:
    """The forward half both head functions share: ``(prod, e_norm, compute_dtype, saved)``.

    ``prod (B, C·K)`` fp32 is ``ê @ Wᵀ`` for the rows ``index`` of ``weight`` (all rows for ``None``), not yet
    divided by the centre norms (the caller scales it by ``saved``'s ``inv_w`` in place, so the normalised
    weight is never materialised); ``e_norm (B,)`` fp32. The product runs in the ambient autocast dtype
    (bf16/fp16 operands, fp32 accumulation), everything else in fp32; into ``out`` (fp32, the product's
    shape) when given. The rows ``index`` are gathered into ``rows_out`` (fp32 ``(len(index), K·D)``) when
    given; with the CPU tactic (``row_blocks``) on fp32 CPU tensors a compiled loop gathers them
    (``utils.cpu_kernels.gather_rows``), and where its norms are torch's bits (``norms_like_torch``) it computes the
    centres' norms too, during the gather or in one prefetching pass over a whole shard. ``saved`` is what
    ``_cosine_products_backward`` needs: ``(e_hat, rows, index, inv_e, inv_w, e_ok, w_ok)``.
    """
    device_type = emb.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else torch.float32
    width = emb.shape[1]
    with torch.autocast(device_type, enabled=False):
        loops = tactic == "row_blocks" and cpu_kernels.usable(weight)
        # The compiled loops' norms are torch's bits (checked once per width): the same values, one pass fewer.
        own_norms = loops and cpu_kernels.norms_like_torch(width)
        classes = weight.shape[0] if index is None else index.shape[0]
        w_norm = torch.empty(classes, weight.shape[1] // width) if own_norms else None  # (C, K)
        if index is not None and loops:
            rows = torch.empty(index.shape[0], weight.shape[1]) if rows_out is None else rows_out  # (C, K·D)
            # index_select's values in half its time, and the norms of each row while it is in cache
            cpu_kernels.gather_rows(weight, index, rows, w_norm)
        else:
            rows = weight if index is None else torch.index_select(weight, 0, index, out=rows_out)  # (C, K·D)
        rows = rows.view(-1, width)  # (C·K, D) one centre per row
        if w_norm is None:
            w_norm = torch.linalg.vector_norm(rows, dim=1)  # (C·K,)
        else:
            w_norm = w_norm.view(-1)  # (C·K,)
            if index is None:
                cpu_kernels.row_norms(rows, w_norm)  # a whole shard's centres, prefetched ahead
        emb = emb.float()
        e_norm = torch.linalg.vector_norm(emb, dim=1)  # (B,)
        inv_e = 1.0 / e_norm.clamp_min(_NORM_EPS)  # (B,)
        inv_w = 1.0 / w_norm.clamp_min(_NORM_EPS)  # (C,)
        e_hat = emb * inv_e[:, None]  # (B, D)
        if compute_dtype == torch.float32:
            prod = torch.mm(e_hat, rows.t(), out=out)  # (B, C)
        elif out is None:
            prod = torch.mm(e_hat.to(compute_dtype), rows.to(compute_dtype).t()).float()  # (B, C)
        else:
            prod = out.copy_(torch.mm(e_hat.to(compute_dtype), rows.to(compute_dtype).t()))  # (B, C)
    return prod, e_norm, compute_dtype, (e_hat, rows, index, inv_e, inv_w, e_norm > _NORM_EPS, w_norm > _NORM_EPS)


def _cosine_products_backward(ctx, saved: tuple, scaled: Tensor, dot_w: Tensor,
                              dot_e: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The backward half both head functions share: ``(∂L/∂emb, ∂L/∂weight)`` from ``scaled = G = g·diag(1/|W|)``
    ``(B, C·K)``, ``dot_w = Σ_b g⊙cos (C·K,)`` and ``dot_e = Σ_c g⊙cos (B,)`` (``g = ∂L/∂cos``), see
    ``_NormalizedLinear``. ``ctx`` carries ``compute_dtype``, ``sparse``, ``weight_shape`` and
    ``needs_input_grad`` (emb first, weight second)."""
    e_hat, rows, index, inv_e, inv_w, e_ok, w_ok = saved
    cd = ctx.compute_dtype
    dot_w.mul_(w_ok)  # (C,) ŵ·∂L/∂ŵ
    dot_e.mul_(e_ok)  # (B,) ê·∂L/∂ê
    grad_emb = grad_weight = None
    fp32 = cd == torch.float32
    if fp32:
        left, right = scaled, rows
    elif cd == torch.float16:
        # fp16's range ends at 65504: its operands are g = G·|W| (B, C) and the unit rows ŵ = W/|W| (C, D), as in
        # a head that normalises its weight first. G itself is 1/|w| larger (~4 at initialisation with D = 512)
        # and, carrying the loss scale, overflows steps that g does not. ∂W's product is scaled by 1/|W| after.
        left, right = torch.div(scaled, inv_w[None, :]).to(cd), torch.mul(rows, inv_w[:, None]).to(cd)
    else:  # bf16 has fp32's range
        left, right = scaled.to(cd), rows.to(cd)
    if ctx.needs_input_grad[0]:
        d_e_hat = torch.mm(left, right) if fp32 else torch.mm(left, right).float()  # (B, D)
        grad_emb = d_e_hat.sub_(e_hat * dot_e[:, None]).mul_(inv_e[:, None])
        if ctx.early is not None:
            ctx.early.start(grad_emb)  # the embeddings' reduce-scatter runs while the weight's gradient is computed
    if ctx.needs_input_grad[1]:
        coef = (dot_w * inv_w * inv_w)[:, None]  # (C, 1)
        if fp32:
            # −coef·W written once, then the product accumulated onto it: one pass over (C, D) fewer
            # than a product followed by addcmul_. The gathered rows are this step's own copy: reuse it.
            values = (rows.mul_(coef.neg_()) if index is not None
                      else _scaled_rows(rows, coef.neg_(), _dense_gradient_memory(ctx, rows.shape), ctx.tactic))
            values.addmm_(scaled.t(), e_hat)  # (C, D)
        else:
            values = torch.mm(left.t(), e_hat.to(cd)).float()  # (C, D)
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
            memory = _dense_gradient_memory(ctx, ctx.weight_shape)
            zeros = values.new_zeros(ctx.weight_shape) if memory is None else memory.zero_()
            grad_weight = zeros.index_copy_(0, index, values)  # (N, K·D)
            if getattr(ctx, "rows_buffer", None) is not None:
                ctx.rows_buffer.give(values)  # copied into the dense gradient: the next step may gather there
    return grad_emb, grad_weight


def _scaled_rows(rows: Tensor, coef: Tensor, out: Tensor | None, tactic: str) -> Tensor:
    """``rows (C, D) · coef (C, 1)`` into ``out`` (a new tensor for None): ``torch.mul``, or with the CPU tactic
    (``row_blocks``) on fp32 CPU tensors the compiled loop (``utils.cpu_kernels.scale_rows``: the same values, with
    a third less memory traffic: at R = 1 these are the whole shard's rows, ~1 GB a step at 500k × 512)."""
    if tactic == "row_blocks" and cpu_kernels.usable(rows, coef):
        out = torch.empty_like(rows) if out is None else out
        cpu_kernels.scale_rows(rows, coef.view(-1), out)
        return out
    return torch.mul(rows, coef, out=out)


def _keep_gradient_memory(ctx, weight: Tensor, gradient_buffer: "_Buffer | None", rows_buffer: "_Buffer | None",
                          index: Tensor | None) -> Tensor | None:
    """On a CPU, let this step's backward write a dense weight gradient into ``gradient_buffer``'s memory, and
    return the memory this step's sampled rows ``index`` are gathered into: ``rows_buffer``'s spare (the last
    step's sparse gradient values, or its gathered rows) unless it is still in use as the weight's ``.grad``.
    None (allocate) elsewhere, without an index or without the buffers. A fresh tensor of the sampled rows costs
    its page faults every step on a CPU (~50–120 ms a step at 50k rows × 512 with two ranks here, against ~20 ms
    for the gather itself)."""
    if weight.device.type != "cpu":
        return None
    if gradient_buffer is not None:
        ctx.gradient_buffer, ctx.weight_param = gradient_buffer, weight
    if rows_buffer is None or index is None:
        return None
    ctx.rows_buffer = rows_buffer
    grad = weight.grad
    busy = grad._values() if grad is not None and grad.is_sparse else grad
    return rows_buffer.take((index.shape[0], weight.shape[1]), weight.device, busy=busy)


def _dense_gradient_memory(ctx, shape: torch.Size | tuple[int, ...]) -> Tensor | None:
    """Memory for a dense ``(rows, D)`` weight gradient of ``shape``: last step's gradient, when the head keeps
    it (a ``_Buffer`` in ``ctx.gradient_buffer``, on a CPU) and it is no longer the weight's ``.grad``; else None
    (allocate). A fresh gradient of a whole shard costs its page faults again every step on a CPU (~1 s per GiB
    here); the head gives each step's gradient to the buffer once it is accumulated (``PartialFC``)."""
    buffer = getattr(ctx, "gradient_buffer", None)
    if buffer is None:
        return None
    return buffer.take(tuple(shape), ctx.weight_param.device, busy=ctx.weight_param.grad)


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
    dtype: bf16/fp16 operands with fp32 accumulation; in fp16 the backward's are ``g`` and ``W / |W|``, which stay in
    fp16's range where ``G`` may not) and everything else in fp32.
    Backward, with ``g = ∂L/∂cos`` and ``G = g · diag(1/|W|)``:
    ``∂L/∂W = Gᵀ ê − diag(Σ_b g⊙cos / |W|²) W`` and ``∂L/∂emb = diag(1/|e|)(G W − diag(Σ_c g⊙cos) ê)``
    (the row dots ``ŵ·∂L/∂ŵ`` equal ``Σ_b g⊙cos``, so no (C, D) temporary is needed). Rows with a norm
    below 1e-12 are divided by 1e-12 instead, as ``F.normalize``. The backward overwrites the cosines with
    ``G`` (they are the head's own temporary), so it can run once; its four passes over ``(B, C)`` run in
    cache-sized row blocks (``row_blocks``) or as whole-tensor operations (``fixed_ops``).
    """

    @staticmethod
    def forward(ctx, emb: Tensor, weight: Tensor, index: Tensor | None, tactic: str, sparse: bool,
                gradient_buffer: "_Buffer | None" = None, rows_buffer: "_Buffer | None" = None,
                early: EarlyGradient | None = None) -> tuple[Tensor, Tensor]:
        ctx.early = early
        rows_out = _keep_gradient_memory(ctx, weight, gradient_buffer, rows_buffer, index)
        cos, e_norm, ctx.compute_dtype, saved = _cosine_products(emb, weight, index, rows_out=rows_out,
                                                                 tactic=tactic)
        cos.mul_(saved[4][None, :])  # (B, C) times 1/|W| per column
        ctx.tactic = tactic
        ctx.sparse = sparse
        ctx.weight_shape = weight.shape
        ctx.save_for_backward(*saved, cos)
        ctx.mark_non_differentiable(e_norm)
        return cos, e_norm

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_norm: Tensor | None):
        *saved, cos = ctx.saved_tensors
        inv_w = saved[4]
        dot_w = torch.zeros_like(inv_w)  # (C,)
        dot_e = torch.empty_like(saved[3])  # (B,)
        step = rows_per_block(cos.shape[1], cos.shape[0], ctx.tactic)
        ones = cos.new_ones(min(step, cos.shape[0]))  # (step,)
        for start in range(0, cos.shape[0], step):
            block = cos[start: start + step].mul_(grad[start: start + step])  # (step, C) g⊙cos, in place
            dot_w.addmv_(block.t(), ones[:block.shape[0]])  # column sums as a matrix-vector product: ~5x sum(dim=0)
            torch.sum(block, dim=1, out=dot_e[start: start + step])
            torch.mul(grad[start: start + step], inv_w[None, :], out=block)  # (step, C) G
        grad_emb, grad_weight = _cosine_products_backward(ctx, tuple(saved), cos, dot_w, dot_e)
        return grad_emb, grad_weight, None, None, None, None, None, None


class _MarginSoftmax(torch.autograd.Function):
    """The head's loss in one function when its margin changes only the target columns (ArcFace, CosFace,
    every ``CombinedMarginLoss`` without inter-class filtering) and each class has one centre.

    Inputs as ``_NormalizedLinear`` plus ``target (B,)`` (the sample's column here, -1 where another rank
    holds it) and the margin, whose ``target_only_scale()`` is ``s`` and whose ``target_logits(x)`` gives the
    target logits and their slopes. Output: the mean cross-entropy over the global batch, as
    ``sharded_cross_entropy(margin(_NormalizedLinear(...)))``.

    The logits are never stored: non-target logits are ``s·cos``, target logits come from the margin, so each
    row block of cosines is scaled, given its targets, and reduced to its maximum and its sum of exponentials
    while it is in cache (``sharded_log_sum_exp`` combines the ranks). The backward recomputes the block's
    logits the same way, forms ``g = ∂L/∂cos`` (``s·softmax`` off target, ``slope·(softmax − 1)`` on it, over
    the batch), reduces ``g⊙cos`` and writes ``G = g·diag(1/|W|)`` over the cosines. One ``(B, C)`` buffer and
    one read and write of it each way, against the unfused chain's three buffers and about a dozen passes. With
    ``row_blocks`` on fp32 CPU tensors the row passes are compiled loops (``utils.cpu_kernels.softmax_forward`` /
    ``softmax_backward``: two passes per row forward, one backward), which agree with the torch operations to
    rounding.
    """

    @staticmethod
    def forward(ctx, emb: Tensor, weight: Tensor, index: Tensor | None, target: Tensor, margin,
                tactic: str, sparse: bool, buffers: "_Buffer", gradient_buffer: "_Buffer | None" = None,
                rows_buffer: "_Buffer | None" = None, early: EarlyGradient | None = None) -> Tensor:
        ctx.early = early
        classes = weight.shape[0] if index is None else index.shape[0]
        rows_out = _keep_gradient_memory(ctx, weight, gradient_buffer, rows_buffer, index)
        out = buffers.take((emb.shape[0], classes), emb.device)
        cos, _, ctx.compute_dtype, saved = _cosine_products(emb, weight, index, out, rows_out, tactic)  # unscaled
        inv_w = saved[4]
        batch, classes = cos.shape
        s = margin.target_only_scale()
        here = (target >= 0)[:, None]  # (B, 1)
        col = target.clamp_min(0)[:, None]  # (B, 1)
        target_logit, slope = margin.target_logits(cos.gather(1, col) * inv_w[col])  # (B, 1) each
        local_max, local_sum = cos.new_empty(batch), cos.new_empty(batch)  # (B,)
        if tactic == "row_blocks" and cpu_kernels.usable(cos, inv_w, target_logit):
            # The same passes compiled, two per row (utils.cpu_kernels): cosines kept in cos for the backward.
            cpu_kernels.softmax_forward(cos, inv_w, s, target_logit.view(-1), target, local_max, local_sum)
        else:
            step = rows_per_block(classes, batch, tactic)
            work = cos.new_empty((min(step, batch), classes))  # (step, C) the block's logits
            for start in range(0, batch, step):
                block = cos[start: start + step].mul_(inv_w)  # (step, C) cosines, kept for the backward
                logits = _block_logits(block, s, target_logit, here, col, start, work)
                torch.amax(logits, dim=1, out=local_max[start: start + step])
                torch.sum(logits.sub_(local_max[start: start + step, None]).exp_(), dim=1,
                          out=local_sum[start: start + step])
        row_max, sum_exp, total_target = sharded_log_sum_exp(
            local_max, local_sum, torch.where(here, target_logit, 0.0)[:, 0])
        loss = (torch.log(sum_exp) + row_max - total_target).mean()
        ctx.s, ctx.tactic, ctx.sparse, ctx.weight_shape, ctx.buffers = s, tactic, sparse, weight.shape, buffers
        ctx.save_for_backward(*saved, cos, row_max, sum_exp, target_logit, slope, here, col, target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        *saved, cos, row_max, sum_exp, target_logit, slope, here, col, target = ctx.saved_tensors
        inv_w, s = saved[4], ctx.s
        batch, classes = cos.shape
        scale = grad_loss / batch  # ()
        coef = scale / sum_exp  # (B,)
        dot_w = torch.zeros_like(inv_w)  # (C,)
        dot_e = torch.empty_like(saved[3])  # (B,)
        if ctx.tactic == "row_blocks" and cpu_kernels.usable(cos, inv_w, target_logit, slope, coef):
            cpu_kernels.softmax_backward(cos, inv_w, s, float(scale), target_logit.view(-1), slope.view(-1), target,
                                         row_max, coef, dot_w, dot_e)  # one pass per row, compiled
        else:
            step = rows_per_block(classes, batch, ctx.tactic)
            work = cos.new_empty((min(step, batch), classes))  # (step, C)
            ones = cos.new_ones(min(step, batch))  # (step,)
            for start in range(0, batch, step):
                end = min(start + step, batch)
                block = cos[start:end]  # (step, C) cosines
                p = _block_logits(block, s, target_logit, here, col, start, work)
                p.sub_(row_max[start:end, None]).exp_().mul_(coef[start:end, None])  # softmax / B
                c = col[start:end]
                p_t = p.gather(1, c)  # (step, 1)
                g_t = torch.where(here[start:end], (p_t - scale) * slope[start:end], p_t * s)  # (step, 1)
                g = p.mul_(s).scatter_(1, c, g_t)  # (step, C) ∂L/∂cos
                prod = block.mul_(g)  # (step, C) g⊙cos over the cosines, which are no longer needed
                dot_w.addmv_(prod.t(), ones[:end - start])  # column sums (see _NormalizedLinear)
                torch.sum(prod, dim=1, out=dot_e[start:end])
                torch.mul(g, inv_w, out=block)  # (step, C) G
        grad_emb, grad_weight = _cosine_products_backward(ctx, tuple(saved), cos, dot_w, dot_e)
        ctx.buffers.give(cos)  # no gradient refers to it: the next step may write its cosines there
        return grad_emb, grad_weight, None, None, None, None, None, None, None, None, None


class _Buffer:
    """One spare fp32 tensor on a CPU, reused from step to step: for the head's ``(B, C)`` cosines, for a
    dense ``(rows, D)`` weight gradient (sample rate 1, or ``update = "all"``), and for the sampled rows
    (gathered in the forward; with ``update = "sampled"`` the backward turns them into the sparse gradient's
    values).

    A fresh tensor of tens or hundreds of megabytes costs its page faults again every step on a CPU (glibc maps
    every allocation over 32 MiB anew). On an accelerator the caching allocator already reuses memory, and a
    tensor kept between steps would only stay out of the backbone's reach, so nothing is kept there. ``take``
    hands out the spare (viewed to the shape) when it is large enough and on the device, else a fresh tensor,
    and keeps nothing; ``give`` makes a tensor the spare: the cosines at the end of the backward that used them
    (no gradient refers to them), the weight gradient once accumulated (``take`` refuses it while it is still
    the weight's ``.grad``), the sparse gradient's values likewise, the sampled rows once copied into a dense
    gradient. A forward that never gets its backward (no_grad, a dropped graph) never gives its
    tensor back, and two forwards before their backwards get two tensors, so a tensor is never shared by two
    live steps.
    """

    def __init__(self) -> None:
        self.spare: Tensor | None = None

    def take(self, shape: tuple[int, int], device: torch.device, busy: Tensor | None = None) -> Tensor:
        """The spare viewed to ``shape`` (it is no longer kept), or a fresh tensor. A spare whose memory ``busy``
        still uses is not handed out (it stays the spare)."""
        spare, self.spare = self.spare, None
        numel = shape[0] * shape[1]
        if spare is not None and busy is not None and busy.data_ptr() == spare.data_ptr():
            self.spare = spare
        elif spare is not None and spare.device == device and spare.numel() >= numel:
            return spare.view(-1)[:numel].view(shape)
        return torch.empty(shape, device=device)

    def give(self, tensor: Tensor) -> None:
        if tensor.device.type == "cpu" and (self.spare is None or self.spare.numel() < tensor.numel()):
            self.spare = tensor


def _block_logits(block: Tensor, s: float, target_logit: Tensor, here: Tensor, col: Tensor, start: int,
                  work: Tensor) -> Tensor:
    """Logits of a row block of cosines ``block (n, C)`` (rows ``start …`` of the batch) in ``work``: ``s·cos``,
    and on each row's target column (where ``here``) the margin's ``target_logit``. Rows whose class is
    elsewhere read and write back column 0, so the operations do not depend on the labels."""
    end = start + block.shape[0]
    logits = torch.mul(block, s, out=work[:block.shape[0]])  # (n, C)
    c = col[start:end]
    return logits.scatter_(1, c, torch.where(here[start:end], target_logit[start:end], logits.gather(1, c)))


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
        tactic: ``"auto"`` (default: by the device of the embeddings), ``"row_blocks"`` or ``"fixed_ops"``;
            see ``utils.distributed.resolve_tactic``. Both give the same values.
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

    Attributes: ``weight`` (num_local, K·D) fp32 Parameter, ``class_start``, ``num_local``, ``sub_centers``.
    ``forward(local_embeddings (B, D), local_labels (B,))`` returns the mean loss over the global batch;
    B may differ between ranks and steps.

    Host-device synchronisations per step (``utils.distributed.to_host``): one, reading the gathered batch
    sizes and label checks of every rank (``_check_inputs``); a second only when the positives can outnumber
    the sample (``_sample``). Everything else stays on the device.
    """

    def __init__(self, margin_loss: Margin | Callable[[Tensor, Tensor], Tensor], embedding_size: int,
                 num_classes: int, sample_rate: float = 1.0, *, seed: int = 0, tactic: Tactic = "auto",
                 sub_centers: int = 1, update: HeadUpdate = "sampled") -> None:
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
        resolve_tactic(tactic, "cpu")  # validates the name
        self.world_size = get_world_size()
        self.rank = get_rank()
        self.class_start, self.num_local = class_partition(num_classes, self.world_size, self.rank)
        self.margin_loss = margin_loss
        self.embedding_size = embedding_size
        self.num_classes = num_classes
        self.sample_rate = sample_rate
        self.tactic: Tactic = tactic
        self.sub_centers = sub_centers
        self.update: HeadUpdate = update
        # Centre k of class c is centre row c·K + k of the (C·K, D) matrix: its initial value depends only on
        # (seed, c·K + k), so the full weight does not depend on the world size.
        rows = _init_rows(seed, self.class_start * sub_centers, self.num_local * sub_centers, embedding_size)
        self.weight = nn.Parameter(rows.view(self.num_local, sub_centers * embedding_size))  # (num_local, K·D)
        self._grad_rows = -1  # rows of the last step's sparse weight gradient
        self._cosine_buffer = _Buffer()  # the fused head's (B, C) cosines, reused between steps
        self._gradient_buffer = _Buffer()  # a dense weight gradient's memory, reused between steps (CPU)
        self._rows_buffer = _Buffer()  # the sampled rows' memory (sparse gradient values), reused (CPU)
        self.weight.register_post_accumulate_grad_hook(self._after_accumulate)

    def _after_accumulate(self, weight: nn.Parameter) -> None:
        """Once the weight's gradient is accumulated:

        - A sparse gradient: autograd stores it (sorted, unique rows: coalesced) as a new tensor without that
          mark, and coalescing it again would sort and copy every row (and, on a GPU, read its size on the
          host). When ``weight.grad`` is exactly one step's gradient, not a sum of micro-batches (whose rows
          would number more), mark it again; the indices and values are shared, not copied.
        - Keep a CPU gradient's memory for the next step (``_keep_gradient_memory``): a dense one for the
          next backward's dense gradient, a sparse one's values for the next forward's gathered rows. When
          the optimizer's ``zero_grad(set_to_none=True)`` drops the gradient, its pages stay mapped and the
          next step writes there, so a gradient must not be read after the next step has begun (as with any
          gradient reset between steps); while it is still ``weight.grad`` (accumulation,
          ``zero_grad(set_to_none=False)``) the next step takes fresh memory. Other devices keep nothing.
        """
        grad = weight.grad
        if grad is None:
            return
        if not grad.is_sparse:
            self._gradient_buffer.give(grad)
            return
        if not grad.is_coalesced() and grad._nnz() == self._grad_rows:
            weight.grad = grad = torch.sparse_coo_tensor(grad._indices(), grad._values(), grad.shape,
                                                         is_coalesced=True, check_invariants=False)
        self._rows_buffer.give(grad._values())

    def extra_repr(self) -> str:
        return (f"embedding_size={self.embedding_size}, num_classes={self.num_classes}, "
                f"sample_rate={self.sample_rate}, class_start={self.class_start}, num_local={self.num_local}, "
                f"sub_centers={self.sub_centers}, update={self.update!r}, tactic={self.tactic!r}")

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

    def _sample(self, local: Tensor, in_shard: Tensor, tactic: str = "fixed_ops") -> Tensor:
        """Sorted local rows used this step: every positive plus uniformly drawn negatives, ``(k,)`` with
        ``k = sample_size(num_local, sample_rate, positives)``.

        A fixed number of operations. The number of positives is read on the host (the step's second and
        last synchronisation) only when it can exceed the sample, i.e. when ``int(sample_rate · num_local)``
        is smaller than the global batch (e.g. positive-only sampling); otherwise the size is known. With the
        CPU tactic (``row_blocks``) one compiled call chooses them (``utils.cpu_kernels.sample_rows``, the
        same rows).
        """
        device = self.weight.device
        # One draw from the global (CPU) torch RNG per step on every rank keeps the RNG streams aligned;
        # the seed travels to the device without a synchronisation.
        seed = torch.randint(0, _M31, (1,))  # (1,) on the CPU
        if (tactic == "row_blocks" and device.type == "cpu" and self.class_start + self.num_local <= 2**32
                and cpu_kernels.library() is not None):
            # The same rows from one compiled call: keys, positives, selection, in row order.
            return cpu_kernels.sample_rows(self.class_start, self.num_local, int(seed), local[in_shard],
                                           int(self.sample_rate * self.num_local))
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
        tactic = resolve_tactic(self.tactic, local_embeddings.device)
        batch_sizes = self._check_inputs(local_embeddings, local_labels)
        labels = all_gather_cat(local_labels.reshape(-1).long(), sizes=batch_sizes)  # (B_global,)
        # The head's backward starts the embeddings' reduce-scatter as soon as their gradient is known (early).
        early = EarlyGradient()
        embeddings = all_gather_cat(local_embeddings, grad_scale=float(self.world_size), sizes=batch_sizes,
                                    early=early)  # (B_global, D)

        local = labels - self.class_start  # (B_global,)
        in_shard = (local >= 0) & (local < self.num_local)  # (B_global,)
        if self.sample_rate < 1.0:
            index = self._sample(local, in_shard, tactic)  # (C_s,) sorted; sparse weight grad on these rows
            self._grad_rows = index.shape[0]
            column = torch.searchsorted(index, local.clamp(0, self.num_local - 1))  # (B_global,)
            target = torch.where(in_shard, column, -1)  # (B_global,)
        else:
            index = None
            target = torch.where(in_shard, local, -1)  # (B_global,)

        sparse = self.update == "sampled"
        if self.sub_centers == 1 and getattr(self.margin_loss, "target_only_scale", lambda: None)() is not None:
            return _MarginSoftmax.apply(embeddings, self.weight, index, target, self.margin_loss, tactic, sparse,
                                        self._cosine_buffer, self._gradient_buffer, self._rows_buffer, early)
        cos, norms = _NormalizedLinear.apply(embeddings, self.weight, index, tactic, sparse, self._gradient_buffer,
                                             self._rows_buffer, early)  # (B_global, C_s·K) fp32, (B_global,)
        if self.sub_centers > 1:
            # A class's cosine is its closest centre's; the gradient goes to that centre (split between exact ties).
            cos = cos.view(cos.shape[0], -1, self.sub_centers).amax(dim=2)  # (B_global, C_s)
        if hasattr(self.margin_loss, "apply_margin"):
            logits = self.margin_loss.apply_margin(cos, target, norms)  # (B_global, C_s)
        else:
            logits = self.margin_loss(cos, target)  # (B_global, C_s)
        return sharded_cross_entropy(logits, target, tactic)


PartialFC_V2 = PartialFC
