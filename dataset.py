"""Training data: face datasets (RecordIO, image folder, synthetic) and a resumable distributed loader.

Datasets return ``(uint8 CHW image tensor, int64 label)``. ``get_dataloader`` turns one into batches of
``float32 NCHW`` images normalised to ``(x - 127.5) / 127.5`` on the training device:

- a sampler that shuffles with ``torch.Generator`` seeded by ``seed + epoch``, gives every rank the same
  number of batches and can start an epoch at any step (``set_epoch(epoch, start_step)``), so a resumed
  run sees exactly the batches an uninterrupted run would have seen;
- a horizontal flip that is a function of ``(seed, epoch, sample index)`` only, decided by the sampler
  in the main process, so it does not depend on ``num_workers``, worker seeding or resumption;
- uint8 batches cross the worker pipe and the host-to-device copy (4x fewer bytes than float32), and
  are normalised on the device; on CUDA the copy and normalisation run one batch ahead on a side stream.

``get_dali_dataloader`` is the optional GPU-decode path (NVIDIA DALI); it is imported only when asked for.
"""
from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from utils.recordio import IndexedRecordIO, RecordIOError, unpack

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
Transform = Callable[[torch.Tensor], torch.Tensor]


def decode(data: bytes, where: str) -> torch.Tensor:
    """Decode JPEG or PNG bytes to a ``(3, H, W)`` uint8 RGB tensor; ``ValueError`` naming ``where`` if not."""
    # bytearray: torch.frombuffer needs a writable buffer; the copy of a ~5 KB JPEG costs nothing.
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    try:
        if data[:2] == b"\xff\xd8":
            return decode_jpeg(raw, mode=ImageReadMode.RGB)  # (3, H, W)
        return decode_image(raw, mode=ImageReadMode.RGB)  # (3, H, W)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{where}: cannot decode image ({len(data)} bytes, starts with {data[:8]!r}): "
                         f"{exc}") from exc


def _check_size(image: torch.Tensor, image_size: tuple[int, int], where: str) -> None:
    if tuple(image.shape[1:]) != tuple(image_size):
        raise ValueError(f"{where}: image is {image.shape[1]}x{image.shape[2]} (HxW), expected "
                         f"{image_size[0]}x{image_size[1]}; re-align or rebuild with scripts/make_rec.py "
                         f"--image-size")


def _read_property(path: Path) -> tuple[int, tuple[int, int]] | None:
    """``(num_classes, (H, W))`` from an insightface ``property`` file, or None when there is none."""
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        c, h, w = (int(v) for v in text.split(","))
    except ValueError as exc:
        raise ValueError(f"{path}: expected 'num_classes,height,width' (e.g. '93431,112,112'); got "
                         f"{text[:80]!r}") from exc
    return c, (h, w)


def detect_layout(rec: IndexedRecordIO) -> tuple[str, np.ndarray, int | None]:
    """``(layout, image_keys, header_num_classes)`` of an open RecordIO.

    insightface: key 0 is a header record (label vector ``[N+1, N+1+C]``, no image bytes); images are
    keys ``1..N``. im2rec: every key is an image, and the class count is not recorded.
    """
    if 0 in rec:
        header, image = unpack(rec.read_idx(0))
        if header.flag >= 2 and len(image) == 0:
            first, end = int(header.label[0]), int(header.label[1])
            keys = np.arange(1, first, dtype=np.int64)
            missing = keys[~rec.has_keys(keys)][:5].tolist()
            if missing:
                raise RecordIOError(f"{rec.rec_path}: header record (key 0) says images are keys 1..{first - 1} "
                                    f"but {rec.idx_path} lacks keys {missing}")
            return "insightface", keys, end - first
    return "im2rec", rec.key_array.copy(), None


def class_of(header_label, where: str) -> int:
    """The class id of an IRHeader label: the scalar, or the first value of a vector label."""
    value = float(header_label) if np.ndim(header_label) == 0 else float(header_label[0])
    if value != int(value) or value < 0:
        raise ValueError(f"{where}: label {value} is not a non-negative integer class id")
    return int(value)


class _EncodedImages(Dataset):
    """Shared ``__getitem__`` of datasets whose ``raw(index)`` returns ``(encoded bytes, class id, where)``."""

    image_size: tuple[int, int]
    transform: Transform | None

    def raw(self, index: int) -> tuple[bytes, int, str]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        data, label, where = self.raw(index)
        img = decode(data, where)  # (3, H, W) uint8
        _check_size(img, self.image_size, where)
        if self.transform is not None:
            img = self.transform(img)
        return img, torch.tensor(label, dtype=torch.int64)


