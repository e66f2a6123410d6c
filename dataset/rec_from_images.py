"""Images to an insightface-layout RecordIO (``train.rec``, ``train.idx``, ``property``): ``scripts/make_rec.py``.

The sources: an image folder (``list_image_folder``: the identity-folder rule of ``dataset.identity_folders``
with training's JPEG/PNG suffixes) or a list file (``read_list_file``: ``path<TAB>label`` or MXNet im2rec's
``index<TAB>label<TAB>path`` lines). ``image_bytes`` gives what a record stores: the file's own bytes when the
trainer's decoder reads them at the right size, else a JPEG q95 of the image resized. ``make_rec`` decodes every
image first, then writes the good ones grouped by label through ``utils.files.staged``; what it leaves out it
logs (this package's logger). The rules for messy inputs are in docs/data.md ("The rec tools").
"""
from __future__ import annotations

import io
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from dataset.identity_folders import identity_folders
from dataset.images import IMAGE_EXTENSIONS, decode
from dataset.recordio import write_insightface_rec
from utils.cli import BadData
from utils.files import path_problem, staged

logger = logging.getLogger(__name__)


class BadImage(BadData):
    """A file that cannot be read or decoded; the message starts with its path."""


@dataclass
class Source:
    """What to write: ``(path, label)`` items, and for an image folder each label's identity folder."""

    items: list[tuple[Path, int]]
    folders: list[Path] | None = None  # label -> identity folder (--images); None for a list file
    empty: list[Path] = field(default_factory=list)  # identity folders without a JPEG/PNG file: no label


@dataclass
class Report:
    """What ``make_rec`` did."""

    images: int = 0
    classes: int = 0
    reencoded: int = 0
    bad: list[str] = field(default_factory=list)  # one "path: reason" per bad file
    dropped_folders: list[Path] = field(default_factory=list)  # identity folders that did not become classes
    empty_classes: list[int] = field(default_factory=list)  # class ids < classes without images


def list_image_folder(root: Path) -> Source:
    """Every JPEG/PNG of ``root``'s identity folders (``dataset.identity_folders``), labelled by the identity's
    index in the sorted names of those holding one; the ignored entries are logged in one line."""
    listing = identity_folders(root, IMAGE_EXTENSIONS)
    listing.check_listed()
    if (note := listing.ignored_note()) is not None:
        logger.info("%s", note)
    items = listing.samples()
    if not items:
        raise ValueError(f"{root}: no images; expected one folder per identity holding "
                         f"{'/'.join(IMAGE_EXTENSIONS)} files")
    return Source(items, [root / name for name in listing.classes], [root / name for name in listing.empty])


LIST_FORMATS = "'path<TAB>label' or im2rec's 'index<TAB>label<TAB>path' lines"
TWO_FIELDS, IM2REC = "a 'path<TAB>label'", "an im2rec 'index<TAB>label<TAB>path'"  # "line 3 is <format> line"
_INTEGER = re.compile(r"[0-9]+")
_IM2REC_LABEL = re.compile(r"[0-9]+(\.0*)?")  # im2rec writes labels with '%f': 12.000000


def parse_list_line(line: str) -> tuple[str, int, str] | None:
    """``(image path, label, TWO_FIELDS or IM2REC)`` of one list line; None when it is neither."""
    fields = line.split("\t")
    if len(fields) == 2 and _INTEGER.fullmatch(fields[1].strip()):
        return fields[0], int(fields[1]), TWO_FIELDS
    if len(fields) == 3 and _INTEGER.fullmatch(fields[0].strip()) and _IM2REC_LABEL.fullmatch(fields[1].strip()):
        return fields[2], int(fields[1].strip().split(".")[0]), IM2REC
    return None


def read_list_file(path: Path, root: Path | None = None) -> Source:
    """``(path, label)`` from lines ``path<TAB>label`` or im2rec's ``index<TAB>label<TAB>path`` (one kind per
    file); relative paths are relative to ``root``, by default the list file's folder."""
    if (problem := path_problem(path)) is not None:
        raise FileNotFoundError(f"list file {path} {'does not exist' if problem == 'not found' else problem}")
    if root is None:
        root = path.parent
    elif (problem := path_problem(root, folder=True)) is not None:
        raise FileNotFoundError(f"--root {root} {'does not exist' if problem == 'not found' else problem}")
    items = []
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a text list of {LIST_FORMATS} ({exc})") from None
    first: tuple[int, str] | None = None  # (line number, format) of the first line
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if (parsed := parse_list_line(line)) is None:
            raise ValueError(f"{path}: line {lineno} is {line[:80]!r}; expected {LIST_FORMATS} with a label that "
                             f"is an integer >= 0 (im2rec's 12.000000 is 12)")
        image, label, fmt = parsed
        if first is None:
            first = lineno, fmt
        elif fmt != first[1]:
            raise ValueError(f"{path}: line {lineno} is {fmt} line but line {first[0]} is {first[1]} line; use one "
                             f"format per file")
        p = Path(image)
        items.append((p if p.is_absolute() else root / p, label))
    if not items:
        raise ValueError(f"{path}: no {LIST_FORMATS}")
    return Source(items)


