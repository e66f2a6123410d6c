"""Partial FC: the margin-softmax head whose class centres are sharded over ranks (An, Deng et al., CVPR 2022).

Rank ``r`` owns the classes ``class_partition(C, W, r)``; every rank sees the all-gathered global batch, computes
cosines against its own (sampled) centres, and a log-space cross-entropy combines the shards: no rank holds the
(B_global, C) logits. The head is not wrapped in DDP (its parameters differ on every rank)::

    head = PartialFC(ArcFace(), 512, num_classes, sample_rate=0.1, seed=cfg.seed).to(device)
    opt_backbone, opt_head = build_optimizers("sgd", backbone.parameters(), head, lr, 0.9, 5e-4)
    loss = head(ddp_backbone(images), labels)  # the mean over the global batch, the same on every rank
    loss.backward(); opt_backbone.step(); opt_head.step()

Modules: ``head`` (``PartialFC``), ``sharding`` (ownership, initial centres, sampling), ``functions`` (the autograd
Functions), ``cross_entropy``, ``optimizers`` (row-sparse, and the table of a run's pair), ``checkpoint`` (a rank's
shard, read back on any world size). Gradients, sampling, sub-centres, precision, memory: docs/partial_fc.md.
"""
from partial_fc.checkpoint import head_shard, load_head_rows, restore_head
from partial_fc.cross_entropy import sharded_cross_entropy, sharded_log_sum_exp
from partial_fc.head import HEAD_UPDATES, HeadUpdate, PartialFC
from partial_fc.optimizers import OPTIMIZERS, RowSparseAdamW, RowSparseSGD, build_head_optimizer, build_optimizers
from partial_fc.sharding import class_partition, sample_size

__all__ = ["HEAD_UPDATES", "OPTIMIZERS", "HeadUpdate", "PartialFC", "RowSparseAdamW", "RowSparseSGD",
           "build_head_optimizer", "build_optimizers", "class_partition", "head_shard", "load_head_rows",
           "restore_head", "sample_size", "sharded_cross_entropy", "sharded_log_sum_exp"]
