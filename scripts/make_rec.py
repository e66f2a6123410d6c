"""Build an insightface-layout RecordIO (train.rec, train.idx, property) from images.

    python scripts/make_rec.py --images faces/ --out data/my_rec        # faces/<identity>/<image>.jpg
    python scripts/make_rec.py --list train.lst --out data/my_rec       # lines: path<TAB>label
    python scripts/make_rec.py --list train.lst --root faces/ --out data/my_rec  # MXNet im2rec's .lst

A list file holds one of two kinds of line, one kind per file: ``path<TAB>label`` with an integer label, or
the ``index<TAB>label<TAB>path`` that MXNet's ``im2rec --list`` writes (arcface_torch's custom-dataset
recipe), whose label may be written as a float equal to an integer (``12.000000``); the index is ignored.
Labels must be >= 0. Relative paths are resolved against --root (default: the list file's folder).
Either way records are written grouped by label, ascending, and by path within a label.

Every image is decoded first, with the decoder the trainer uses; then the good ones are written (each
file is read twice). Images are stored as their original bytes and re-encoded (JPEG, quality 95) only
when they would not load as-is: a format other than JPEG/PNG, or a size other than --image-size (resized).

Messy folders:
  - a file that cannot be read or decoded is reported on stderr with its path and the reason and left
    out (--skip-bad, the default); with --no-skip-bad every bad file is listed and nothing is written;
  - an identity folder without a good image (empty, or only bad files) does not become a class: it is
    left out with a warning, and class ids follow the sorted names of the identity folders that remain;
  - with --list, labels are kept as written; labels below num_classes that have no good image are
    listed in a warning (rec_info.py --check warns about them too);
  - the files are written in a staging folder inside --out and moved into place when complete: a failure
    or an interruption (Ctrl-C, SIGTERM) leaves no temporary file and the previous rec, if any, as it was.

Exit status: 0 written (skipped files, if any, listed on stderr); 1 bad data: bad files with
--no-skip-bad, or not one good image; 2 usage: bad options, a missing folder, a malformed list file, an
--out that cannot be written; 130 / 143 after Ctrl-C / SIGTERM.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import signal
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from dataset.images import IMAGE_EXTENSIONS, decode  # noqa: E402
from dataset.recordio import write_insightface_rec  # noqa: E402
from utils.files import path_problem  # noqa: E402
from utils.cli import print_error  # noqa: E402

OUTPUT_FILES = ("train.rec", "train.idx", "property")


class BadData(ValueError):
    """The input cannot make a rec (bad files with --no-skip-bad, no good image): exit status 1."""


class BadImage(BadData):
    """A file that cannot be read or decoded; the message starts with its path."""


@dataclass
class Source:
    """What to write: ``(path, label)`` items, and for an image folder each label's identity folder."""

    items: list[tuple[Path, int]]
    folders: list[Path] | None = None  # label -> identity folder (--images); None for a list file


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
    """Every ``root/<identity>/<image>`` with a JPEG/PNG suffix, labelled by the identity's index in the
    sorted folder names (empty folders included here; ``make_rec`` leaves them out)."""
    if (problem := path_problem(root, folder=True)) is not None:
        raise FileNotFoundError(f"image folder {root} {'does not exist' if problem == 'not found' else problem}")
    folders = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.name)
    items = [(f, label) for label, folder in enumerate(folders)
             for f in sorted(folder.iterdir()) if f.suffix.lower() in IMAGE_EXTENSIONS]
    if not items:
        raise ValueError(f"{root}: no images; expected one folder per identity holding "
                         f"{'/'.join(IMAGE_EXTENSIONS)} files")
    return Source(items, folders)


LIST_FORMATS = "'path<TAB>label' or im2rec's 'index<TAB>label<TAB>path' lines"
TWO_FIELDS, IM2REC = "a 'path<TAB>label'", "an im2rec 'index<TAB>label<TAB>path'"  # "line 3 is <format> line"
_INTEGER = re.compile(r"[0-9]+")
_IM2REC_LABEL = re.compile(r"[0-9]+(\.0*)?")  # im2rec writes labels with '%f': 12.000000


def _parse_list_line(line: str) -> tuple[str, int, str] | None:
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
        if (parsed := _parse_list_line(line)) is None:
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


