"""Identities a training set shares with verification sets: every test image against every training class.

A class is the normalised mean of its images' flip embeddings (``class_means``), or a trained head's centres
(``read_head``, ``head_centres``); a test image's nearest class is found in blocks (``nearest_classes``). The
threshold is calibrated against what is compared (``calibrate``): a sample of training images, each one's best
similarity to a class other than its own, at the false-accept rate ``far`` per image, so that about ``far`` x
images test images of other identities match by chance whatever the number of classes. ``write_without`` writes
the training set without the matched classes (``utils.files.staged``). ``scripts/overlap.py`` is the command;
docs/overlap.md describes the method, the output and its limits.
"""
from __future__ import annotations

import csv
import io
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dataset import ImageFolderDataset, MXFaceDataset, build_dataset
from dataset.recordio import is_rec_folder, write_insightface_rec
from dataset.verification_set import load_bin
from eval.verification import embed
from partial_fc.checkpoint import load_head_rows
from utils.checkpoint import MANIFEST, find_latest, head_file, read_manifest
from utils.cli import BadData
from utils.files import atomic_write, load_tensors, path_problem, staged

# Similarities computed at once: a block of test images x classes holds at most this many (64 MiB of float32).
BLOCK_ELEMENTS = 1 << 24
CSV_COLUMNS = ("bin", "image", "pair", "class", "identity", "similarity")
CLASS_MAP = "class_map.csv"  # --drop of a rec: the renumbering, new id -> original id
# Training images the threshold is calibrated on: this many / far (at most all), so that about this many of them
# lie above it; drawn with a fixed seed.
CALIBRATION_ABOVE = 10
CALIBRATION_SEED = 0