class MXFaceDataset(_EncodedImages):
    """Images from ``root_dir/train.rec`` + ``train.idx`` (insightface layout with header record, or im2rec).

    ``num_classes`` defaults to ``property`` or the header record; with neither (an im2rec file without
    ``property``) every record is read once to find the largest label. A label ``>= num_classes`` is an
    error: at open time when the header/property already show it, otherwise when that record is read.
    """

    def __init__(self, root_dir: str | os.PathLike, transform: Transform | None = None,
                 num_classes: int | None = None, image_size: tuple[int, int] = (112, 112)):
        root = Path(root_dir)
        rec_path, idx_path = root / "train.rec", root / "train.idx"
        missing = [p.name for p in (rec_path, idx_path) if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{root}: missing {' and '.join(missing)}; an MXNet RecordIO dataset folder "
                                    f"holds train.rec, train.idx and (insightface layout) property")
        self.root, self.transform, self.image_size = root, transform, tuple(image_size)
        self.rec_path = rec_path
        self._rec = IndexedRecordIO(idx_path, rec_path, "r")
        past = self._rec.offsets_past_end()
        if past:
            raise RecordIOError(f"{idx_path}: {len(past)} index offsets are past the end of {rec_path} "
                                f"({rec_path.stat().st_size} bytes), e.g. (key, offset) {past[:3]}; "
                                f"the .rec is truncated or belongs to another index")
        self._rec.read_last()  # a copy cut short loses its last record: say so now, not at the end of an epoch
        self.layout, self.keys, header_classes = detect_layout(self._rec)
        prop = _read_property(root / "property")
        known: dict[str, int] = {}
        if header_classes is not None:
            known[f"{rec_path} header record (key 0)"] = header_classes
        if prop is not None:
            known[str(root / "property")] = prop[0]
            if tuple(prop[1]) != self.image_size:
                raise ValueError(f"{root / 'property'}: images are {prop[1][0]}x{prop[1][1]}, but image_size is "
                                 f"{self.image_size[0]}x{self.image_size[1]}")
        if len(set(known.values())) > 1:
            raise ValueError(f"class counts disagree: {known}")
        if num_classes is None:
            self.num_classes = next(iter(known.values())) if known else self._scan_num_classes()
        else:
            for where, count in known.items():
                if count > num_classes:
                    raise ValueError(f"{where} says {count} classes (labels up to {count - 1}) but "
                                     f"num_classes={num_classes}; labels >= {num_classes} would be out of range")
                if count < num_classes:
                    logger.warning("%s says %d classes; using num_classes=%d (the extra classes get no images)",
                                   where, count, num_classes)
            self.num_classes = int(num_classes)
        logger.info("%s: %s layout, %d images, %d classes", rec_path, self.layout, len(self.keys),
                    self.num_classes)

    def _scan_num_classes(self) -> int:
        logger.warning("%s has no property file or header record: reading every record to count classes "
                       "(write 'num_classes,112,112' to %s or pass num_classes to skip this)",
                       self.rec_path, self.root / "property")
        return 1 + max(class_of(unpack(self._rec.read_idx(int(k)))[0].label, f"{self.rec_path} (key {k})")
                       for k in self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def raw(self, index: int) -> tuple[bytes, int, str]:
        """``(encoded image bytes, class id, "file (key k)")`` of sample ``index``, label range-checked."""
        key = int(self.keys[index])
        where = f"{self.rec_path} (key {key})"
        header, image = unpack(self._rec.read_idx(key))
        label = class_of(header.label, where)
        if label >= self.num_classes:
            raise ValueError(f"{where}: label {label} is out of range for num_classes={self.num_classes}")
        return image, label, where


class ImageFolderDataset(_EncodedImages):
    """``root/<identity>/<image>.{jpg,jpeg,png}``; class ids follow the sorted identity folder names."""

    def __init__(self, root: str | os.PathLike, transform: Transform | None = None,
                 image_size: tuple[int, int] = (112, 112)):
        self.root, self.transform, self.image_size = Path(root), transform, tuple(image_size)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder {self.root} does not exist")
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir())
        self.samples: list[tuple[Path, int]] = [
            (f, label) for label, name in enumerate(self.classes)
            for f in sorted((self.root / name).iterdir()) if f.suffix.lower() in IMAGE_EXTENSIONS]
        if not self.samples:
            raise ValueError(f"{self.root}: no images found; expected one folder per identity holding "
                             f"{'/'.join(IMAGE_EXTENSIONS)} files")
        self.num_classes = len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def raw(self, index: int) -> tuple[bytes, int, str]:
        """``(encoded image bytes, class id, path)`` of sample ``index``."""
        path, label = self.samples[index]
        return path.read_bytes(), label, str(path)


class SyntheticDataset(Dataset):
    """Generated uint8 images with label ``index % num_classes``, for speed tests and smoke runs.

    Each class has a smooth random pattern (8x8 colour cells upsampled); each image is its class's pattern
    plus independent noise, so a network can learn the classes (a smoke run's loss falls) while no two
    images are equal. Image ``i`` depends only on ``(seed, i)``.
    """

    def __init__(self, num_classes: int, num_images: int, image_size: tuple[int, int] = (112, 112), seed: int = 0):
        if num_classes <= 0 or num_images <= 0:
            raise ValueError(f"SyntheticDataset needs positive num_classes and num_images; got {num_classes}, "
                             f"{num_images}")
        self.num_classes, self.num_images, self.image_size, self.seed = num_classes, num_images, tuple(image_size), seed

    def __len__(self) -> int:
        return self.num_images

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_images:
            raise IndexError(f"synthetic index {index} outside [0, {self.num_images})")
        label = index % self.num_classes
        cells = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + label))
        pattern = torch.nn.functional.interpolate(cells, size=self.image_size, mode="bilinear", align_corners=False)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 500_009 + index)
        noise = torch.randn(3, *self.image_size, generator=g) * 0.15
        img = ((pattern[0] + noise).clamp_(0, 1) * 255).round_().to(torch.uint8)  # (3, H, W)
        return img, torch.tensor(label, dtype=torch.int64)


