"""Which rank owns which class centres, their initial values, and which of them a step uses.

``class_partition`` is the one rule of ownership (contiguous class ids, the first ``C mod W`` ranks one more);
``init_rows`` gives a class's initial centre from ``(seed, class id)`` alone, so the full weight does not depend
on the world size; ``sample_rows`` picks a step's rows: every positive plus negatives in the order of a hash that
every device computes alike (``sampling_keys``), with a fixed number of operations.
"""
from __future__ import annotations

import torch
from torch import Tensor

from utils.distributed import to_host

__all__ = ["INIT_BLOCK", "class_partition", "init_rows", "sample_rows", "sample_size", "sampling_keys"]

INIT_BLOCK = 1024  # classes per independently seeded block of initial weights
_M30 = (1 << 30) - 1
_M31 = (1 << 31) - 1
_LIFT = 1 << 62  # added to a positive's sampling key


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


def init_rows(seed: int, class_start: int, num_local: int, dim: int,
              device: torch.device | str = "cpu") -> Tensor:
    """``normal(0, 0.01)`` rows for classes ``[class_start, class_start + num_local)``, made on ``device``.

    Each block of ``INIT_BLOCK`` classes is drawn from its own generator seeded by ``(seed, block)``, straight into
    the output on ``device`` (no host copy), so class ``c``'s centre depends only on ``seed`` and ``c``, whatever the
    world size. The CPU's and CUDA's generators differ: a head made on a GPU has other (equally distributed)
    initial centres than one made on the CPU.
    """
    out = torch.empty(num_local, dim, device=device)  # (num_local, D)
    end = class_start + num_local
    generator = torch.Generator(device=out.device)
    for block in range(class_start // INIT_BLOCK, (end - 1) // INIT_BLOCK + 1):
        generator.manual_seed((seed * 1_000_003 + block) % (2**63))
        lo, hi = max(class_start, block * INIT_BLOCK), min(end, (block + 1) * INIT_BLOCK)
        if lo == block * INIT_BLOCK and hi == (block + 1) * INIT_BLOCK:  # a whole block: drawn in place
            torch.randn(INIT_BLOCK, dim, generator=generator, device=out.device,
                        out=out[lo - class_start: hi - class_start])
        else:  # a block the shard starts or ends inside: the same draws, the shard's part of them kept
            values = torch.randn(INIT_BLOCK, dim, generator=generator, device=out.device)  # (BLOCK, D)
            out[lo - class_start: hi - class_start] = values[lo - block * INIT_BLOCK: hi - block * INIT_BLOCK]
    return out.mul_(0.01)


def _mix31_(x: Tensor, work: Tensor) -> Tensor:
    """A 31-bit integer hash of int64 values in ``[0, 2^31)`` (xor-shift / multiply rounds), in place; ``work`` is
    a tensor of ``x``'s shape and dtype that it overwrites.

    Every product stays below 2^58, so the arithmetic is exact int64 on every device: the CPU and a GPU
    compute the same bits, and so sample the same classes.
    """
    for _ in range(2):
        x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=work)).mul_(0x45D9F3B).bitwise_and_(_M31)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=work))


def sampling_keys(class_ids: Tensor, seed: Tensor) -> Tensor:
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


def sample_rows(local: Tensor, in_shard: Tensor, class_start: int, num_local: int, sample_rate: float) -> Tensor:
    """Sorted local rows of the shard ``[class_start, class_start + num_local)`` used this step: every positive
    (``local (B_global,)`` holds the gathered labels minus ``class_start``; ``in_shard`` where they are this
    shard's) plus uniformly drawn negatives, ``(k,)`` with ``k = sample_size(num_local, sample_rate, positives)``,
    on the labels' device.

    A fixed number of operations. The number of positives is read on the host (the step's second and
    last synchronisation) only when it can exceed the sample, i.e. when ``int(sample_rate · num_local)``
    is smaller than the global batch (e.g. positive-only sampling); otherwise the size is known.
    """
    device = local.device
    # One draw from the global (CPU) torch RNG per step on every rank keeps the RNG streams aligned;
    # the seed travels to the device without a synchronisation.
    seed = torch.randint(0, _M31, (1,))  # (1,) on the CPU
    ids = torch.arange(class_start, class_start + num_local, device=device)  # (num_local,)
    keys = sampling_keys(ids, seed.to(device, non_blocking=True))  # (num_local,) distinct, below 2^62
    # Positives go first: 2^62 lifts them above every other key.
    rows = local.clamp(0, num_local - 1)  # (B_global,)
    keys.scatter_reduce_(0, rows, keys.gather(0, rows) + torch.where(in_shard, _LIFT, 0), reduce="amax")
    positives = (keys >= _LIFT).sum()  # ()
    k = int(sample_rate * num_local)
    if k < min(local.shape[0], num_local):
        k = sample_size(num_local, sample_rate, to_host(positives))
    chosen = torch.topk(keys, k, sorted=False).indices  # (k,)
    return chosen.sort().values  # (k,)
