"""``PartialFC``: the margin-softmax head whose class centres are sharded over ranks (see the package docstring)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from losses import Margin
from partial_fc.cross_entropy import sharded_cross_entropy
from partial_fc.functions import MarginSoftmax, NormalizedLinear
from partial_fc.sharding import class_partition, init_rows, sample_rows
from utils.distributed import EarlyGradient, all_gather_cat, all_gather_sizes, get_rank, get_world_size

__all__ = ["HEAD_UPDATES", "HeadUpdate", "PartialFC"]

HeadUpdate = Literal["sampled", "all"]
HEAD_UPDATES = ("sampled", "all")


class PartialFC(nn.Module):
    """Margin-softmax head with class centres sharded over ranks and optional class sampling.

    Args:
        margin_loss: a ``losses.Margin``, called as ``apply_margin(cosines, labels, norms)`` with the gathered
            embeddings' norms (a module margin's buffers are the head's, the same on every rank), or a plain
            callable ``(cosines (B, C_s), labels (B,) with -1 = elsewhere) -> logits``. A target-only margin
            (``target_only_scale()`` not None) with ``sub_centers == 1`` is fused with the cross-entropy
            (``MarginSoftmax``: the logits are never stored; the values are the unfused chain's).
        embedding_size: D.
        num_classes: C over all ranks (>= world size).
        sample_rate: in (0, 1]; below 1 a step uses every class of the global batch plus uniformly drawn
            negatives, ``sample_size`` classes per rank (``sharding.sample_rows``).
        seed: the initial centres, ``normal(0, 0.01)``, depend only on (seed, class id), not on the world size.
        sub_centers: K >= 1 centres per class (sub-center ArcFace, Deng et al., ECCV 2020), side by side in the
            class's row; a class's cosine is its closest centre's.
        update: ``"sampled"`` (a sparse gradient: only the sampled rows and their state move) or ``"all"``
            (arcface_torch's dense gradient, zero on unsampled rows); the same at ``sample_rate == 1``.
        compile: run the fused head's collective-free parts through ``torch.compile`` (same values to rounding).
        device: where the centres are initialised (in blocks, no host copy of the shard).

    ``weight`` is (num_local, K·D) fp32. ``forward(local_embeddings (B, D), local_labels (B,))`` returns the mean
    loss over the global batch; B may differ between ranks and steps. A step is a fixed number of whole-tensor
    operations with one host synchronisation (``_check_inputs``), a second only when the positives can outnumber
    the sample. See docs/partial_fc.md.
    """

    def __init__(self, margin_loss: Margin | Callable[[Tensor, Tensor], Tensor], embedding_size: int,
                 num_classes: int, sample_rate: float = 1.0, *, seed: int = 0, sub_centers: int = 1,
                 update: HeadUpdate = "sampled", compile: bool = False,
                 device: torch.device | str = "cpu") -> None:
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
        rows = init_rows(seed, self.class_start * sub_centers, self.num_local * sub_centers, embedding_size, device)
        self.weight = nn.Parameter(rows.view(self.num_local, sub_centers * embedding_size))  # (num_local, K·D)
        self._grad_rows = -1  # rows of the last step's sparse weight gradient
        self.weight.register_post_accumulate_grad_hook(self._mark_coalesced)

    def _mark_coalesced(self, weight: nn.Parameter) -> None:
        """Mark one step's sparse gradient coalesced again: autograd stores it without the mark, and coalescing
        it again would sort and copy every row (and read its size on the host). A sum of micro-batches (more rows)
        is left alone; the indices and values are shared, not copied."""
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
            index = sample_rows(local, in_shard, self.class_start, self.num_local,
                                self.sample_rate)  # (C_s,) sorted; sparse weight grad on these rows
            self._grad_rows = index.shape[0]
            column = torch.searchsorted(index, local.clamp(0, self.num_local - 1))  # (B_global,)
            target = torch.where(in_shard, column, -1)  # (B_global,)
        else:
            index = None
            target = torch.where(in_shard, local, -1)  # (B_global,)

        sparse = self.update == "sampled"
        if self.sub_centers == 1 and getattr(self.margin_loss, "target_only_scale", lambda: None)() is not None:
            return MarginSoftmax.apply(embeddings, self.weight, index, target, self.margin_loss, sparse, early,
                                        self.compile)
        cos, norms = NormalizedLinear.apply(embeddings, self.weight, index, sparse,
                                             early)  # (B_global, C_s·K) fp32, (B_global,)
        if self.sub_centers > 1:
            # A class's cosine is its closest centre's; the gradient goes to that centre (split between exact ties).
            cos = cos.view(cos.shape[0], -1, self.sub_centers).amax(dim=2)  # (B_global, C_s)
        if hasattr(self.margin_loss, "apply_margin"):
            logits = self.margin_loss.apply_margin(cos, target, norms)  # (B_global, C_s)
        else:
            logits = self.margin_loss(cos, target)  # (B_global, C_s)
        return sharded_cross_entropy(logits, target)
