"""The training loader: a distributed, resumable sampler and batches normalised on the training device.

``get_dataloader(dataset, ...)`` yields ``(float32 (B, 3, H, W), int64 (B,))`` batches. ``FaceSampler`` decides
each epoch's order and flips from ``(seed, epoch, sample)`` alone, in the main process, so resuming at any step
(``set_epoch(epoch, start_step)``), any ``num_workers`` or world size sees the same batches. A worker reads one
whole batch per call (``read_leaving_out``) into one uint8 tensor; uint8 crosses the worker pipe and the
host-to-device copy (4x fewer bytes than float32) and is normalised on the device (``dataset.images.normalise``),
on CUDA one batch ahead on a side stream. docs/data.md#how-the-loader-reads.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from dataset.images import normalise, stack_flipped


class FaceSampler(Sampler):
    """Distributed, resumable sampler yielding ``(dataset index, flip)`` pairs for one rank.

    Epoch ``e`` permutes all indices with ``torch.Generator().manual_seed(seed + e)`` and draws one flip bit
    per dataset index from the same generator; rank ``r`` takes positions ``r, r + W, ...``. With
    ``drop_last`` every rank gets ``N // W // B`` full batches; otherwise the permutation is padded by
    wrapping so every rank gets ``ceil(N / W)`` samples (the same number of batches).
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int,
                 drop_last: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        self.n, self.batch_size, self.rank, self.world_size = num_samples, batch_size, rank, world_size
        self.seed, self.drop_last = seed, drop_last
        per_rank = num_samples // world_size if drop_last else -(-num_samples // world_size)
        self.num_batches = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
        self.per_rank = self.num_batches * batch_size if drop_last else per_rank
        if self.num_batches == 0:
            raise ValueError(f"{num_samples} samples on {world_size} ranks give no full batch of {batch_size} "
                             f"per rank; use a smaller batch_size or more data")
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Next iteration yields epoch ``epoch`` from batch ``start_step`` on."""
        if not 0 <= start_step <= self.num_batches:
            raise ValueError(f"start_step {start_step} outside [0, {self.num_batches}] batches per epoch")
        self.epoch, self.start_step = epoch, start_step

    def epoch_plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices (per_rank,), flips (per_rank,) bool)`` of this rank for the current epoch."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g)  # (N,)
        flip = torch.randint(0, 2, (self.n,), generator=g, dtype=torch.uint8).bool()  # (N,) by dataset index
        total = self.per_rank * self.world_size
        if total > self.n:
            perm = perm.repeat(-(-total // self.n))
        mine = perm[self.rank:total:self.world_size]  # (per_rank,)
        return mine, flip[mine]

    def __iter__(self) -> Iterator[tuple[int, bool]]:
        indices, flips = self.epoch_plan()
        start = self.start_step * self.batch_size
        return iter(zip(indices[start:].tolist(), flips[start:].tolist()))

    def __len__(self) -> int:
        return self.per_rank - self.start_step * self.batch_size

    def batches(self) -> Iterator[tuple[list[int], list[bool]]]:
        """The same samples as ``iter(self)``, cut into batches: ``(dataset indices, flips)`` of ``batch_size``
        samples each (the last one shorter only without ``drop_last``)."""
        indices, flips = self.epoch_plan()
        # Plain lists: they travel to the workers pickled, where a tensor would cost a shared-memory segment.
        indices, flips = indices.tolist(), flips.tolist()
        for start in range(self.start_step * self.batch_size, self.per_rank, self.batch_size):
            yield indices[start:start + self.batch_size], flips[start:start + self.batch_size]


class _BatchPlan(Sampler):
    """The DataLoader's sampler: one item per batch, ``(indices, flips)``, from ``FaceSampler.batches``."""

    def __init__(self, sampler: FaceSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[list[int], list[bool]]]:
        return self.sampler.batches()

    def __len__(self) -> int:
        return self.sampler.num_batches - self.sampler.start_step


