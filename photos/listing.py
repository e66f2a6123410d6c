"""The input of the photo pipeline: which photos, of which identity, in which order, and given landmarks.

A photo folder is listed by the project's one identity-folder rule (``dataset.identity_folders``): a file is a
photo when its suffix is one of a format the installed Pillow and its plug-ins open (``photo_suffixes``), or, for
any other suffix, when Pillow recognises its content (``is_photo``); a list file holds ``path label`` lines.
``sorted_photos`` puts them in the order of the report and the records (class ids follow ``identity_order``);
``read_landmarks`` reads the five points a user gives for some photos. What is left out is logged (``photos``
logger). See docs/data.md ("From your own photos").
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from alignment import register_plugins
from dataset.identity_folders import identity_folders, names_shown
from utils.cli import UsageError

logger = logging.getLogger(__name__)

# Photo formats Pillow reads only through a plug-in, and the package that adds it.
PLUGIN_SUFFIXES = {".heic": "pillow-heif", ".heif": "pillow-heif", ".hif": "pillow-heif"}


@dataclass(frozen=True)
class Photo:
    """One input photo: the file to read, its name in the report, its identity."""

    path: Path
    name: str  # relative to the photo root (a folder) or as written in the list file
    identity: str


def count(n: int, one: str, many: str) -> str:
    """``"1 file"``, ``"2 files"``."""
    return f"{n} {one if n == 1 else many}"


def photo_suffixes() -> tuple[str, ...]:
    """The file-name suffixes (lower case, with the dot) of every format the installed Pillow and its registered
    plug-ins (``alignment.register_plugins``) can open."""
    from PIL import Image

    register_plugins()
    Image.init()
    return tuple(sorted(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN))


def is_photo(path: Path) -> bool:
    """Whether Pillow (with its plug-ins) recognises ``path``'s content as an image it opens; only the header is
    read. A decompression bomb is an image (``alignment.read_photo`` names it)."""
    from PIL import Image

    register_plugins()
    try:
        with Image.open(path):
            return True
    except Image.DecompressionBombError:
        return True
    except (OSError, ValueError, SyntaxError):  # not an image (UnidentifiedImageError), or unreadable
        return False


def list_photo_folder(root: Path) -> list[Photo]:
    """Every photo of ``root``'s identity folders (sub-folders included), by identity then name; hidden and system
    entries, files beside the identity folders and files that are no image Pillow opens are logged and left
    out."""
    listing = identity_folders(root, photo_suffixes(), sniff=is_photo)
    if not listing.identities:
        raise UsageError(f"{root} holds no identity folders; expected {root}/<identity>/<photo> (or a list file "
                         f"of 'path label' lines)")
    if (note := listing.ignored_note()) is not None:
        logger.info("%s", note)
    if listing.loose:
        logger.info("%s directly in %s ignored (photos go in a folder per identity): %s",
                    count(len(listing.loose), "file", "files"), root, names_shown(listing.loose))
    for unlisted in listing.unlisted:
        logger.info("cannot list %s; its photos are left out", unlisted)
    if listing.other_files:
        plugins = sorted({PLUGIN_SUFFIXES[suffix] for name in listing.other_files
                          if (suffix := os.path.splitext(name)[1].lower()) in PLUGIN_SUFFIXES})
        needs = f" ({', '.join(plugins)} reads some of them: pip install {' '.join(plugins)})" if plugins else ""
        logger.info("%s ignored, not %s Pillow reads%s: %s", count(len(listing.other_files), "file", "files"),
                    "an image" if len(listing.other_files) == 1 else "images", needs, names_shown(listing.other_files))
    photos = [Photo(path, path.relative_to(root).as_posix(), identity)
              for identity in listing.classes for path in listing.files[identity]]
    if not photos:
        raise UsageError(f"{root}: no photos in its {len(listing.identities)} identity folders (no file that "
                         f"Pillow reads as an image)")
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
        logger.info("%s of %s name no photo of the input (ignored): %s", count(len(unknown), "entry", "entries"),
                    path, names_shown(unknown))
    return points