def build_dataset(rec: str, num_classes: int | None = None, image_size: tuple[int, int] = (112, 112),
                  seed: int = 0, num_images: int | None = None) -> Dataset:
    """``"synthetic"`` → SyntheticDataset (``num_images``, default 10 per class); a folder with
    ``train.rec``/``train.idx`` → MXFaceDataset; a folder of identity folders → ImageFolderDataset."""
    if rec == "synthetic":
        if num_classes is None:
            raise ValueError("rec='synthetic' needs num_classes")
        return SyntheticDataset(num_classes, num_images or 10 * num_classes, image_size, seed)
    path = Path(rec)
    expected = ("expected 'synthetic', a folder with train.rec and train.idx (MXNet RecordIO), or a folder of "
                "identity folders of images")
    if not path.exists():
        raise FileNotFoundError(f"dataset path {path} does not exist; {expected}")
    if (path / "train.rec").exists() or (path / "train.idx").exists():
        return MXFaceDataset(path, num_classes=num_classes, image_size=image_size)
    if path.is_dir() and any(d.is_dir() for d in path.iterdir()):
        ds = ImageFolderDataset(path, image_size=image_size)
        if num_classes is not None and num_classes < ds.num_classes:
            raise ValueError(f"{path} has {ds.num_classes} identity folders but num_classes={num_classes}")
        if num_classes is not None:
            ds.num_classes = num_classes
        return ds
    raise ValueError(f"dataset path {path} is neither; {expected}")


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


class _FlipView(Dataset):
    """Applies the sampler's flip decision inside the worker: ``view[(i, flip)]``."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, bool]) -> tuple[torch.Tensor, torch.Tensor]:
        index, flip = item
        img, label = self.dataset[index]  # (3, H, W) uint8
        return (img.flip(-1) if flip else img), label


def _worker_init(worker_id: int) -> None:
    # Workers compete with the trainer for cores; one intra-op thread each. Seeds derive from the loader's
    # generator (torch seeds each worker with base_seed + worker_id) for user transforms that draw numbers.
    torch.set_num_threads(1)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``(B, 3, H, W)`` → float32 ``(x - 127.5) / 127.5`` on the same device."""
    return images.float().sub_(127.5).div_(127.5)  # (B, 3, H, W)


class FaceDataLoader:
    """Iterates ``(images float32 (B, 3, H, W) normalised, labels int64 (B,))`` on ``device``.

    ``len()`` is the number of batches in a full epoch (equal on every rank); after
    ``set_epoch(epoch, start_step)`` iteration yields batches ``start_step .. len() - 1`` of that epoch.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int,
                 num_workers: int, device: torch.device | str, drop_last: bool = True):
        self.dataset, self.device = dataset, torch.device(device)
        self.sampler = FaceSampler(len(dataset), batch_size, rank, world_size, seed, drop_last)
        cuda = self.device.type == "cuda"
        self._loader = DataLoader(
            _FlipView(dataset), batch_size=batch_size, sampler=self.sampler, num_workers=num_workers,
            pin_memory=cuda, drop_last=False,  # the sampler already yields whole batches only
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

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.device.type == "cuda":
            yield from self._iter_cuda()
            return
        for images, labels in self._loader:  # (B, 3, H, W) uint8, (B,) int64
            yield normalise(images.to(self.device)), labels.to(self.device)

    def _iter_cuda(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Copy + normalise batch k+1 on a side stream while the trainer computes on batch k.
        stream = torch.cuda.Stream(device=self.device)
        batches = iter(self._loader)

        def load():
            try:
                images, labels = next(batches)  # pinned (B, 3, H, W) uint8, (B,) int64
            except StopIteration:
                return None
            with torch.cuda.stream(stream):
                images = normalise(images.to(self.device, non_blocking=True))  # (B, 3, H, W) float32
                labels = labels.to(self.device, non_blocking=True)  # (B,)
            return images, labels

        nxt = load()
        while nxt is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            images, labels = nxt
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
        raise RuntimeError("the DALI loader was requested (dali = True) but nvidia.dali is not installed; "
                           "pip install nvidia-dali-cuda120, or set dali = False") from exc
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"the DALI loader needs a CUDA device; got device={device} "
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
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=[127.5] * 3,
                                          std=[127.5] * 3, mirror=fn.random.coin_flip(probability=0.5))
        return images, labels.gpu()

    pipe = pipeline()
    pipe.build()
    iterator = DALIGenericIterator(pipe, ["images", "labels"], reader_name="reader",
                                   last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
    return DaliLoader(iter(iterator), num_images, batch_size, world_size)