def _read_per_sample(dataset: Dataset, indices: Sequence[int], flips: Sequence[bool]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch from any dataset of ``(uint8 (3, H, W), label)`` samples (SyntheticDataset, a user's own)."""
    samples = [dataset[i] for i in indices]
    labels = torch.stack([torch.as_tensor(label) for _, label in samples])  # (B,)
    return stack_flipped([img for img, _ in samples], flips), labels


def problem_line(index: int, exc: ValueError | OSError) -> str:
    """The line naming a sample that could not be read: a ``ValueError``'s own message (it names the file and
    key), otherwise ``sample {index}: {exc}``."""
    return str(exc) if isinstance(exc, ValueError) else f"sample {index}: {exc}"


def read_leaving_out(dataset: Dataset, indices: Sequence[int], flips: Sequence[bool]
                     ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``(uint8 (B', 3, H, W), labels (B',), problems)``: samples ``indices`` of ``dataset``, mirrored where ``flips``
    says, with every sample that cannot be read or decoded left out (``B' < B``, possibly 0) and one line in
    ``problems`` for it, naming its file (the trainer decides whether that stops the run). What a loader worker
    returns for a batch, and what the DALI loader decodes a batch with when DALI cannot take it."""
    read = getattr(dataset, "read_batch", None) or functools.partial(_read_per_sample, dataset)
    try:
        images, labels = read(indices, flips)
        return images, labels, []
    except (ValueError, OSError):
        pass  # a bad sample: read them one by one to leave out exactly the bad ones
    good: list[tuple[torch.Tensor, torch.Tensor]] = []
    problems: list[str] = []
    for index, flip in zip(indices, flips):
        try:
            good.append(read([index], [flip]))
        except (ValueError, OSError) as exc:
            problems.append(problem_line(index, exc))
    if not good:
        size = getattr(dataset, "image_size", (112, 112))
        return torch.empty((0, 3, *size), dtype=torch.uint8), torch.empty(0, dtype=torch.int64), problems
    images = torch.cat([g[0] for g in good]).contiguous(memory_format=torch.channels_last)  # (B', 3, H, W)
    return images, torch.cat([g[1] for g in good]), problems


class _BatchView(Dataset):
    """What a worker calls: ``view[(indices, flips)]`` -> ``read_leaving_out(dataset, indices, flips)``."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[Sequence[int], Sequence[bool]]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        return read_leaving_out(self.dataset, *item)


def _worker_init(worker_id: int) -> None:
    # Workers compete with the trainer for cores; one intra-op thread each. Seeds derive from the loader's
    # generator (torch seeds each worker with base_seed + worker_id) for user transforms that draw numbers.
    torch.set_num_threads(1)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class FaceDataLoader:
    """Iterates ``(images float32 (B, 3, H, W) normalised, labels int64 (B,))`` on ``device``.

    ``len()`` is the number of batches in a full epoch (equal on every rank); after
    ``set_epoch(epoch, start_step)`` iteration yields batches ``start_step .. len() - 1`` of that epoch. A sample
    that cannot be read or decoded is left out of its batch, and ``take_problems()`` returns one line per such
    sample since the last call (the trainer stops the run, or skips them with ``skip_bad_images``).
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int,
                 num_workers: int, device: torch.device | str, drop_last: bool = True):
        self.dataset, self.device = dataset, torch.device(device)
        self.problems: list[str] = []
        self.sampler = FaceSampler(len(dataset), batch_size, rank, world_size, seed, drop_last)
        cuda = self.device.type == "cuda"
        self._loader = DataLoader(
            # batch_size=None: each sampler item is a whole batch, built by one worker call, nothing to collate.
            _BatchView(dataset), batch_size=None, sampler=_BatchPlan(self.sampler), num_workers=num_workers,
            pin_memory=cuda,
            persistent_workers=num_workers > 0,  # keeps opened .rec descriptors and decoder state across epochs
            worker_init_fn=_worker_init if num_workers > 0 else None,
            generator=torch.Generator().manual_seed(seed + rank),
            prefetch_factor=4 if num_workers > 0 else None,
        )

    def __len__(self) -> int:
        return self.sampler.num_batches

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch (reshuffle) and the batch to start from."""
        self.sampler.set_epoch(epoch, start_step)

    def take_problems(self) -> list[str]:
        """The samples left out of the batches yielded since the last call, a line each naming the file."""
        problems, self.problems = self.problems, []
        return problems

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.device.type == "cuda":
            yield from self._iter_cuda()
            return
        for images, labels, problems in self._loader:  # (B, 3, H, W) uint8 channels-last, (B,) int64, [str]
            self.problems += problems
            yield normalise(images.to(self.device)), labels.to(self.device)  # (B, 3, H, W) float32 contiguous

    def _iter_cuda(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Copy + normalise batch k+1 on a side stream while the trainer computes on batch k.
        stream = torch.cuda.Stream(device=self.device)
        batches = iter(self._loader)

        def load():
            try:
                images, labels, problems = next(batches)  # pinned (B, 3, H, W) uint8 channels-last, (B,) int64
            except StopIteration:
                return None
            with torch.cuda.stream(stream):
                # .to keeps the channels-last strides (a plain copy); normalise transposes on the device.
                images = normalise(images.to(self.device, non_blocking=True))  # (B, 3, H, W) float32
                labels = labels.to(self.device, non_blocking=True)  # (B,)
            return images, labels, problems

        nxt = load()
        while nxt is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            images, labels, problems = nxt
            self.problems += problems  # this batch's, not the next one's, which is being loaded already
            # The tensors were allocated on the side stream; tell the allocator the main stream uses them.
            images.record_stream(current)
            labels.record_stream(current)
            nxt = load()
            yield images, labels


def get_dataloader(dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int,
                   num_workers: int, device: torch.device | str, drop_last: bool = True) -> FaceDataLoader:
    """The training loader (see ``FaceDataLoader``): distributed, resumable, normalised batches on ``device``."""
    return FaceDataLoader(dataset, batch_size, rank=rank, world_size=world_size, seed=seed,
                          num_workers=num_workers, device=device, drop_last=drop_last)
