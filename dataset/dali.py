"""The optional GPU-decode loader (NVIDIA DALI), with the trainer's loader interface.

``nvidia.dali`` is imported only when ``get_dali_dataloader`` is called, so the package is needed only by
runs with ``dali = True``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch

from dataset.images import PIXEL_MEAN, PIXEL_STD
from dataset.recordio import IndexedRecordIO, detect_layout


class DaliLoader:
    """GPU-decoding loader over ``rec_dir/train.rec`` with NVIDIA DALI, with the trainer's loader interface.

    ``len()`` is the number of whole batches per rank per epoch; ``set_epoch(epoch, start_step)`` skips
    ``start_step`` batches, so a resumed run continues at the right position but, unlike
    ``FaceDataLoader``, not with the same images: DALI shuffles within a buffer with its own random stream and
    flips with its own coin, neither of which can be replayed.
    """

    def __init__(self, iterator, num_images: int, batch_size: int, world_size: int):
        self._iterator = iterator
        self.num_images = num_images
        self._num_batches = num_images // world_size // batch_size
        self._skip = 0

    def __len__(self) -> int:
        return self._num_batches

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self._skip = start_step

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(self._num_batches):
            try:
                batch = next(self._iterator)[0]
            except StopIteration:  # DALI's pass over the shard ended a batch early; auto_reset began the next
                batch = next(self._iterator)[0]
            if step < self._skip:
                continue
            labels = batch["labels"]  # (B,) or (B, K) float: the class id is the first value
            yield batch["images"], labels.reshape(labels.shape[0], -1)[:, 0].long()


def get_dali_dataloader(rec_dir: str | os.PathLike, batch_size: int, *, rank: int, world_size: int, seed: int,
                        device: torch.device | str, num_threads: int = 4) -> DaliLoader:
    """GPU-decoding loader over ``rec_dir/train.rec`` with NVIDIA DALI (optional; untested on CPU machines).

    The rec must have no header record (run ``scripts/shuffle_rec.py`` first: DALI reads every index
    entry as an image and shuffles within a buffer, so a pre-shuffled file gives a better mix). See
    ``DaliLoader`` for what resumption does and does not restore.
    """
    try:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as exc:
        raise ValueError("the DALI loader was requested (dali = True) but nvidia.dali is not installed; "
                           "pip install nvidia-dali-cuda120, or set dali = False") from exc
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"the DALI loader needs a CUDA device; got device={device} "
                           f"(cuda available: {torch.cuda.is_available()})")
    root = Path(rec_dir)
    with IndexedRecordIO(root / "train.idx", root / "train.rec", "r") as rec:
        layout = detect_layout(rec)[0]
        num_images = len(rec.keys)
    if layout != "im2rec":
        raise ValueError(f"{root}/train.rec has an insightface header record, which DALI would read as an image; "
                         f"write a shuffled copy without it: python scripts/shuffle_rec.py {root} <out_dir>")

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device.index or 0, seed=seed + rank)
    def pipeline():
        jpegs, labels = fn.readers.mxnet(path=[str(root / "train.rec")], index_path=[str(root / "train.idx")],
                                         random_shuffle=True, shard_id=rank, num_shards=world_size, name="reader")
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=[PIXEL_MEAN] * 3,
                                          std=[PIXEL_STD] * 3, mirror=fn.random.coin_flip(probability=0.5))
        return images, labels.gpu()

    pipe = pipeline()
    pipe.build()
    iterator = DALIGenericIterator(pipe, ["images", "labels"], reader_name="reader",
                                   last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
    return DaliLoader(iter(iterator), num_images, batch_size, world_size)
