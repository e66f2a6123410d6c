"""From your own photos to a training set: detect each face, align it to the ArcFace template, pack.

    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR                  # PHOTOS_DIR/<identity>/<photo>
    python scripts/prepare_faces.py photos.txt OUT_DIR                  # lines: path label
    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR --holdout 20     # + OUT_DIR/holdout.bin of pairs
    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR --landmarks points.csv   # no detection for those photos

Input: a folder with one folder per identity (photos in sub-folders of it belong to it too), or a list file of
``path label`` lines (the label is the last field; relative paths start from the list file's folder; blank
lines and ``#`` comments are skipped). Photos of any size in the formats Pillow reads (JPEG, PNG, WebP, BMP,
TIFF, GIF), read by ``alignment.read_photo``: EXIF orientation applied, every mode made RGB, 16-bit scaled.
``--landmarks`` names a CSV (``path,x1,y1,...,x5,y5``: left eye, right eye, nose, left and right mouth corners;
an optional header line) or JSON file (``{"path": [[x, y] x 5]}`` or ``[{"path": ..., "landmarks": ...}]``),
paths relative to the photo root: those photos are aligned at the given points without detection.

Each photo: decoded in ``--workers`` processes; faces found by MTCNN (``alignment.FaceDetector``, from the
optional facenet-pytorch package) in batches of ``--batch-size`` photos on ``--device``; faces below
``--min-score`` or ``--min-face-size`` (pixels of the photo, the box's shorter side) are not counted; no face
is skipped; several faces: ``--multi largest`` keeps the largest one nearest the centre, ``skip`` skips the
photo, ``all`` keeps every face. The kept faces are aligned (``alignment.align_face``: the 5-point similarity
onto the 112x112 ArcFace template, bilinear, black outside the photo) and encoded as JPEG quality 95.

OUT_DIR gets ``train.rec``, ``train.idx``, ``property`` (insightface layout; class ids follow the sorted
identities that kept a face, held-out ones left out), with ``--holdout N`` ``holdout.bin`` (pairs of N
identities, chosen with ``--seed``, none of them in train.rec: every same-identity pair, up to ``--pairs / 2``,
and as many different-identity pairs; train with ``val_targets=holdout``), ``report.csv`` (one row per photo;
with ``--multi all`` one per kept face), ``preview.png`` (a sample of the crops and the lowest-scoring ones,
captioned with their line in report.csv) and ``prepare_faces.json`` (written last: the input, the settings,
the summary). Every file is written in a staging folder and renamed into place; nothing in the input is
modified. An OUT_DIR holding these files from another input (or from another tool) is refused unless
``--overwrite``.

Work is saved in ``OUT_DIR/.prepare_faces-work`` every ``--chunk-size`` photos: an interrupted run (Ctrl-C, a
kill, a crash) continues where it stopped when started again with the same command, and its output is
byte-identical to that of an uninterrupted run. The same input and settings on the same device give the same
bytes. The folder is removed when the output is complete.

Exit status: 0 written (photos without a usable face are in the report, unreadable ones on stderr too); 1 no
face kept, a --holdout the photos cannot fill, or the face detector is not installed (one line saying how to
install it); 2 usage: bad options, a missing input, a malformed list or landmarks file, an OUT_DIR holding
another dataset or that cannot be written; 130 / 143 after Ctrl-C / SIGTERM (run again to continue).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import argparse  # noqa: E402
import csv  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from types import FrameType  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torchvision.io import encode_jpeg  # noqa: E402
from tqdm import tqdm  # noqa: E402

from alignment import (DetectorUnavailable, Face, FaceDetector, PhotoError, align_face, choose_faces,  # noqa: E402
                       read_photo)
from dataset.recordio import write_insightface_rec  # noqa: E402
from dataset.verification_set import save_bin  # noqa: E402
from utils.files import atomic_write, fsync_dir, load_tensors  # noqa: E402
from utils.cli import print_error  # noqa: E402

TOOL = "prepare_faces"
STAMP = "prepare_faces.json"
WORK = ".prepare_faces-work"
HOLDOUT = "holdout.bin"
OUTPUT_FILES = ("train.rec", "train.idx", "property", HOLDOUT, "report.csv", "preview.png", STAMP)
PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif")
REPORT_COLUMNS = ("path", "identity", "label", "status", "faces", "score", "box", "landmarks", "reason")
JPEG_QUALITY = 95
WORK_FORMAT = 1


class UsageError(ValueError):
    """A mistake in the command: exit status 2."""


class BadData(ValueError):
    """The photos cannot make what was asked (no face kept, a --holdout too large): exit status 1."""


@dataclass(frozen=True)
class Photo:
    """One input photo: the file to read, its name in the report, its identity."""

    path: Path
    name: str  # relative to the photo root (a folder) or as written in the list file
    identity: str


@dataclass(frozen=True)
class Settings:
    """Everything that decides a photo's result; the work folder is reused only under the same settings."""

    multi: str
    min_score: float
    min_face_size: float
    detect_size: int
    batch_size: int
    chunk_size: int
    device: str  # the device type: detection on a GPU may differ from the CPU in the last bits