def _note(message: str) -> None:
    """A line on stderr that does not break the progress bar."""
    tqdm.write(f"make_rec: {message}", file=sys.stderr)


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
            _note(("skipped " if skip_bad else "bad image ") + str(exc))
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
        for label, folder in enumerate(source.folders):
            if not kept[label]:
                why = f"all {listed[label]} images are bad" if listed[label] else "no JPEG/PNG files"
                report.dropped_folders.append(folder)
                _note(f"warning: identity folder {folder} left out ({why}); class ids follow the remaining "
                      f"folders")
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
        _note(f"warning: {len(report.empty_classes)} of {num_classes} classes have no images: {shown}")

    def gen():
        for path, label in tqdm(good, desc="make_rec: writing", unit="img", disable=None):
            data, changed = image_bytes(path, image_size)
            report.reencoded += changed
            yield label, data

    _write_staged(out_dir, lambda staging: write_insightface_rec(staging, gen(), num_classes, image_size))
    report.images, report.classes = len(good), num_classes
    return report


def _write_staged(out_dir: Path, write: Callable[[Path], object]) -> None:
    """Run ``write(staging)`` in a new folder inside ``out_dir``, then move its files into ``out_dir``.

    Whatever stops it (an exception, Ctrl-C, SIGTERM turned into SystemExit in the CLI), the staging
    folder is removed, and so is ``out_dir`` when this call created it and it is still empty.
    """
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".make_rec-", dir=out_dir))
    try:
        write(staging)
        for name in OUTPUT_FILES:
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()


def _terminate(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a job scheduler, ``kill``) unwinds like Ctrl-C, so the staging folder is removed."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", type=Path, help="folder with one sub-folder of images per identity")
    src.add_argument("--list", type=Path,
                     help="text file of 'path<TAB>label' lines or of im2rec's 'index<TAB>label<TAB>path' lines "
                          "(label 12 or 12.000000); one format per file, mixed files are refused")
    parser.add_argument("--root", type=Path, default=None, metavar="DIR",
                        help="with --list: the folder relative image paths start from (default: the list "
                             "file's folder); im2rec lists are relative to the root given to im2rec")
    parser.add_argument("--out", type=Path, required=True, help="output folder (train.rec, train.idx, property)")
    parser.add_argument("--num-classes", type=int, default=None,
                        help="default: the number of identity folders kept, or the largest label + 1")
    parser.add_argument("--image-size", type=int, nargs=2, default=(112, 112), metavar=("H", "W"))
    parser.add_argument("--skip-bad", action=argparse.BooleanOptionalAction, default=True,
                        help="leave out files that cannot be read or decoded, listing each (default); "
                             "--no-skip-bad lists them and writes nothing")
    args = parser.parse_args(argv)
    if args.num_classes is not None and args.num_classes < 1:
        parser.error(f"--num-classes must be >= 1, got {args.num_classes}")
    if args.root is not None and args.list is None:
        parser.error("--root goes with --list (an --images folder holds its own paths)")
    if min(args.image_size) < 1:
        parser.error(f"--image-size must be two sizes >= 1, got {args.image_size[0]} {args.image_size[1]}")
    try:
        source = list_image_folder(args.images) if args.images else read_list_file(args.list, args.root)
        report = make_rec(source, args.out, args.num_classes, tuple(args.image_size), args.skip_bad)
    except BadData as exc:
        print_error("make_rec", exc)
        return 1
    except (ValueError, OSError) as exc:  # OSError: a missing input, an --out that cannot be written
        print_error("make_rec", exc)
        return 2
    except KeyboardInterrupt:  # the staging folder is already gone; a traceback would add nothing
        print("make_rec: interrupted; nothing written", file=sys.stderr)
        return 128 + signal.SIGINT
    print(f"wrote {report.images} images of {report.classes} classes to {args.out} "
          f"({report.reencoded} re-encoded as JPEG q95: not JPEG/PNG or not {args.image_size[0]}x"
          f"{args.image_size[1]}" + (f"; {len(report.bad)} bad files skipped, listed above" if report.bad else "")
          + ")")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)  # only the CLI process: a caller of main() keeps its own
    sys.exit(main())
