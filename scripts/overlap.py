"""Find the identities a training set shares with verification sets, and write the training set without them.

    python scripts/overlap.py --weights work_dirs/ms1mv3_r50 --rec /data/ms1m-retinaface-t1 \\
        --bin /data/ms1m-retinaface-t1/lfw.bin --bin /data/ms1m-retinaface-t1/cfp_fp.bin > overlap.csv
    python scripts/overlap.py --weights work_dirs/ms1mv3_r50 --rec /data/ms1m-retinaface-t1 \\
        --bin lfw.bin --head work_dirs/ms1mv3_r50/checkpoints/step_000181000      # the trained class centres
    python scripts/overlap.py --weights work_dirs/ms1mv3_r50 --rec faces/ --bin lfw.bin --drop faces_clean/

A published verification number means little when the test identities were trained on (insightface #331, #24:
identities of MS1M in LFW, CFP and AgeDB). This tool embeds every test image and every training class, and
lists the test images whose nearest training class is closer than all but a fraction ``--far`` (1e-4) of that
test set's different-identity pairs:

- the model: the options of every evaluation tool (``eval.model_source``); an image's embedding is the sum of
  the embeddings of the image and of its mirror image, L2-normalised (the verification protocol's flip);
- a training class (``--rec``: a RecordIO folder or a folder of identity folders, as the trainer reads them):
  the mean of its images' normalised embeddings, or, with ``--head``, the class centres of the trained head
  (a step checkpoint folder, or a run's output folder for its newest one; read on any world size; with
  sub-centres a class's similarity is that of its nearest sub-centre, as the head scores it). Classes without
  an image have no mean and are never nearest;
- each test set (``--bin``, repeatable) calibrates its own threshold on its own pairs: the cosine similarity
  of its impostor (different-identity) pairs at FAR ``--far``, i.e. the ``floor(far * n) + 1``-th largest of
  the ``n`` impostor similarities, so that a fraction of at most ``far`` is above it. With fewer than
  ``1 / far`` impostor pairs that is their largest similarity, and the FAR the set can resolve, ``1 / n``, is
  printed with it;
- a test image is listed when the cosine similarity to its nearest class is above its set's threshold.

stdout is the CSV (``--csv FILE`` writes it to a file instead), one row per listed image:
``bin,image,pair,class,identity,similarity`` (the ``.bin`` as given, the image's index in it, its pair
``image // 2``, the nearest class id, that class's identity folder for an image-folder training set (empty for a
rec), the cosine similarity). stderr has the progress bars, each set's threshold and a one-line summary with
the matches to expect by chance, images x classes x FAR (docs/overlap.md says why they can be many).

``--drop OUT`` writes a copy of the training set without the matched classes, in its layout, into a new
folder OUT (staged beside it and renamed, so OUT is complete or absent): a rec becomes an insightface-layout
rec whose kept classes are renumbered ``0..N-1`` in their order, with ``OUT/class_map.csv``
(``class,original_class``); an image folder becomes an image folder holding copies of the other identity
folders (their names are their identities; the trainer numbers them in sorted order).

Memory: the training set is read batch by batch (``--workers`` decoding processes) and its class means are one
(classes, D) float32 matrix (100k classes x 512: 200 MB); the similarities are computed in blocks of at most
``BLOCK_ELEMENTS`` (2^24, 64 MiB of float32): as many test images as fit against all classes (167 for 100k
classes), the classes too split into blocks with a running maximum when one row of them would not fit.

Exit status: 0 done (whether or not anything matched); 1 bad data, one line naming the file: a ``.bin`` that
is truncated, not a verification file, holds an image that does not decode, refers to code or has no impostor
pair, a damaged rec, a training image that does not decode; 2 a usage or configuration error, one line: bad
options, a missing file, no ``--network`` and no ``model.json``, weights that do not fit the network, a
``--head`` of another training set or network, a ``--drop`` folder that exists or would hold no class, an
output that cannot be written; 130 / 143 after Ctrl-C / SIGTERM (no ``--drop`` folder left behind).
"""
from __future__ import annotations

import argparse
import csv
import io
import math
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from tqdm import tqdm  # noqa: E402

