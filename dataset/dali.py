"""The optional GPU-decode loader (NVIDIA DALI), fed by index, with the trainer's loader interface.

Two layers:

- ``RecordBatches`` (no DALI): which samples batch ``k`` of epoch ``e`` holds on rank ``r``, in order and with
  their flips, taken from ``FaceSampler`` (the sampler ``FaceDataLoader`` uses), and those records' encoded
  bytes and labels, read by ``MXFaceDataset.raw``;
- ``DaliLoader``: a DALI pipeline fed those batches through ``fn.external_source``, which decodes them on the
  GPU (nvJPEG), mirrors the flipped ones and normalises with ``PIXEL_MEAN``/``PIXEL_STD``.

A DALI run therefore trains on the batches ``FaceDataLoader`` gives for the same seed, epoch, rank and world
size (only the decoders' rounding differs), and ``set_epoch(epoch, start_step)`` starts at batch ``start_step``
without reading or decoding a record of the batches before it.

``nvidia.dali`` is imported only when the loader is built or iterated, so the package is needed only by runs
with ``dali = True``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from dataset.faces import MXFaceDataset
from dataset.images import PIXEL_MEAN, PIXEL_STD
from dataset.loader import FaceSampler


@dataclass(frozen=True)
class EncodedBatch:
    """One batch as the DALI pipeline takes it; sample ``j`` is dataset index ``indices[j]``."""

    indices: list[int]
    data: list[np.ndarray]  # [(n_j,) uint8]: the encoded image (JPEG or PNG) as stored in the record
    labels: np.ndarray  # (B,) int64 class ids
    mirror: np.ndarray  # (B,) int32, 1 = flip left-right (crop_mirror_normalize takes int32)


class RecordBatches:
    """The batches of one rank, by index: sample indices and flips from ``FaceSampler``, bytes and labels read
    by ``MXFaceDataset.raw``. What ``DaliLoader`` feeds DALI, with no DALI in it.

    The sampler is built as ``FaceDataLoader`` builds it (``drop_last``), so batch ``k`` of an epoch holds
    ``FaceDataLoader``'s batch ``k`` samples, labels and flips. Either RecordIO layout reads: the dataset
    knows the image keys, so the insightface header and identity-range records are never read as images.
    After ``set_epoch(epoch, start_step)`` iteration yields batches ``start_step .. len() - 1`` and reads only
    their records.
    """

    def __init__(self, dataset: MXFaceDataset, batch_size: int, *, rank: int, world_size: int, seed: int):
        self.dataset = dataset
        self.sampler = FaceSampler(len(dataset), batch_size, rank, world_size, seed)

    def __len__(self) -> int:
        return self.sampler.num_batches

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Next iteration yields epoch ``epoch`` from batch ``start_step`` on."""
        self.sampler.set_epoch(epoch, start_step)

    def __iter__(self) -> Iterator[EncodedBatch]:
        for indices, flips in self.sampler.batches():
            yield self.read(indices, flips)

    def read(self, indices: Sequence[int], flips: Sequence[bool]) -> EncodedBatch:
        """The records of dataset ``indices``, in order, with ``flips`` as DALI's mirror flags."""
        raws = [self.dataset.raw(i) for i in indices]  # [(encoded bytes, class id, "file (key k)")]
        return EncodedBatch(list(indices), [np.frombuffer(data, dtype=np.uint8) for data, _, _ in raws],
                            np.array([label for _, label, _ in raws], dtype=np.int64),
                            np.array(flips, dtype=np.int32))


def _import_dali():
    """``(fn, pipeline_def, types, DALIGenericIterator)``; ``ValueError`` saying what to install when absent."""
    try:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator
    except ImportError as exc:
        raise ValueError("the DALI loader was requested (dali = True) but nvidia.dali is not installed; "
                         "pip install nvidia-dali-cuda120, or set dali = False") from exc
    return fn, pipeline_def, types, DALIGenericIterator


class DaliLoader:
    """Iterates ``(images float32 (B, 3, H, W) normalised, labels int64 (B,))`` on the GPU: ``RecordBatches``
    decoded by DALI, with the trainer's loader interface.

    ``len()`` is the number of batches per rank per epoch; after ``set_epoch(epoch, start_step)`` iteration
    yields batches ``start_step .. len() - 1`` of that epoch, ``FaceDataLoader``'s batches for the same seed,
    rank and world size. Each iteration builds its own pipeline over that epoch's batches, so an iteration
    left before its end leaves nothing prefetched for the next.
    """

    def __init__(self, batches: RecordBatches, device_id: int, num_threads: int = 4):
        self.batches, self.device_id, self.num_threads = batches, device_id, num_threads
        self.num_images = len(batches.dataset)

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch (its order and flips) and the batch to start from."""
        self.batches.set_epoch(epoch, start_step)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.batches.sampler.start_step == len(self):
            return  # resumed at the epoch's end; DALI refuses a pipeline with no data
        _, _, _, DALIGenericIterator = _import_dali()
        pipe = self._pipeline(iter(self.batches))
        for out in DALIGenericIterator(pipe, ["images", "labels"]):  # ends when the source raises StopIteration
            yield out[0]["images"], out[0]["labels"]  # (B, 3, H, W) float32, (B,) int64, on the GPU

    def _pipeline(self, source: Iterator[EncodedBatch]):
        fn, pipeline_def, types, _ = _import_dali()

        @pipeline_def(batch_size=self.batches.sampler.batch_size, num_threads=self.num_threads,
                      device_id=self.device_id)
        def pipeline():
            # One source for the three inputs keeps each batch's bytes, labels and flips together in DALI's
            # prefetch queue.
            jpegs, labels, mirror = fn.external_source(
                source=((b.data, b.labels, b.mirror) for b in source), num_outputs=3, batch=True,
                dtype=[types.UINT8, types.INT64, types.INT32], ndim=[1, 0, 0])
            images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)  # (H, W, 3) uint8 each
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=[PIXEL_MEAN] * 3,
                                              std=[PIXEL_STD] * 3, mirror=mirror)  # (3, H, W) float32 each
            return images, labels.gpu()

        pipe = pipeline()
        pipe.build()
        return pipe


def get_dali_dataloader(rec_dir: str | os.PathLike, batch_size: int, *, rank: int, world_size: int, seed: int,
                        device: torch.device | str, num_threads: int = 4,
                        num_classes: int | None = None) -> DaliLoader:
    """GPU-decoding loader over ``rec_dir/train.rec`` (either layout) with NVIDIA DALI; see ``DaliLoader``.

    The rec is opened as ``MXFaceDataset(rec_dir, num_classes=num_classes)`` opens it (the same checks; with
    ``num_classes`` None the class count comes from ``property`` or the header record, or a pass over the
    records when neither has it). ``ValueError`` when nvidia.dali is not installed or ``device`` is not CUDA.
    """
    _import_dali()
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"the DALI loader needs a CUDA device; got device={device} "
                         f"(cuda available: {torch.cuda.is_available()})")
    dataset = MXFaceDataset(rec_dir, num_classes=num_classes)
    batches = RecordBatches(dataset, batch_size, rank=rank, world_size=world_size, seed=seed)
    device_id = device.index if device.index is not None else torch.cuda.current_device()
    return DaliLoader(batches, device_id, num_threads)