def _open_image(path: Path, data: bytes):
    """The PIL image of ``data`` (header read, pixels not yet decoded); ``BadImage`` if PIL cannot tell
    what it is."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise BadImage(f"{path}: not an image in a known format ({len(data)} bytes, starts with "
                       f"{data[:8]!r})") from None
    except OSError as exc:
        raise BadImage(f"{path}: unreadable image header: {exc}") from exc


def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadImage(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if not data:
        raise BadImage(f"{path}: empty file (0 bytes)")
    return data


def image_bytes(path: Path, image_size: tuple[int, int]) -> tuple[bytes, bool]:
    """``(encoded bytes, re-encoded?)``: the file's own bytes when it is a JPEG/PNG of ``image_size``
    (H, W), else a JPEG q95 of it resized. ``BadImage`` when it cannot be read or decoded.

    Bytes kept as they are get decoded with the trainer's decoder (PIL reads only their header);
    re-encoded ones are decoded in full by PIL on the way.
    """
    from PIL import Image

    data = _read(path)
    with _open_image(path, data) as im:
        if im.format in ("JPEG", "PNG") and im.size == (image_size[1], image_size[0]):
            try:
                decode(data, str(path))
            except ValueError as exc:
                raise BadImage(str(exc)) from exc
            return data, False
        out = io.BytesIO()
        try:
            im.convert("RGB").resize((image_size[1], image_size[0]), Image.BICUBIC).save(out, "JPEG", quality=95)
        except (OSError, ValueError) as exc:  # PIL: truncated or corrupt pixel data
            raise BadImage(f"{path}: cannot decode image: {exc}") from exc
        return out.getvalue(), True


def make_rec(source: Source, out_dir: Path, num_classes: int | None = None,
             image_size: tuple[int, int] = (112, 112), skip_bad: bool = True) -> Report:
    """Decode every image of ``source``, then write the good ones to ``out_dir``; see the module doc.

    Raises ``BadData`` (bad files with ``skip_bad=False``, or not one good image) and ``ValueError`` for
    a ``num_classes`` below the labels; either way nothing is written.
    """
    report = Report()
    items = sorted(source.items, key=lambda t: (t[1], str(t[0])))  # grouped by label, ascending
    good: list[tuple[Path, int]] = []
    for path, label in tqdm(items, desc="make_rec: checking", unit="img", disable=None):
        try:
            image_bytes(path, image_size)
        except BadImage as exc:
            report.bad.append(str(exc))
            logger.info("%s%s", "skipped " if skip_bad else "bad image ", exc)
            continue
        good.append((path, label))
    if report.bad and not skip_bad:
        raise BadData(f"{len(report.bad)} of {len(items)} images cannot be read or decoded (listed above); "
                      f"nothing written (--skip-bad leaves them out)")
    if not good:
        raise BadData(f"none of the {len(items)} images can be read or decoded (listed above); nothing written")

    kept = Counter(label for _, label in good)
    if source.folders is not None:
        # An identity without a good image would be a class no sample can teach: leave the folder out.
        listed = Counter(label for _, label in items)
        all_bad = {folder: listed[label] for label, folder in enumerate(source.folders) if not kept[label]}
        for folder in sorted([*source.empty, *all_bad], key=lambda f: f.name):
            why = f"all {all_bad[folder]} images are bad" if folder in all_bad else "no JPEG/PNG files"
            report.dropped_folders.append(folder)
            logger.warning("identity folder %s left out (%s); class ids follow the remaining folders", folder, why)
        new_label = {old: new for new, old in enumerate(sorted(kept))}
        good = [(path, new_label[label]) for path, label in good]
        needed = len(new_label)
    else:
        needed = max(label for _, label in items) + 1
    num_classes = num_classes or needed
    if num_classes < needed:
        raise ValueError(f"--num-classes {num_classes} is below the {needed} classes of the input "
                         f"(labels 0..{needed - 1})")
    kept = Counter(label for _, label in good)
    report.empty_classes = [c for c in range(num_classes) if not kept[c]]
    if report.empty_classes:
        empty = report.empty_classes
        shown = ", ".join(map(str, empty[:20])) + (f" ... ({len(empty) - 20} more)" if len(empty) > 20 else "")
        logger.warning("%d of %d classes have no images: %s", len(empty), num_classes, shown)

    def gen():
        for path, label in tqdm(good, desc="make_rec: writing", unit="img", disable=None):
            data, changed = image_bytes(path, image_size)
            report.reencoded += changed
            yield label, data

    with staged(out_dir) as staging:  # a failure or Ctrl-C leaves no temporary file and an earlier rec as it was
        write_insightface_rec(staging, gen(), num_classes, image_size)
    report.images, report.classes = len(good), num_classes
    return report