from dataset import ImageFolderDataset, MXFaceDataset, build_dataset  # noqa: E402
from dataset.recordio import write_insightface_rec  # noqa: E402
from dataset.verification_set import BadBinError, RefusedGlobal, load_bin  # noqa: E402
from eval.model_options import add_model_options, backbone_from_options, check_model_options  # noqa: E402
from eval.model_source import device_of  # noqa: E402
from eval.verification import embed  # noqa: E402
from partial_fc.checkpoint import load_head_rows  # noqa: E402
from utils.checkpoint import MANIFEST, find_latest, head_file, read_manifest  # noqa: E402
from utils.files import atomic_write, fsync_dir, load_tensors, path_problem, unopenable_files  # noqa: E402
from utils.cli import print_error  # noqa: E402

TOOL = "overlap"
# Similarities computed at once: a block of test images x classes holds at most this many (64 MiB of float32).
BLOCK_ELEMENTS = 1 << 24
CSV_COLUMNS = ("bin", "image", "pair", "class", "identity", "similarity")
CLASS_MAP = "class_map.csv"  # --drop of a rec: the renumbering, new id -> original id

TrainingSet = MXFaceDataset | ImageFolderDataset


class BadData(ValueError):
    """Data that cannot be used (a damaged rec, an image that does not decode, a set without impostor pairs);
    the message names the file."""


