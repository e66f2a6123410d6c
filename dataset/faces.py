"""Face datasets: RecordIO (insightface or im2rec layout), an image folder, and generated patterns.

Each returns ``(uint8 (3, H, W) RGB image tensor, int64 label)``; ``build_dataset`` picks one from the
config's ``rec`` value. The loader (``dataset.loader``) batches, flips and normalises them; the RecordIO and
image-folder datasets also read a whole batch per call (``read_batch``), which is what a loader worker calls.
The inputs a config can name: docs/data.md#training-inputs.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from dataset.identity_folders import holds_identity_folders, identity_folders, names_shown
from dataset.images import IMAGE_EXTENSIONS, Transform, decode, decode_many, stack_flipped
from dataset.recordio import class_of, is_rec_folder, open_rec_folder, read_image_record, unpack

logger = logging.getLogger(__name__)


class _EncodedImages(Dataset):
    """Shared ``__getitem__`` of datasets whose ``raw(index)`` returns ``(encoded bytes, class id, where)``."""

    image_size: tuple[int, int]
    transform: Transform | None

    def raw(self, index: int) -> tuple[bytes, int, str]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        data, label, where = self.raw(index)
        img = decode(data, where, self.image_size)  # (3, H, W) uint8
        if self.transform is not None:
            img = self.transform(img)
        return img, torch.tensor(label, dtype=torch.int64)

    def read_batch(self, indices: Sequence[int], flips: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(uint8 (B, 3, H, W), int64 (B,))``: ``self[i]`` for each of ``indices``, mirrored where ``flips``
        says, in one call (one decoder call for the batch, no per-sample tensors; see ``stack_flipped``)."""
        raws = [self.raw(i) for i in indices]  # [(bytes, class id, where)]
        images = decode_many([r[0] for r in raws], [r[2] for r in raws], self.image_size)  # [(3, H, W)]
        if self.transform is not None:
            images = [self.transform(img) for img in images]
        labels = torch.tensor([r[1] for r in raws], dtype=torch.int64)  # (B,)
        return stack_flipped(images, flips), labels


class MXFaceDataset(_EncodedImages):
    """Images from ``root_dir/train.rec`` + ``train.idx`` (insightface layout with header record, or im2rec).

    ``num_classes`` defaults to ``property`` or the header record; with neither (an im2rec file without
    ``property``) every record is read once to find the largest label. A damaged folder raises the first
    problem ``dataset.recordio.open_rec_folder`` finds, at open time; a label ``>= num_classes`` is an
    error at open time when the header/property already show it, otherwise when that record is read.
    """

    def __init__(self, root_dir: str | os.PathLike, transform: Transform | None = None,
                 num_classes: int | None = None, image_size: tuple[int, int] = (112, 112)):
        folder = open_rec_folder(root_dir)
        if folder.problems:
            raise folder.problems[0]
        self.root, self.transform, self.image_size = folder.root, transform, tuple(image_size)
        self._rec = folder.rec
        self.rec_path = folder.rec.rec_path
        self.layout, self.keys = folder.layout, folder.image_keys
        if folder.image_size is not None and folder.image_size != self.image_size:
            raise ValueError(f"{self.root / 'property'}: images are {folder.image_size[0]}x{folder.image_size[1]}, "
                             f"but image_size is {self.image_size[0]}x{self.image_size[1]}")
        if num_classes is None:
            self.num_classes = folder.num_classes if folder.num_classes is not None else self._scan_num_classes()
        else:
            known = folder.num_classes
            if known is not None and known > num_classes:
                raise ValueError(f"{self._class_count_source()} says {known} classes (labels up to {known - 1}) "
                                 f"but num_classes={num_classes}; labels >= {num_classes} would be out of range")
            if known is not None and known < num_classes:
                logger.warning("%s says %d classes; using num_classes=%d (the extra classes get no images)",
                               self._class_count_source(), known, num_classes)
            self.num_classes = int(num_classes)
        logger.info("%s: %s layout, %d images, %d classes", self.rec_path, self.layout, len(self.keys),
                    self.num_classes)

    def _class_count_source(self) -> str:
        """Where the folder's class count comes from, for messages (property agrees with a header record)."""
        if self.layout == "insightface":
            return f"{self.rec_path} header record (key 0)"
        return str(self.root / "property")

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
        return read_image_record(self._rec, int(self.keys[index]), self.num_classes)


class ImageFolderDataset(_EncodedImages):
    """``root/<identity>/<image>.{jpg,jpeg,png}``, sub-folders of an identity included, as
    ``dataset.identity_folders`` lists them: class ids follow the sorted names of the identities holding an
    image; hidden and system entries are ignored, named in one warning."""

    def __init__(self, root: str | os.PathLike, transform: Transform | None = None,
                 image_size: tuple[int, int] = (112, 112)):
        self.root, self.transform, self.image_size = Path(root), transform, tuple(image_size)
        listing = identity_folders(self.root, IMAGE_EXTENSIONS)
        listing.check_listed()
        if (note := listing.ignored_note()) is not None:
            logger.warning("%s", note)
        if listing.empty:
            logger.warning("%s: %d identity folders without %s images are no class: %s", self.root,
                           len(listing.empty), "/".join(IMAGE_EXTENSIONS), names_shown(listing.empty))
        self.classes = listing.classes
        self.samples: list[tuple[Path, int]] = listing.samples()
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
    if is_rec_folder(path):
        return MXFaceDataset(path, num_classes=num_classes, image_size=image_size)
    if holds_identity_folders(path):
        ds = ImageFolderDataset(path, image_size=image_size)
        if num_classes is not None and num_classes != ds.num_classes:
            # The labels are 0..N-1 for N identity folders: fewer classes cannot hold them, more get no image.
            what = ("its labels would be out of range" if num_classes < ds.num_classes else
                    f"the head would train {num_classes - ds.num_classes} classes that have no image")
            raise ValueError(f"{path} has {ds.num_classes} identity folders (labels 0..{ds.num_classes - 1}) but "
                             f"num_classes = {num_classes}: {what}; set num_classes = {ds.num_classes}, or None to "
                             f"read it from the folder")
        return ds
    raise ValueError(f"dataset path {path} is neither; {expected}")