# ---------------------------------------------------------------------------------------------- the input

def _note(message: str) -> None:
    """A line on stderr that does not break the progress bar."""
    tqdm.write(f"{TOOL}: {message}", file=sys.stderr)


def _is_photo(path: Path) -> bool:
    return path.suffix.lower() in PHOTO_SUFFIXES and not path.name.startswith(".")


def list_photo_folder(root: Path) -> list[Photo]:
    """Every photo under ``root/<identity>/`` (sub-folders included), by identity then path; other files are
    named on stderr and left out."""
    folders = sorted((d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")), key=lambda d: d.name)
    if not folders:
        raise UsageError(f"{root} holds no identity folders; expected {root}/<identity>/<photo> (or a list file "
                         f"of 'path label' lines)")
    loose = sorted(p.name for p in root.iterdir() if not p.is_dir() and not p.name.startswith("."))
    if loose:
        _note(f"{_count(len(loose), 'file', 'files')} directly in {root} ignored (photos go in a folder per identity): "
              f"{', '.join(loose[:3])}{' ...' if len(loose) > 3 else ''}")
    photos, ignored = [], []
    for folder in folders:
        try:
            files = sorted(p for p in folder.rglob("*") if not p.is_dir())
        except OSError as exc:
            _note(f"cannot list {folder}: {exc.strerror or exc}; its photos are left out")
            continue
        for path in files:
            name = path.relative_to(root).as_posix()
            if _is_photo(path):
                photos.append(Photo(path, name, folder.name))
            elif not path.name.startswith("."):
                ignored.append(name)
    if ignored:
        _note(f"{_count(len(ignored), 'file', 'files')} without a photo suffix ({' '.join(PHOTO_SUFFIXES)}) ignored: "
              f"{', '.join(ignored[:3])}{' ...' if len(ignored) > 3 else ''}")
    if not photos:
        raise UsageError(f"{root}: no photos in its {len(folders)} identity folders (suffixes "
                         f"{' '.join(PHOTO_SUFFIXES)})")
    return photos


def read_photo_list(list_file: Path) -> list[Photo]:
    """The photos of a ``path label`` list file, in its order (the label is the last field)."""
    try:
        text = list_file.read_text()
    except UnicodeDecodeError as exc:
        raise UsageError(f"{list_file}: not a text list of 'path label' lines ({exc})") from None
    photos = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.strip().rsplit(None, 1)
        if len(fields) != 2:
            raise UsageError(f"{list_file}:{lineno}: expected 'path label', got {line.strip()[:80]!r}")
        name, label = fields
        path = Path(name)
        photos.append(Photo(path if path.is_absolute() else list_file.parent / path, name, label))
    if not photos:
        raise UsageError(f"{list_file}: no 'path label' lines")
    return photos


def identity_order(identities: Sequence[str]) -> list[str]:
    """The identities sorted as class ids follow them: by number when every one is an integer, else by name."""
    unique = set(identities)
    if all(re.fullmatch(r"[0-9]+", i) for i in unique):
        return sorted(unique, key=lambda i: (int(i), i))
    return sorted(unique)


def sorted_photos(photos: list[Photo]) -> list[Photo]:
    """Grouped by identity (in ``identity_order``), then by name: the order of the report and the records."""
    rank = {identity: k for k, identity in enumerate(identity_order([p.identity for p in photos]))}
    return sorted(photos, key=lambda p: (rank[p.identity], p.name))


def _key(path: Path) -> str:
    return os.path.normpath(os.path.abspath(path))


def read_landmarks(path: Path, root: Path, photos: list[Photo]) -> dict[int, np.ndarray]:
    """{photo index: (5, 2) points} from a CSV or JSON landmarks file; relative paths start from ``root``."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise UsageError(f"--landmarks {path}: not a text file ({exc})") from None
    entries: list[tuple[str, Any, str]] = []  # (photo path, points, where in the file)
    if text.lstrip()[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--landmarks {path}: not valid JSON ({exc})") from None
        if isinstance(data, dict):
            entries = [(str(k), v, f"key {k!r}") for k, v in data.items()]
        elif isinstance(data, list) and all(isinstance(d, dict) and "path" in d and "landmarks" in d for d in data):
            entries = [(str(d["path"]), d["landmarks"], f"item {i}") for i, d in enumerate(data)]
        else:
            raise UsageError(f"--landmarks {path}: expected a JSON object {{path: [[x, y] x 5]}} or a list of "
                             f"{{\"path\": ..., \"landmarks\": [[x, y] x 5]}}")
    else:
        for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1):
            if not row or not "".join(row).strip():
                continue
            if len(row) != 11:
                raise UsageError(f"--landmarks {path}:{lineno}: {len(row)} fields; expected 11: path,x1,y1,...,x5,y5 "
                                 f"(left eye, right eye, nose, left and right mouth corners)")
            if not entries and lineno == 1 and not re.fullmatch(r"\s*[-+0-9.eE]+\s*", row[1]):
                continue  # a header line
            entries.append((row[0].strip(), row[1:], f"line {lineno}"))
    index = {_key(p.path): i for i, p in enumerate(photos)}
    points: dict[int, np.ndarray] = {}
    unknown = []
    for name, value, where in entries:
        try:
            array = np.asarray(value, dtype=np.float64).reshape(5, 2)
        except (TypeError, ValueError):
            raise UsageError(f"--landmarks {path} {where}: {str(value)[:80]}; expected 5 points (10 numbers)") from None
        if not np.isfinite(array).all():
            raise UsageError(f"--landmarks {path} {where}: points must be finite numbers; got {array.tolist()}")
        photo = Path(name)
        i = index.get(_key(photo if photo.is_absolute() else root / photo))
        if i is None:
            unknown.append(name)
        elif i in points:
            raise UsageError(f"--landmarks {path} {where}: {name} has landmarks twice")
        else:
            points[i] = array
    if unknown:
        _note(f"{_count(len(unknown), 'entry', 'entries')} of {path} name no photo of the input (ignored): "
              f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}")
    return points


# ------------------------------------------------------------------------------------------- one photo

def _numbers(values) -> str:
    return " ".join(f"{float(v):.1f}" for v in np.asarray(values).reshape(-1))


def _face_fields(face: Face | None) -> dict[str, Any]:
    if face is None:
        return {"score": None, "box": None, "points": None}
    return {"score": face.score, "box": [float(v) for v in face.box],
            "points": [float(v) for v in np.asarray(face.points).reshape(-1)]}


def decide(faces: list[Face], photo_size: tuple[int, int], settings: Settings
           ) -> tuple[str, list[Face], Face | None, int, str]:
    """``(status, faces to keep, face to show in the report, faces counted, reason)`` of one photo's detections
    (every face MTCNN returned, highest score first) under the policy of ``settings``."""
    counted = [f for f in faces if f.score >= settings.min_score and f.size >= settings.min_face_size]
    if not faces:
        return "no_face", [], None, 0, "no face found"
    if not counted:
        confident = [f for f in faces if f.score >= settings.min_score]
        if confident:
            face = max(confident, key=lambda f: f.size)
            return ("small_face", [], face, 0, f"the largest face is {face.size:.0f} px, below --min-face-size "
                    f"{settings.min_face_size:g}")
        return ("low_score", [], faces[0], 0, f"the best face scores {faces[0].score:.4f}, below --min-score "
                f"{settings.min_score:g}")
    below = len(faces) - len(counted)
    also = f"; {below} more below --min-score/--min-face-size" if below else ""
    chosen = choose_faces(counted, photo_size, settings.multi)
    if not chosen:
        return "several_faces", [], None, len(counted), f"{len(counted)} faces (--multi skip){also}"
    if len(counted) == 1:
        reason = also.removeprefix("; ")
    elif settings.multi == "largest":
        reason = f"the largest of {len(counted)} faces, nearest the centre{also}"
    else:
        reason = f"all {len(counted)} faces (--multi all){also}"
    return "kept", chosen, chosen[0], len(counted), reason


def _crop(image: torch.Tensor, points: np.ndarray) -> torch.Tensor:
    """The aligned face as JPEG bytes in a uint8 tensor (libjpeg's output is a function of the pixels)."""
    return encode_jpeg(align_face(image, points), quality=JPEG_QUALITY)


def process_batch(batch: list[tuple[int, torch.Tensor | str]], photos: list[Photo],
                  landmarks: dict[int, np.ndarray], detector: FaceDetector | None, settings: Settings
                  ) -> dict[int, dict]:
    """The results of a batch of decoded photos (a photo's error message in place of an unreadable one)."""
    results: dict[int, dict] = {}
    to_detect = []
    for index, image in batch:
        if isinstance(image, str):
            reason = image.removeprefix(f"{photos[index].path}: ")
            _note(f"unreadable {photos[index].name}: {reason}")
            results[index] = {"status": "unreadable", "faces": None, "reason": reason, "crops": [],
                              **_face_fields(None)}
        elif index in landmarks:
            points = landmarks[index]
            fields = {"score": None, "box": None, "points": [float(v) for v in points.reshape(-1)]}
            try:
                crops = [{"jpeg": _crop(image, points), **fields}]
                status, reason = "kept", "landmarks from --landmarks"
            except ValueError as exc:  # points that fit no similarity (all the same point)
                crops, status, reason = [], "bad_landmarks", str(exc)
            results[index] = {"status": status, "faces": None, "reason": reason, "crops": crops, **fields}
        else:
            to_detect.append((index, image))
    if to_detect:
        assert detector is not None, "photos to detect but no detector"
        for (index, image), faces in zip(to_detect, detector.detect([image for _, image in to_detect])):
            status, chosen, shown, counted, reason = decide(faces, tuple(image.shape[1:]), settings)
            crops = [{"jpeg": _crop(image, face.points), **_face_fields(face)} for face in chosen]
            results[index] = {"status": status, "faces": counted, "reason": reason, "crops": crops,
                              **_face_fields(shown)}
    return results


class _Decode(Dataset):
    """``(photo index, (3, H, W) uint8 tensor or the PhotoError message)``, decoded in a DataLoader worker."""

    def __init__(self, photos: list[Photo], indices: list[int]) -> None:
        self.paths, self.indices = [p.path for p in photos], indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | str]:
        index = self.indices[i]
        try:
            return index, read_photo(self.paths[index])
        except PhotoError as exc:
            return index, str(exc)


# ------------------------------------------------------------------------------------ the work folder

def fingerprint(photos: list[Photo]) -> str:
    """What identifies the input: every photo's name, identity, size and modification time."""
    digest = hashlib.sha256()
    for photo in photos:
        try:
            st = photo.path.stat()
            stat = f"{st.st_size}\t{st.st_mtime_ns}"
        except OSError:
            stat = "-"
        digest.update(f"{photo.name}\t{photo.identity}\t{stat}\n".encode())
    return digest.hexdigest()


class WorkFolder:
    """``OUT_DIR/.prepare_faces-work``: ``work.json`` (what the results are of) and one ``chunk-NNNNNN.pt`` per
    ``chunk_size`` photos, each written atomically, so a chunk on disk is complete."""

    def __init__(self, out: Path, stamp: dict) -> None:
        self.dir, self.stamp = out / WORK, stamp
        self.chunk_size, self.photos = stamp["settings"]["chunk_size"], stamp["photos"]

    def open(self) -> None:
        """Keep the results of the same work, or start over."""
        saved = _read_json(self.dir / "work.json")
        if saved != self.stamp:
            if self.dir.exists():
                if saved is not None:
                    _note(f"{self.dir} holds the work of other photos or settings; starting over")
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
            atomic_write(self.dir / "work.json", lambda f: f.write(_json_bytes(self.stamp)))
        if done := self.done_photos():
            _note(f"continuing: {done} of {self.photos} photos already done ({self.dir})")

    def chunks(self) -> range:
        return range(-(-self.photos // self.chunk_size))

    def photo_range(self, chunk: int) -> range:
        return range(chunk * self.chunk_size, min((chunk + 1) * self.chunk_size, self.photos))

    def _path(self, chunk: int) -> Path:
        return self.dir / f"chunk-{chunk:06d}.pt"

    def done_chunks(self) -> list[int]:
        return [c for c in self.chunks() if self._path(c).is_file()]

    def done_photos(self) -> int:
        return sum(len(self.photo_range(c)) for c in self.done_chunks())

    def save(self, chunk: int, results: list[dict]) -> None:
        atomic_write(self._path(chunk), lambda f: torch.save({"format": WORK_FORMAT, "results": results}, f))

    def load(self) -> list[dict]:
        results = []
        for chunk in self.chunks():
            saved = load_tensors(self._path(chunk))
            if saved.get("format") != WORK_FORMAT or len(saved["results"]) != len(self.photo_range(chunk)):
                raise ValueError(f"{self._path(chunk)}: not a chunk of this work; delete {self.dir} and run again")
            results.extend(saved["results"])
        return results


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_photos(photos: list[Photo], landmarks: dict[int, np.ndarray], work: WorkFolder, settings: Settings,
               workers: int, detector: FaceDetector | None) -> None:
    """Decode, detect and align every photo of the chunks not done yet, saving each chunk when complete."""
    done = set(work.done_chunks())
    pending = [i for c in work.chunks() if c not in done for i in work.photo_range(c)]
    if not pending:
        return
    loader = DataLoader(_Decode(photos, pending), batch_size=None, num_workers=workers)
    results: dict[int, dict] = {}
    batch: list[tuple[int, torch.Tensor | str]] = []
    with tqdm(total=len(photos), initial=len(photos) - len(pending), desc=TOOL, unit="photo", disable=None) as bar:
        for index, image in loader:
            batch.append((index, image))
            chunk = index // work.chunk_size
            chunk_end = index == work.photo_range(chunk)[-1]
            # Batches never cross a chunk: a continued run detects in the batches of an uninterrupted one.
            if len(batch) == settings.batch_size or chunk_end:
                results.update(process_batch(batch, photos, landmarks, detector, settings))
                bar.update(len(batch))
                batch = []
            if chunk_end:
                work.save(chunk, [results.pop(i) for i in work.photo_range(chunk)])


# ------------------------------------------------------------------------------------------- the output

def form_pairs(groups: Sequence[Sequence[int]], max_pairs: int, rng: np.random.Generator
               ) -> list[tuple[int, int, bool]]:
    """Verification pairs over ``groups`` (the items of each identity): up to ``max_pairs // 2`` same-identity
    pairs (all of them when they are fewer) and as many different-identity pairs, each pair once, alternating
    same and different (every fold of the protocol gets both); the choice depends only on ``rng``."""
    positives = [pair for group in groups for pair in itertools.combinations(sorted(group), 2)]
    sizes = [len(g) for g in groups]
    total_negative = (sum(sizes) ** 2 - sum(s * s for s in sizes)) // 2
    n = min(len(positives), max_pairs // 2, total_negative)
    positives = [positives[i] for i in sorted(rng.choice(len(positives), n, replace=False))]
    owner = {item: k for k, group in enumerate(groups) for item in group}
    items = sorted(owner)
    if total_negative <= 4 * n + 10_000:
        candidates = [(a, b) for a, b in itertools.combinations(items, 2) if owner[a] != owner[b]]
        negatives = [candidates[i] for i in sorted(rng.choice(len(candidates), n, replace=False))]
    else:  # too many to list: draw until n distinct ones (most draws are different identities)
        chosen: set[tuple[int, int]] = set()
        while len(chosen) < n:
            a, b = (items[i] for i in rng.integers(0, len(items), 2))
            if owner[a] != owner[b]:
                chosen.add((min(a, b), max(a, b)))
        negatives = sorted(chosen)
    pairs: list[tuple[int, int, bool]] = []
    for same, different in zip(positives, negatives):
        pairs += [(*same, True), (*different, False)]
    return pairs


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def report_rows(photos: list[Photo], results: list[dict], class_of: dict[str, int], held: set[str]
                ) -> tuple[list[list[str]], list[tuple[int, float | None, bytes, str, int | None]]]:
    """The report's rows, and every kept crop as ``(line in report.csv, score, JPEG, identity, class id)``."""
    rows: list[list[str]] = []
    crops = []
    for photo, result in zip(photos, results):
        shown = [result] if not result["crops"] else result["crops"]
        for crop in shown:
            status, label = result["status"], None
            if result["crops"]:
                status = "holdout" if photo.identity in held else "kept"
                label = class_of.get(photo.identity)
                crops.append((len(rows) + 2, crop["score"], bytes(crop["jpeg"].numpy().tobytes()), photo.identity,
                              label))
            rows.append([photo.name, photo.identity, _cell(label), status, _cell(result["faces"]),
                         "" if crop["score"] is None else f"{crop['score']:.4f}",
                         "" if crop["box"] is None else _numbers(crop["box"]),
                         "" if crop["points"] is None else _numbers(crop["points"]), result["reason"]])
    return rows, crops


def _write_report(path: Path, rows: list[list[str]]) -> None:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(REPORT_COLUMNS)
    writer.writerows(rows)
    atomic_write(path, lambda f: f.write(text.getvalue().encode()))


def write_preview(path: Path, crops: list[tuple[int, float | None, bytes, str, int | None]], sample: int = 24,
                  lowest: int = 8, columns: int = 8) -> None:
    """A PNG grid: an evenly spaced sample of the kept crops, then the lowest-scoring ones, each captioned with
    its line in report.csv and its score."""
    from PIL import Image, ImageDraw, ImageFont

    picks = sorted(set(np.linspace(0, len(crops) - 1, min(sample, len(crops))).round().astype(int).tolist()))
    scored = sorted((c for c in crops if c[1] is not None), key=lambda c: (c[1], c[0]))[:lowest]
    sections = [(f"sample: {len(picks)} of {len(crops)} kept faces", [crops[i] for i in picks]),
                (f"lowest scores: {len(scored)}", scored)]
    sections = [(title, items) for title, items in sections if items]
    font = ImageFont.load_default()
    tile, caption, title_h = 112, 14, 18
    height = sum(title_h + -(-len(items) // columns) * (tile + caption) for _, items in sections)
    canvas = Image.new("RGB", (columns * tile, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    y = 0
    for title, items in sections:
        draw.text((4, y + 3), title, fill=(0, 0, 0), font=font)
        y += title_h
        for k, (line, score, jpeg, _, _) in enumerate(items):
            x, row_y = (k % columns) * tile, y + (k // columns) * (tile + caption)
            with Image.open(io.BytesIO(jpeg)) as face:
                canvas.paste(face.convert("RGB"), (x, row_y))
            text = f"#{line} " + ("landmarks" if score is None else f"{score:.4f}")
            draw.text((x + 3, row_y + tile + 1), text, fill=(0, 0, 0), font=font)
        y += -(-len(items) // columns) * (tile + caption)
    out = io.BytesIO()
    canvas.save(out, "PNG")
    atomic_write(path, lambda f: f.write(out.getvalue()))


def pack(out: Path, photos: list[Photo], results: list[dict], holdout: int, max_pairs: int, seed: int,
         stamp: dict) -> str:
    """Write the output files into the staging folder, move them into ``out``, the stamp last; the summary."""
    kept_count: dict[str, int] = {}
    for photo, result in zip(photos, results):
        kept_count[photo.identity] = kept_count.get(photo.identity, 0) + len(result["crops"])
    order = identity_order([p.identity for p in photos])
    with_faces = [i for i in order if kept_count.get(i)]
    statuses = [r["status"] for r in results]
    if not with_faces:  # the report goes in the work folder: an earlier output in OUT_DIR stays as it was
        rows, _ = report_rows(photos, results, {}, set())
        _write_report(out / WORK / "report.csv", rows)
        raise BadData(f"no face kept in any of the {len(photos)} photos ({statuses.count('no_face')} without a face, "
                      f"{statuses.count('unreadable')} unreadable); every photo's reason is in "
                      f"{out / WORK / 'report.csv'}")
    rng = np.random.default_rng(seed)
    held: set[str] = set()
    if holdout:
        eligible = [i for i in with_faces if kept_count[i] >= 2]
        if len(eligible) < holdout:
            raise BadData(f"--holdout {holdout}: only {_count(len(eligible), 'identity', 'identities')} kept the 2 "
                          f"or more faces a same-identity pair needs")
        if len(with_faces) <= holdout:
            raise BadData(f"--holdout {holdout}: {_count(len(with_faces), 'identity', 'identities')} kept a face; "
                          f"holding out {holdout} leaves none for training")
        held = {eligible[i] for i in rng.choice(len(eligible), holdout, replace=False)}
    train_ids = [i for i in with_faces if i not in held]
    class_of = {identity: k for k, identity in enumerate(train_ids)}
    rows, crops = report_rows(photos, results, class_of, held)

    staging = out / WORK / "pack"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    train = sorted((c for c in crops if c[4] is not None), key=lambda c: (c[4], c[0]))
    images = write_insightface_rec(staging, ((label, jpeg) for _, _, jpeg, _, label in train), len(train_ids))
    pairs: list[tuple[int, int, bool]] = []
    if held:
        held_crops = [c for c in crops if c[3] in held]
        groups = [[k for k, c in enumerate(held_crops) if c[3] == identity]
                  for identity in sorted(held, key=order.index)]
        pairs = form_pairs(groups, max_pairs, rng)
        save_bin(staging / HOLDOUT, [held_crops[k][2] for a, b, _ in pairs for k in (a, b)],
                 [same for _, _, same in pairs])
        if len(pairs) < 10:
            _note(f"warning: {HOLDOUT} has {len(pairs)} pairs; eval.verify's 10 folds need at least 10")
    _write_report(staging / "report.csv", rows)
    write_preview(staging / "preview.png", crops)

    per_identity = [sum(1 for c in train if c[4] == k) for k in range(len(train_ids))]
    kept = sum(1 for r in results if r["crops"])
    below = statuses.count("low_score") + statuses.count("small_face")
    summary = (f"{TOOL}: {len(photos)} photos: {kept} kept, {statuses.count('no_face')} no face, "
               f"{statuses.count('several_faces')} several faces, {below} below the thresholds, "
               f"{statuses.count('unreadable')} unreadable"
               + (f", {statuses.count('bad_landmarks')} bad landmarks" if 'bad_landmarks' in statuses else "")
               + f"; {_count(len(train_ids), 'identity', 'identities')} in train.rec "
               f"({_count(images, 'face', 'faces')}, {min(per_identity)}-{max(per_identity)} per identity)"
               + (f", {len(held)} held out in {HOLDOUT} ({len(pairs)} pairs)" if held else "")
               + (f", {len(order) - len(with_faces)} without a kept face left out" if len(order) > len(with_faces)
                  else ""))
    produced = [name for name in OUTPUT_FILES if (staging / name).exists()]
    (out / STAMP).unlink(missing_ok=True)  # a folder half replaced is never stamped complete
    for name in produced:
        os.replace(staging / name, out / name)
    for name in OUTPUT_FILES:
        if name not in produced and name != STAMP:
            (out / name).unlink(missing_ok=True)  # e.g. an earlier run's holdout.bin
    atomic_write(out / STAMP, lambda f: f.write(_json_bytes({**stamp, "summary": summary})))
    fsync_dir(out)
    shutil.rmtree(out / WORK)
    return summary


# ------------------------------------------------------------------------------------------------ the CLI

def check_out_dir(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse an OUT_DIR inside the input, or one holding output not made from this input (without
    ``--overwrite``)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT_DIR {out} is a file, not a folder")
    if source.is_dir() and out.resolve().is_relative_to(source.resolve()):
        raise UsageError(f"OUT_DIR {out} is inside PHOTOS_DIR {source}; the input is never written to: choose a "
                         f"folder outside it")
    existing = [name for name in (*OUTPUT_FILES, WORK) if (out / name).exists()]
    if not existing or overwrite:
        return
    stamps = [_read_json(path) for path in (out / STAMP, out / WORK / "work.json")]
    ours = any(isinstance(s, dict) and s.get("input") == str(source.resolve()) for s in stamps)
    if not ours:
        raise UsageError(f"OUT_DIR {out} holds another dataset ({', '.join(existing)}) not made by "
                         f"prepare_faces.py from {source}; pass --overwrite to replace it, or choose another folder")


def _device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: CUDA is not available here (use --device cpu or auto)")
    return device


def _terminate(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a job scheduler, ``kill``) unwinds like Ctrl-C: the chunks saved so far stay."""
    raise SystemExit(128 + signum)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("photos", type=Path, metavar="PHOTOS_DIR",
                        help="a folder of identity folders of photos, or a list file of 'path label' lines")
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="where the training set and the report go")
    parser.add_argument("--landmarks", type=Path, metavar="FILE",
                        help="CSV (path,x1,y1,...,x5,y5) or JSON file of 5 points per photo: no detection for those")
    parser.add_argument("--multi", choices=("largest", "skip", "all"), default="largest",
                        help="a photo with several faces: keep the largest one nearest the centre (default), skip "
                             "the photo, or keep them all")
    parser.add_argument("--min-score", type=float, default=0.9,
                        help="faces the detector scores below this are not counted (default 0.9)")
    parser.add_argument("--min-face-size", type=float, default=40.0, metavar="PIXELS",
                        help="faces whose box's shorter side is smaller (in the photo's pixels) are not counted "
                             "(default 40)")
    parser.add_argument("--holdout", type=int, default=0, metavar="N",
                        help="hold N identities (with 2+ kept faces) out of train.rec and write them as holdout.bin "
                             "pairs (default 0: none; at least 2)")
    parser.add_argument("--pairs", type=int, default=3000, help="at most this many pairs in holdout.bin (default 3000)")
    parser.add_argument("--seed", type=int, default=0, help="which identities are held out and which pairs (default 0)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes decoding photos (default: one per core; 0: in the main process)")
    parser.add_argument("--batch-size", type=int, default=16, help="photos per detection batch (default 16)")
    parser.add_argument("--detect-size", type=int, default=640, metavar="PIXELS",
                        help="photos are scaled to fit this square for detection (default 640)")
    parser.add_argument("--chunk-size", type=int, default=256,
                        help="photos per saved chunk of work: what an interrupted run can lose (default 256)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the output files in an OUT_DIR that holds another dataset")
    args = parser.parse_args(argv)
    for name, low in (("pairs", 2), ("workers", 0), ("batch_size", 1), ("detect_size", 64), ("chunk_size", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.holdout == 1 or args.holdout < 0:
        parser.error(f"--holdout must be 0 or >= 2 (different-identity pairs need two), got {args.holdout}")
    if not 0.0 <= args.min_score <= 1.0:
        parser.error(f"--min-score must be in [0, 1], got {args.min_score:g}")
    if args.min_face_size < 0:
        parser.error(f"--min-face-size must be >= 0, got {args.min_face_size:g}")
    try:
        args.device = _device(args.device)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = None
    try:
        if not args.photos.exists():
            raise UsageError(f"PHOTOS_DIR {args.photos} does not exist")
        check_out_dir(args.out, args.photos, args.overwrite)
        photos = sorted_photos(list_photo_folder(args.photos) if args.photos.is_dir() else read_photo_list(args.photos))
        root = args.photos if args.photos.is_dir() else args.photos.parent
        landmarks = {}
        landmarks_digest = None
        if args.landmarks is not None:
            if not args.landmarks.is_file():
                raise UsageError(f"--landmarks {args.landmarks} is not a file")
            landmarks = read_landmarks(args.landmarks, root, photos)
            landmarks_digest = hashlib.sha256(args.landmarks.read_bytes()).hexdigest()
        settings = Settings(args.multi, args.min_score, args.min_face_size, args.detect_size, args.batch_size,
                            args.chunk_size, args.device.type)
        stamp = {"tool": "scripts/prepare_faces.py", "input": str(args.photos.resolve()), "settings": asdict(settings),
                 "landmarks": landmarks_digest}
        detector = None
        if len(landmarks) < len(photos):
            # Built before anything is written, so that a missing package leaves no trace. It reports every face;
            # the policy (decide) applies the thresholds, so that the report can say why a face was not counted.
            detector = FaceDetector(args.device, min_score=0.0, min_face_size=0.0, detect_size=args.detect_size,
                                    batch_size=args.batch_size)
        args.out.mkdir(parents=True, exist_ok=True)
        work = WorkFolder(args.out, {**stamp, "photos": len(photos), "fingerprint": fingerprint(photos)})
        work.open()
        run_photos(photos, landmarks, work, settings, args.workers, detector)
        summary = pack(args.out, photos, work.load(), args.holdout, args.pairs, args.seed,
                       {**stamp, "holdout": args.holdout, "pairs": args.pairs, "seed": args.seed})
    except (DetectorUnavailable, BadData) as exc:
        print_error(TOOL, exc)
        return 1
    except (ValueError, OSError) as exc:  # UsageError; OSError: an OUT_DIR that cannot be written
        print_error(TOOL, exc)
        return 2
    except (KeyboardInterrupt, SystemExit) as exc:
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 128 + signal.SIGINT
        if work is not None and work.dir.exists():
            print(f"{TOOL}: interrupted; {work.done_photos()} of {work.photos} photos are saved in {work.dir}: run the "
                  f"same command again to continue", file=sys.stderr)
        else:
            print(f"{TOOL}: interrupted", file=sys.stderr)
        return code
    print(summary)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)  # only the CLI process: a caller of main() keeps its own
    sys.exit(main())