TrainingSet = MXFaceDataset | ImageFolderDataset
Progress = Callable[[int], None] | None


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` divided by their L2 norm (rows of zeros stay zero)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def embed_faces(images: torch.Tensor, backbone: nn.Module, batch_size: int, progress: Progress = None
                ) -> torch.Tensor:
    """(N, D) float32 unit rows: the flip embeddings (``eval.verification.embed``) of uint8 ``images``."""
    return unit_rows(torch.from_numpy(embed(images, backbone, batch_size, flip=True, progress=progress))).float()


def embed_bin(path: Path, backbone: nn.Module, batch_size: int, progress: Progress = None) -> torch.Tensor:
    """(2P, D) unit rows: every image of the verification set at ``path``; ``BadData`` for one without pairs."""
    images, issame = load_bin(path)
    if not issame:
        raise BadData(f"{path}: no pairs")
    return embed_faces(images, backbone, batch_size, progress)


def open_training_set(path: Path) -> TrainingSet:
    """The training set ``--rec`` names, as the trainer reads it; a damaged rec is ``BadData``."""
    if (problem := path_problem(path, folder=True)) is not None:
        raise FileNotFoundError(f"--rec {path}: {'no such folder' if problem == 'not found' else problem}")
    is_rec = is_rec_folder(path)
    try:
        data = build_dataset(str(path))
    except ValueError as exc:
        if is_rec:  # the folder is a rec, and the rec is damaged
            raise BadData(str(exc)) from None
        raise
    assert isinstance(data, (MXFaceDataset, ImageFolderDataset)), f"build_dataset({path}) gave {type(data)}"
    return data


class _Batches(Dataset):
    """Batch ``i`` of the images ``indices`` of a training set: ``(uint8 (B, 3, H, W), int64 labels (B,))``, one
    ``read_batch`` call (one decoder call) per batch, in a loader worker; or, for a batch that cannot be read, the
    error's message (a worker's exception would reach the main process wrapped in its traceback)."""

    def __init__(self, data: TrainingSet, indices: np.ndarray, batch_size: int):
        self.data, self.indices, self.batch_size = data, indices, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | str:
        indices = self.indices[i * self.batch_size:(i + 1) * self.batch_size].tolist()
        try:
            return self.data.read_batch(indices, [False] * len(indices))
        except ValueError as exc:  # RecordIOError, an image that does not decode, a label out of range
            return str(exc)


def _embedded_batches(data: TrainingSet, indices: np.ndarray, backbone: nn.Module, batch_size: int, workers: int,
                      progress: Progress) -> Iterator[tuple[torch.Tensor, torch.Tensor, np.ndarray]]:
    """``(unit embeddings (B, D), labels (B,), image indices (B,))`` of the images ``indices``, batch by batch;
    ``BadData`` naming the file for a batch that cannot be read."""
    loader = DataLoader(_Batches(data, indices, batch_size), batch_size=None, num_workers=workers)
    for i, batch in enumerate(loader):
        if isinstance(batch, str):
            raise BadData(batch)
        images, labels = batch  # (B, 3, H, W) uint8, (B,) int64
        yield embed_faces(images, backbone, batch_size, progress), labels, indices[i * batch_size:][:len(labels)]


@dataclass
class Sample:
    """Training images the threshold is calibrated on: their unit embeddings and classes."""

    embeddings: torch.Tensor  # (S, D) float32
    labels: torch.Tensor  # (S,) int64


def calibration_indices(images: int, far: float) -> np.ndarray:
    """The sorted indices of the training images ``calibrate`` uses: ``CALIBRATION_ABOVE / far`` of the
    ``images`` (all when they are fewer), drawn with a fixed seed."""
    size = min(images, math.ceil(CALIBRATION_ABOVE / far))
    return np.sort(np.random.default_rng(CALIBRATION_SEED).choice(images, size=size, replace=False))


def embed_training_images(data: TrainingSet, indices: np.ndarray, backbone: nn.Module, batch_size: int,
                          workers: int, progress: Progress = None) -> Sample:
    """The training images ``indices`` embedded (when the class centres come from a head, not from the images)."""
    parts = list(_embedded_batches(data, indices, backbone, batch_size, workers, progress))
    return Sample(torch.cat([e for e, _, _ in parts]), torch.cat([lb for _, lb, _ in parts]))


@dataclass
class ClassMeans:
    """The training classes as unit vectors, and the label of every training image (for --drop)."""

    centres: torch.Tensor  # (C_valid · K, D) float32, unit rows; class ids[i]'s K sub-centres are rows iK..iK+K-1
    ids: torch.Tensor  # (C_valid,) int64, ascending: the class id of each group of K rows
    sub_centres: int  # K
    labels: np.ndarray | None  # (N,) int64, the class of every training image in index order; None: not read


def class_means(data: TrainingSet, backbone: nn.Module, batch_size: int, workers: int, sample: np.ndarray,
                progress: Progress = None) -> tuple[ClassMeans, Sample]:
    """Every class as the normalised mean of its images' unit flip embeddings, read batch by batch (the sums are
    one (C, D) float32 matrix; classes without images are left out), and the images ``sample`` kept on the way."""
    sums: torch.Tensor | None = None  # (C, D) float32
    counts = torch.zeros(data.num_classes, dtype=torch.int64)  # (C,)
    labels = np.empty(len(data), dtype=np.int64)  # (N,)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    read = 0
    for emb, batch_labels, at in _embedded_batches(data, np.arange(len(data)), backbone, batch_size, workers,
                                                    progress):
        if sums is None:
            sums = torch.zeros(data.num_classes, emb.shape[1])  # (C, D)
        sums.index_add_(0, batch_labels, emb)
        counts += torch.bincount(batch_labels, minlength=data.num_classes)
        labels[at] = batch_labels.numpy()
        keep = torch.from_numpy(np.isin(at, sample))  # (B,) bool
        kept.append((emb[keep], batch_labels[keep]))
        read += len(at)
    assert sums is not None and read == len(data), f"read {read} of {len(data)} training images"
    ids = torch.nonzero(counts).flatten()  # (C_valid,)
    return (ClassMeans(unit_rows(sums[ids]), ids, 1, labels),
            Sample(torch.cat([e for e, _ in kept]), torch.cat([lb for _, lb in kept])))


def checkpoint_folder(path: Path) -> Path:
    """The step checkpoint ``--head`` names: ``path`` itself when it holds a manifest, else the newest complete
    one of a run's output folder."""
    if (path / MANIFEST).is_file():
        return path
    latest = find_latest(path)
    if latest is None:
        raise ValueError(f"--head {path}: neither a step checkpoint folder (no {MANIFEST}) nor a run's output "
                         f"folder holding a complete one under checkpoints/")
    return latest


def read_head(path: Path, data: TrainingSet) -> torch.Tensor:
    """(C, K·D) float32: the rows of every class of the trained head in the checkpoint ``path``, from all ranks'
    shards (written on any world size); ``ValueError`` for a head of another number of classes."""
    if (problem := path_problem(path, folder=True)) is not None:
        raise FileNotFoundError(f"--head {path}: {'no such folder' if problem == 'not found' else problem}")
    ckpt = checkpoint_folder(path)
    read_manifest(ckpt)
    shard = load_tensors(ckpt / head_file(0), mmap=True)
    saved = shard.get("num_classes") if isinstance(shard, dict) else None
    if saved != data.num_classes:
        raise ValueError(f"--head {ckpt}: the head has {saved} classes, the training set {data.root} has "
                         f"{data.num_classes}: a head trained on other data")
    return load_head_rows(ckpt, 0, data.num_classes)["weight"].float()  # (C, K·D)


def head_centres(weight: torch.Tensor, embedding_size: int, where: Path) -> ClassMeans:
    """The trained class centres ``weight`` (C, K·D) as unit rows, K = its width / ``embedding_size``."""
    if weight.shape[1] % embedding_size:
        raise ValueError(f"--head {where}: the head's rows are {weight.shape[1]} wide, the model's embeddings "
                         f"{embedding_size}: a head of another network")
    sub_centres = weight.shape[1] // embedding_size
    centres = unit_rows(weight.reshape(-1, embedding_size))  # (C·K, D): a class's K sub-centres side by side
    return ClassMeans(centres, torch.arange(weight.shape[0]), sub_centres, None)


def nearest_classes(queries: torch.Tensor, centres: torch.Tensor, sub_centres: int = 1,
                    block_elements: int = BLOCK_ELEMENTS, exclude: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(similarity (T,), index (T,))`` of the nearest class of each unit row of ``queries`` (T, D) among the
    unit rows of ``centres`` (C·K, D), a class being K consecutive rows scored by its nearest one; ``exclude``
    (T,): a class index each row is not compared with (its own class), or None.

    The (T, C·K) similarities are never held at once: blocks of test rows x classes of at most
    ``block_elements`` similarities, as many rows as fit against all classes, and the classes split too (a
    running maximum) when one row does not fit. Ties go to the lowest class index, as a dense argmax."""
    num_classes = centres.shape[0] // sub_centres
    assert num_classes * sub_centres == centres.shape[0], f"{centres.shape[0]} rows for {sub_centres} sub-centres"
    class_block = max(1, min(num_classes, block_elements // sub_centres))
    row_block = max(1, block_elements // (class_block * sub_centres))
    best = torch.empty(queries.shape[0], dtype=centres.dtype, device=centres.device)  # (T,)
    index = torch.empty(queries.shape[0], dtype=torch.int64, device=centres.device)  # (T,)
    for r0 in range(0, queries.shape[0], row_block):
        q = queries[r0:r0 + row_block].to(centres.device)  # (R, D)
        top = torch.full((q.shape[0],), -math.inf, dtype=centres.dtype, device=centres.device)  # (R,)
        arg = torch.zeros(q.shape[0], dtype=torch.int64, device=centres.device)  # (R,)
        for c0 in range(0, num_classes, class_block):
            block = centres[c0 * sub_centres:(c0 + class_block) * sub_centres]  # (B·K, D)
            sim = (q @ block.T).view(q.shape[0], -1, sub_centres).amax(dim=2)  # (R, B)
            if exclude is not None:
                own = exclude[r0:r0 + q.shape[0]].to(centres.device) - c0  # (R,) column of each row's own class
                rows = torch.nonzero((own >= 0) & (own < sim.shape[1])).flatten()
                sim[rows, own[rows]] = -math.inf
            value, at = sim.max(dim=1)  # (R,), (R,)
            better = value > top  # strict: an equal value in a later block keeps the earlier class
            top = torch.where(better, value, top)
            arg = torch.where(better, at + c0, arg)
        best[r0:r0 + q.shape[0]], index[r0:r0 + q.shape[0]] = top, arg
    return best, index


@dataclass(frozen=True)
class Threshold:
    """The similarity above which a test image matches its nearest class, and how it was calibrated."""

    value: float
    images: int  # training images calibrated on
    above: int  # how many of them are above it (floor(far · images))

    @property
    def rate(self) -> float:
        """The FAR per test image the threshold resolves: ``above / images``, or ``1 / images`` when none is."""
        return max(self.above, 1) / self.images

    def describe(self, far: float) -> str:
        what = f"{self.images} training images' best similarity to a class other than their own"
        if self.images * far < 1:
            return (f"threshold {self.value:.4f}: the largest of {what} (FAR resolution 1/{self.images} = "
                    f"{1 / self.images:.2g}: FAR {far:g} needs {math.ceil(1 / far)} training images)")
        return f"threshold {self.value:.4f}: {what}, at FAR {far:g} per image ({self.above} above)"


def calibrate(sample: Sample, classes: ClassMeans, far: float, where: Path,
              block_elements: int = BLOCK_ELEMENTS) -> Threshold:
    """The threshold at which a fraction of at most ``far`` of ``sample``'s images match a class other than
    their own: the ``floor(far · S)``-th largest (from 0) of their S best similarities to the other classes, what
    a test image of an identity outside the training set is compared with. ``BadData`` naming the training set
    ``where`` when it has one class with images (no other to calibrate against)."""
    if classes.ids.numel() < 2:
        raise BadData(f"{where}: {classes.ids.numel()} class with images; the threshold is calibrated on training "
                      f"images against the other classes")
    own = torch.searchsorted(classes.ids, sample.labels)  # (S,) each image's class among the rows of classes
    assert torch.equal(classes.ids[own], sample.labels), "a calibration image's class has no centre"
    best, _ = nearest_classes(sample.embeddings, classes.centres, classes.sub_centres, block_elements, exclude=own)
    best = best.cpu()  # (S,)
    value = float(torch.sort(best, descending=True).values[math.floor(far * best.numel())])
    return Threshold(value, int(best.numel()), int((best > value).sum()))


@dataclass(frozen=True)
class Match:
    """A listed test image: its set, index, nearest class and similarity."""

    bin: Path
    image: int
    class_id: int
    similarity: float


def matches(path: Path, embeddings: torch.Tensor, classes: ClassMeans, threshold: Threshold) -> list[Match]:
    """The images of the set ``path`` (unit ``embeddings`` (2P, D)) whose nearest class is above ``threshold``."""
    sim, at = nearest_classes(embeddings, classes.centres, classes.sub_centres)  # (2P,), (2P,)
    sim, nearest = sim.cpu(), classes.ids[at.cpu()]  # (2P,), (2P,) class ids
    listed = torch.nonzero(sim > threshold.value).flatten().tolist()
    return [Match(path, i, int(nearest[i]), float(sim[i])) for i in listed]


def matches_csv(found: list[Match], data: TrainingSet) -> str:
    """The CSV of ``found``: ``CSV_COLUMNS``, the identity folder of the class for an image-folder training set."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    names = data.classes if isinstance(data, ImageFolderDataset) else None
    for m in found:
        writer.writerow([str(m.bin), m.image, m.image // 2, m.class_id, names[m.class_id] if names else "",
                         f"{m.similarity:.6f}"])
    return text.getvalue()


def rec_labels(data: MXFaceDataset, progress: Progress = None) -> np.ndarray:
    """(N,) the class of every record of ``data`` in index order (one read of every record)."""
    labels = np.empty(len(data), dtype=np.int64)
    for i in range(len(data)):
        try:
            labels[i] = data.raw(i)[1]
        except ValueError as exc:
            raise BadData(str(exc)) from None
        if progress is not None:
            progress(1)
    return labels


def write_without(data: TrainingSet, dropped: set[int], labels: np.ndarray | None, out: Path,
                  progress: Progress = None) -> tuple[int, int]:
    """Write the training set without the classes ``dropped`` into the new folder ``out`` (staged beside it and
    renamed: whole or absent), in its layout; ``(classes kept, images kept)``. A rec's kept classes are
    renumbered ``0..N-1`` in their order, with ``CLASS_MAP``; ``labels``: the rec's (``rec_labels`` when None)."""
    kept = [c for c in range(data.num_classes) if c not in dropped]
    if not kept:
        raise ValueError(f"--drop {out}: every one of the {data.num_classes} classes matched; nothing to write")
    with staged(out) as staging:
        if isinstance(data, ImageFolderDataset):
            for name in (data.classes[c] for c in kept):
                shutil.copytree(data.root / name, staging / name)
            images = sum(1 for _, label in data.samples if label not in dropped)
        else:
            labels = rec_labels(data) if labels is None else labels
            new_id = np.full(data.num_classes, -1, dtype=np.int64)
            new_id[kept] = np.arange(len(kept))
            order = np.argsort(labels, kind="stable")  # grouped by class, index order within a class
            order = order[new_id[labels[order]] >= 0]

            def items() -> Iterator[tuple[int, bytes]]:
                for i in order.tolist():
                    try:
                        image = data.raw(i)[0]
                    except ValueError as exc:
                        raise BadData(str(exc)) from None
                    if progress is not None:
                        progress(1)
                    yield int(new_id[labels[i]]), image

            images = write_insightface_rec(staging, items(), len(kept), data.image_size)
            table = "class,original_class\n" + "".join(f"{new},{old}\n" for new, old in enumerate(kept))
            atomic_write(staging / CLASS_MAP, lambda f: f.write(table.encode()))
        if out.exists():
            raise ValueError(f"--drop {out} appeared while it was being written; the copy is not moved there")
    return len(kept), images


def write_csv(text: str, out: Path) -> None:
    """``text`` written to ``out`` atomically (its folder made)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda f: f.write(text.encode()))

