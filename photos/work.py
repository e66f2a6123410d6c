"""The work folder ``OUT_DIR/.prepare_faces-work``: every photo's detections, kept between runs.

A photo's entry (its size, its thumbnail for ``photos.duplicates``, and every face the detector found: box, score,
landmarks and the aligned crop as JPEG bytes; plain numbers, lists and bytes) is saved as soon as the photo is
done, under ``detections/<settings>/<ab>/<sha256 of the file>.pt``: keyed by the photo's content and by the
detector's settings (``DetectorSettings``), never by its name or by the policy. So a run that is interrupted
continues where it stopped, a renamed or copied photo is not detected again, and a run with another policy,
thresholds, ``--multi``, model or holdout only decides and packs. Entries are written atomically and read with
``utils.files.load_tensors`` (no pickle); one that cannot be read is detected again. The folder is kept after a
run; removing it only costs the detection. See docs/data.md ("From your own photos", Detections).
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from utils.files import atomic_write, load_tensors, save_atomic

logger = logging.getLogger(__name__)

WORK = ".prepare_faces-work"
WORK_FORMAT = 2  # 1: the chunked results of one run (before detections were kept)
# What the detections of a photo are a function of besides its content and DetectorSettings: raise it when the
# detection or the alignment changes what they give.
DETECTOR_VERSION = 2


def json_bytes(obj: Any) -> bytes:
    """``obj`` as the pipeline writes JSON: indented, keys sorted, one final newline."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def read_json(path: Path) -> Any:
    """The JSON in ``path``; None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def content_key(data: bytes) -> str:
    """The key of a photo's entry: the SHA-256 of the file's bytes."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class DetectorSettings:
    """What a photo's detections depend on besides its content: the detection canvas (``--detect-size``), the
    smallest face a small photo is enlarged for (``alignment.detection_scale``), and the device type (a GPU may
    differ from the CPU in the last bits)."""

    detect_size: int
    smallest_face: float
    device: str
    version: int = DETECTOR_VERSION

    def digest(self) -> str:
        return hashlib.sha256(json_bytes(asdict(self))).hexdigest()[:16]


class WorkFolder:
    """``out/.prepare_faces-work``, holding the detections made under ``settings``."""

    def __init__(self, out: Path, settings: DetectorSettings) -> None:
        self.root = out / WORK
        self.dir = self.root / "detections" / settings.digest()
        self.settings = settings

    def open(self) -> None:
        """Create the folder; work of an earlier format (the chunks of one run) is removed."""
        stamp = read_json(self.root / "work.json")
        if self.root.exists() and stamp != {"format": WORK_FORMAT}:
            logger.info("%s holds the work of an earlier version of the tool; starting over", self.root)
            shutil.rmtree(self.root)
        if not (self.dir / "settings.json").is_file():
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.dir / "settings.json", lambda f: f.write(json_bytes(asdict(self.settings))))
        if not (self.root / "work.json").is_file():
            atomic_write(self.root / "work.json", lambda f: f.write(json_bytes({"format": WORK_FORMAT})))

    def saved(self) -> int:
        """How many photos' detections the folder holds under these settings (counted on disk: worker processes
        save them, and an interruption may fall between a save and its report)."""
        return sum(1 for _ in self.dir.glob("*/*.pt"))

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.pt"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def load(self, key: str) -> dict | None:
        """The entry saved under ``key``; None when there is none or it cannot be read (then it is made again)."""
        if not self.has(key):
            return None
        try:
            entry = load_tensors(self.path(key))
        except Exception:  # whatever a damaged file makes torch's unpickler raise (KeyError, EOFError, ...)
            return None
        return entry if isinstance(entry, dict) and entry.get("format") == WORK_FORMAT else None

    def save(self, key: str, entry: dict) -> None:
        save_atomic({**entry, "format": WORK_FORMAT}, self.path(key))
