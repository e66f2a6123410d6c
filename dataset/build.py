"""The training loader a run asks for (DALI's or ours over the dataset ``rec`` names), and what the data holds
(``data_identity``: what a checkpoint's fingerprint records of it). docs/data.md#training-inputs."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from dataset.dali import DaliLoader, get_dali_dataloader
from dataset.faces import build_dataset
from dataset.identity_folders import identity_folders
from dataset.images import IMAGE_EXTENSIONS
from dataset.loader import FaceDataLoader, get_dataloader


def build_data(rec: str, batch_size: int, *, num_classes: int | None, num_image: int | None, seed: int,
               num_workers: int, dali: bool, rank: int, world_size: int, device: torch.device,
               logger: logging.Logger) -> tuple[FaceDataLoader | DaliLoader, int, int]:
    """``(loader, num_classes, num_image)``: the loader of ``rank`` over ``rec`` (NVIDIA DALI's when ``dali``) and
    the class and image counts, ``num_classes`` / ``num_image`` when given (the image count must be the dataset's),
    else what the dataset holds; both are logged with where they came from."""
    if dali:
        if num_classes is None:
            raise ValueError("dali = True needs num_classes: the DALI reader does not count classes")
        loader = get_dali_dataloader(rec, batch_size, rank=rank, world_size=world_size, seed=seed, device=device,
                                     num_classes=num_classes)
        images, classes = loader.num_images, num_classes
    else:
        data = build_dataset(rec, num_classes=num_classes, seed=seed, num_images=num_image)
        loader = get_dataloader(data, batch_size, rank=rank, world_size=world_size, seed=seed,
                                num_workers=num_workers, device=device)
        images, classes = len(data), data.num_classes
    if num_image is not None and images != num_image:
        raise ValueError(f"num_image = {num_image} in the config, but the dataset {rec!r} holds {images} "
                         f"images; set num_image = {images} or None (it sets the steps per epoch and the LR)")
    logger.info("data %s: num_classes = %d (%s), num_image = %d (%s)", rec, classes,
                "the config's" if num_classes is not None else "from the dataset", images,
                "the config's" if num_image is not None else "from the dataset")
    return loader, classes, images


def data_identity(rec: str) -> str:
    """What the training data holds, not where it lies: a hash of ``train.idx`` and the size of ``train.rec``
    (RecordIO), of the relative paths and sizes of the images training reads (an image folder, by the one
    identity-folder rule: hidden and system files are not data), or ``"synthetic"``. A dataset copied or moved
    keeps its identity; one with records or images added, removed or resized does not. Contents are not read (a
    dataset may be terabytes)."""
    if rec == "synthetic":
        return "synthetic"
    root = Path(rec)
    if (root / "train.idx").is_file() or not root.is_dir():
        return _digest(root, [])
    found = identity_folders(root, IMAGE_EXTENSIONS)
    return _digest(root, sorted(p.relative_to(root) for name in found.classes for p in found.files[name]))


def legacy_data_identity(rec: str, current: str | None = None) -> str | None:
    """An image folder's identity taken over every file under it, hidden and system files too, when it differs
    from ``data_identity``'s (``current``, when the caller has it): the same data, as checkpoints that recorded
    that form name it. None for a RecordIO or synthetic dataset."""
    root = Path(rec)
    if rec == "synthetic" or (root / "train.idx").is_file() or not root.is_dir():
        return None
    legacy = _digest(root, sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file()))
    return legacy if legacy != (data_identity(rec) if current is None else current) else None


def _digest(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    if (root / "train.idx").is_file():
        digest.update((root / "train.idx").read_bytes())
        digest.update(str((root / "train.rec").stat().st_size if (root / "train.rec").is_file() else -1).encode())
    for path in files:  # relative to root
        digest.update(f"{path.as_posix()}\t{(root / path).stat().st_size}\n".encode())
    return digest.hexdigest()[:16]
