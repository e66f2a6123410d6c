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
(``RowSparseSGD`` / ``RowSparseAdamW``, built by ``build_optimizers``) update only
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

The package holds everything that knows the sharded class centres:

- ``head``: the module ``PartialFC``;
- ``sharding``: which rank owns which classes, their initial centres, which centres a step samples;
- ``functions``: the two autograd Functions (the cosines; the fused margin-softmax) and their local parts;
- ``cross_entropy``: the softmax cross-entropy over the ranks' shards, combined in log space;
- ``optimizers``: the row-sparse optimizers of the centres, and the one table that picks both of a run;
- ``checkpoint``: a rank's shard in a checkpoint and the rows of another world size read back from it.
"""
from partial_fc.checkpoint import head_shard, load_head_rows, restore_head
from partial_fc.cross_entropy import sharded_cross_entropy, sharded_log_sum_exp
from partial_fc.head import HEAD_UPDATES, HeadUpdate, PartialFC
from partial_fc.optimizers import OPTIMIZERS, RowSparseAdamW, RowSparseSGD, build_head_optimizer, build_optimizers
from partial_fc.sharding import class_partition, sample_size

__all__ = ["HEAD_UPDATES", "OPTIMIZERS", "HeadUpdate", "PartialFC", "RowSparseAdamW", "RowSparseSGD",
           "build_head_optimizer", "build_optimizers", "class_partition", "head_shard", "load_head_rows",
           "restore_head", "sample_size", "sharded_cross_entropy", "sharded_log_sum_exp"]