# ------------------------------------------------------------------------------------------------ options

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="overlap.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, precision=True)
    p.add_argument("--rec", type=Path, required=True, metavar="TRAIN_DIR",
                   help="the training set: a folder with train.rec/train.idx, or a folder of identity folders")
    p.add_argument("--bin", type=Path, action="append", required=True, metavar="TEST.bin", dest="bins",
                   help="a verification set (repeat for several); each calibrates its own threshold")
    p.add_argument("--head", type=Path, metavar="CHECKPOINT",
                   help="compare with the trained class centres of this step checkpoint folder (or of the newest "
                        "in a run's output folder) instead of the class means of the training images")
    p.add_argument("--drop", type=Path, metavar="OUT",
                   help="write the training set without the matched classes into this new folder")
    p.add_argument("--csv", type=Path, metavar="FILE", help="write the CSV here instead of to stdout")
    p.add_argument("--far", type=float, default=1e-4,
                   help="false-accept rate of the threshold on each set's impostor pairs (default 1e-4)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes decoding the training images (0: in this process); default min(4, CPUs)")
    args = p.parse_args(argv)
    check_model_options(p, args)
    if not 0.0 < args.far < 1.0:
        p.error(f"--far must be in (0, 1), got {args.far}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.workers < 0:
        p.error(f"--workers must be >= 0, got {args.workers}")
    seen = set()
    for path in args.bins:
        if path.resolve() in seen:
            p.error(f"--bin {path} is given twice")
        seen.add(path.resolve())
    if args.drop is not None and args.drop.exists():
        p.error(f"--drop {args.drop} exists; --drop writes a new folder (remove it, or name another)")
    if args.drop is not None and args.drop.resolve().is_relative_to(args.rec.resolve()):
        p.error(f"--drop {args.drop} is inside the training set {args.rec}; name a folder outside it")
    return args


# ------------------------------------------------------------------------------------------------ embeddings

def _normalised(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` divided by their L2 norm (rows of zeros stay zero)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


@torch.no_grad()
def flip_embeddings(images: torch.Tensor, backbone: torch.nn.Module, batch_size: int, bar: tqdm) -> torch.Tensor:
    """(N, D) float32 L2-normalised embeddings of uint8 ``images`` (N, 3, H, W): the embedding of each image
    plus that of its mirror image, as the verification protocol (``eval.verification.test``) computes them."""
    summed = embed(images, backbone, batch_size, flip=True, progress=bar.update)  # (N, D) float64
    return _normalised(torch.from_numpy(summed)).float()


class _Batches(Dataset):
    """Batch ``i`` of a training set, in index order: ``(uint8 (B, 3, H, W), int64 labels (B,))``, one
    ``read_batch`` call (one decoder call) per batch, in a loader worker; or, for a batch that cannot be read,
    the error's message (a worker's exception would reach the main process wrapped in its traceback)."""

    def __init__(self, data: TrainingSet, batch_size: int):
        self.data, self.batch_size = data, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.data) / self.batch_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | str:
        indices = list(range(i * self.batch_size, min((i + 1) * self.batch_size, len(self.data))))
        try:
            return self.data.read_batch(indices, [False] * len(indices))
        except ValueError as exc:  # RecordIOError, an image that does not decode, a label out of range
            return str(exc)


@dataclass
class ClassMeans:
    """The training classes as unit vectors, and the label of every training image (for --drop)."""

    centres: torch.Tensor  # (C_valid · K, D) float32, unit rows; class ids[i]'s K sub-centres are rows iK..iK+K-1
    ids: torch.Tensor  # (C_valid,) int64: the class id of each group of K rows
    sub_centres: int  # K
    labels: np.ndarray | None  # (N,) int64, the class of every training image in index order; None: not read


@torch.no_grad()
def class_means(data: TrainingSet, backbone: torch.nn.Module, batch_size: int, workers: int) -> ClassMeans:
    """Every class as the normalised mean of its images' normalised flip embeddings, read batch by batch; the
    sums are one (C, D) float32 matrix. Classes without images are left out."""
    sums: torch.Tensor | None = None  # (C, D) float32
    counts = torch.zeros(data.num_classes, dtype=torch.int64)  # (C,)
    labels = np.empty(len(data), dtype=np.int64)  # (N,)
    loader = DataLoader(_Batches(data, batch_size), batch_size=None, num_workers=workers)
    start = 0
    with tqdm(total=2 * len(data), desc="training set", unit="img", file=sys.stderr, disable=None) as bar:
        for batch in loader:
            if isinstance(batch, str):
                raise BadData(batch)
            images, batch_labels = batch  # (B, 3, H, W) uint8, (B,) int64
            emb = flip_embeddings(images, backbone, batch_size, bar)  # (B, D)
            if sums is None:
                sums = torch.zeros(data.num_classes, emb.shape[1])  # (C, D)
            sums.index_add_(0, batch_labels, emb)
            counts += torch.bincount(batch_labels, minlength=data.num_classes)
            labels[start:start + len(batch_labels)] = batch_labels.numpy()
            start += len(batch_labels)
    assert sums is not None and start == len(data), f"read {start} of {len(data)} training images"
    ids = torch.nonzero(counts).flatten()  # (C_valid,)
    return ClassMeans(_normalised(sums[ids]), ids, 1, labels)


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
    centres = _normalised(weight.reshape(-1, embedding_size))  # (C·K, D): a class's K sub-centres side by side
    return ClassMeans(centres, torch.arange(weight.shape[0]), sub_centres, None)


# ------------------------------------------------------------------------------------------------ matching

def nearest_classes(queries: torch.Tensor, centres: torch.Tensor, sub_centres: int = 1,
                    block_elements: int = BLOCK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(similarity (T,), index (T,))`` of the nearest class of each unit row of ``queries`` (T, D) among the
    unit rows of ``centres`` (C·K, D), a class being K consecutive rows scored by its nearest one.

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
            value, at = sim.max(dim=1)  # (R,), (R,)
            better = value > top  # strict: an equal value in a later block keeps the earlier class
            top = torch.where(better, value, top)
            arg = torch.where(better, at + c0, arg)
        best[r0:r0 + q.shape[0]], index[r0:r0 + q.shape[0]] = top, arg
    return best, index


@dataclass(frozen=True)
class Threshold:
    """A test set's threshold on its impostor pairs, and how it was chosen."""

    value: float
    impostors: int  # impostor pairs in the set
    above: int  # how many of them are above the threshold (floor(far · impostors))

    def describe(self, far: float) -> str:
        if self.impostors * far < 1:
            return (f"threshold {self.value:.4f}: the largest similarity of its {self.impostors} impostor pairs "
                    f"(FAR resolution 1/{self.impostors} = {1 / self.impostors:.2g}: FAR {far:g} needs "
                    f"{math.ceil(1 / far)} impostor pairs)")
        return (f"threshold {self.value:.4f}: the similarity at FAR {far:g} of its {self.impostors} impostor pairs "
                f"({self.above} above)")


def impostor_threshold(embeddings: torch.Tensor, issame: Sequence[bool], far: float, where: Path) -> Threshold:
    """The cosine similarity above which a fraction of at most ``far`` of the set's impostor pairs lie: the
    ``floor(far · n) + 1``-th largest of the ``n`` impostor similarities (the largest when ``far · n < 1``).
    ``embeddings`` (2P, D) unit rows, pair i = rows (2i, 2i+1)."""
    different = ~torch.tensor(issame, dtype=torch.bool)  # (P,)
    sims = (embeddings[0::2] * embeddings[1::2]).sum(dim=1)[different]  # (n,)
    if sims.numel() == 0:
        raise BadData(f"{where}: no impostor (different-identity) pair to calibrate the threshold on "
                      f"({len(issame)} pairs, all of the same identity)")
    above = int(math.floor(far * sims.numel()))
    value = float(torch.sort(sims, descending=True).values[above])
    return Threshold(value, int(sims.numel()), int((sims > value).sum()))


# ------------------------------------------------------------------------------------------------ the run

@dataclass(frozen=True)
class Match:
    """A listed test image: its set, index, nearest class and similarity."""

    bin: Path
    image: int
    class_id: int
    similarity: float


def open_training_set(path: Path) -> TrainingSet:
    """The training set ``--rec`` names, as the trainer reads it; a damaged rec is ``BadData``."""
    if (problem := path_problem(path, folder=True)) is not None:
        raise FileNotFoundError(f"--rec {path}: {'no such folder' if problem == 'not found' else problem}")
    is_rec = (path / "train.rec").exists() or (path / "train.idx").exists()
    try:
        data = build_dataset(str(path))
    except FileNotFoundError:
        raise
    except ValueError as exc:
        if is_rec:  # the folder is a rec, and the rec is damaged
            raise BadData(str(exc)) from None
        raise
    assert isinstance(data, (MXFaceDataset, ImageFolderDataset)), f"build_dataset({path}) gave {type(data)}"
    return data


def write_csv(matches: list[Match], data: TrainingSet, out: Path | None) -> None:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    names = data.classes if isinstance(data, ImageFolderDataset) else None
    for m in matches:
        writer.writerow([str(m.bin), m.image, m.image // 2, m.class_id, names[m.class_id] if names else "",
                         f"{m.similarity:.6f}"])
    if out is None:
        sys.stdout.write(text.getvalue())
    else:
        content = text.getvalue().encode()
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda f: f.write(content))


def rec_labels(data: MXFaceDataset) -> np.ndarray:
    """(N,) the class of every record of ``data`` in index order (one read of every record)."""
    labels = np.empty(len(data), dtype=np.int64)
    for i in tqdm(range(len(data)), desc="reading labels", unit="img", file=sys.stderr, disable=None):
        try:
            labels[i] = data.raw(i)[1]
        except ValueError as exc:
            raise BadData(str(exc)) from None
    return labels


def write_without(data: TrainingSet, dropped: set[int], labels: np.ndarray | None, out: Path) -> tuple[int, int]:
    """Write the training set without the classes ``dropped`` into the new folder ``out``, staged in a
    temporary folder beside it and renamed; ``(classes kept, images kept)``."""
    kept = [c for c in range(data.num_classes) if c not in dropped]
    if not kept:
        raise ValueError(f"--drop {out}: every one of the {data.num_classes} classes matched; nothing to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", suffix=".tmp", dir=out.parent))
    try:
        if isinstance(data, ImageFolderDataset):
            for name in (data.classes[c] for c in kept):
                shutil.copytree(data.root / name, staging / name)
            images = sum(1 for _, label in data.samples if label not in dropped)
        else:
            if labels is None:
                labels = rec_labels(data)
            new_id = np.full(data.num_classes, -1, dtype=np.int64)
            new_id[kept] = np.arange(len(kept))
            order = np.argsort(labels, kind="stable")  # grouped by class, index order within a class
            order = order[new_id[labels[order]] >= 0]

            def items():
                for i in tqdm(order.tolist(), desc="writing", unit="img", file=sys.stderr, disable=None):
                    try:
                        image = data.raw(i)[0]
                    except ValueError as exc:
                        raise BadData(str(exc)) from None
                    yield int(new_id[labels[i]]), image

            images = write_insightface_rec(staging, items(), len(kept), data.image_size)
            table = "class,original_class\n" + "".join(f"{new},{old}\n" for new, old in enumerate(kept))
            atomic_write(staging / CLASS_MAP, lambda f: f.write(table.encode()))
        if out.exists():
            raise ValueError(f"--drop {out} appeared while it was being written; the copy is not moved there")
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return len(kept), images


def run(args: argparse.Namespace) -> list[Match]:
    """Embed, match, print the thresholds and the summary, write the CSV and --drop; the listed images."""
    missing, unusable = unopenable_files(args.bins)
    if missing or unusable:
        raise FileNotFoundError("; ".join(
            ([f"verification file(s) not found: {', '.join(map(str, missing))}"] if missing else [])
            + [f"verification file {why}: {p}" for p, why in unusable]))
    if args.head is not None and (problem := path_problem(args.head, folder=True)) is not None:
        raise FileNotFoundError(f"--head {args.head}: {'no such folder' if problem == 'not found' else problem}")
    data = open_training_set(args.rec)
    head = read_head(args.head, data) if args.head is not None else None  # a head of other data stops here
    backbone = backbone_from_options(args)

    tests: list[tuple[Path, torch.Tensor, Threshold]] = []
    for path in args.bins:
        images, issame = load_bin(path)
        if not issame:
            raise BadData(f"{path}: no pairs")
        with tqdm(total=2 * images.shape[0], desc=path.name, unit="img", file=sys.stderr, disable=None) as bar:
            emb = flip_embeddings(images, backbone, args.batch_size, bar)  # (2P, D)
        del images
        tests.append((path, emb, impostor_threshold(emb, issame, args.far, path)))

    device = device_of(backbone)
    if head is not None:
        classes = head_centres(head, tests[0][1].shape[1], args.head)
    else:
        classes = class_means(data, backbone, args.batch_size, args.workers)
    centres = classes.centres.to(device)  # (C·K, D)

    matches: list[Match] = []
    for path, emb, threshold in tests:
        sim, at = nearest_classes(emb, centres, classes.sub_centres)  # (2P,), (2P,)
        sim, nearest = sim.cpu(), classes.ids[at.cpu()]  # (2P,), (2P,) class ids
        listed = torch.nonzero(sim > threshold.value).flatten().tolist()
        matches += [Match(path, i, int(nearest[i]), float(sim[i])) for i in listed]
        print(f"{TOOL}: {path}: {emb.shape[0] // 2} pairs; {threshold.describe(args.far)}; {len(listed)} of "
              f"{emb.shape[0]} images above it", file=sys.stderr)
    write_csv(matches, data, args.csv)

    matched = {m.class_id for m in matches}
    total = sum(emb.shape[0] for _, emb, _ in tests)
    source = "trained centres" if args.head is not None else "class means"
    # If an impostor's similarity to a class behaves like that of an impostor pair, T images x C classes give
    # about T·C·FAR matches by chance: say so, a large training set makes it many.
    chance = sum(emb.shape[0] * max(threshold.above, 1) / threshold.impostors for _, emb, threshold in tests)
    print(f"{TOOL}: {len(matches)} of {total} test images in {len(tests)} set(s) match {len(matched)} of "
          f"{classes.ids.numel()} training classes ({source}) above their set's threshold; by chance about "
          f"{chance * classes.ids.numel():.3g} (images x classes x each set's FAR)", file=sys.stderr)
    if args.drop is not None:
        kept, images = write_without(data, matched, classes.labels, args.drop)
        extra = f", renumbered 0..{kept - 1} ({args.drop / CLASS_MAP})" if isinstance(data, MXFaceDataset) else ""
        print(f"{TOOL}: wrote {args.drop}: {kept} classes, {images} images, without the {len(matched)} matched "
              f"classes{extra}", file=sys.stderr)
    return matches


def _terminate(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a job scheduler, ``kill``) unwinds like Ctrl-C, so a --drop staging folder is removed."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (BadBinError, RefusedGlobal, BadData) as exc:
        print_error(TOOL, exc)
        return 1
    except (OSError, ValueError) as exc:
        print_error(TOOL, exc)
        return 2
    except KeyboardInterrupt:  # a --drop staging folder is already gone; a traceback would add nothing
        print(f"{TOOL}: interrupted" + (f"; {args.drop} not written" if args.drop is not None else ""),
              file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)  # only the CLI process: a caller of main() keeps its own
    sys.exit(main())
