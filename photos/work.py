"""The resumable work folder ``OUT_DIR/.prepare_faces-work``: each photo's result, saved in chunks.

``work.json`` says what the results are of (the input's fingerprint and the settings); one
``chunk-NNNNNN.pt`` per ``chunk_size`` photos holds their results, each written atomically, so a chunk on disk is
complete. A run started again with the same input and settings continues after the last saved chunk, and its
output is byte-identical to an uninterrupted run's; other work in the folder is discarded. The chunks are read
with ``utils.files.load_tensors`` (no pickle). See docs/data.md ("From your own photos", Interruptions).
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from photos.listing import Photo
from utils.files import atomic_write, load_tensors

logger = logging.getLogger(__name__)

WORK = ".prepare_faces-work"
WORK_FORMAT = 1


def json_bytes(obj: Any) -> bytes:
    """``obj`` as the pipeline writes JSON: indented, keys sorted, one final newline."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def read_json(path: Path) -> Any:
    """The JSON in ``path``; None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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
    """``out/.prepare_faces-work`` for the work ``stamp`` describes (``stamp["photos"]`` photos, its
    ``settings.chunk_size`` per chunk)."""

    def __init__(self, out: Path, stamp: dict) -> None:
        self.dir, self.stamp = out / WORK, stamp
        self.chunk_size, self.photos = stamp["settings"]["chunk_size"], stamp["photos"]

    def open(self) -> None:
        """Keep the results of the same work, or start over."""
        saved = read_json(self.dir / "work.json")
        if saved != self.stamp:
            if self.dir.exists():
                if saved is not None:
                    logger.info("%s holds the work of other photos or settings; starting over", self.dir)
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
            atomic_write(self.dir / "work.json", lambda f: f.write(json_bytes(self.stamp)))
        if done := self.done_photos():
            logger.info("continuing: %d of %d photos already done (%s)", done, self.photos, self.dir)

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
        """Every photo's result, in the photos' order."""
        results = []
        for chunk in self.chunks():
            saved = load_tensors(self._path(chunk))
            if saved.get("format") != WORK_FORMAT or len(saved["results"]) != len(self.photo_range(chunk)):
                raise ValueError(f"{self._path(chunk)}: not a chunk of this work; delete {self.dir} and run again")
            results.extend(saved["results"])
        return results
