"""A folder (or list file) of photos to a training set in OUT_DIR, from start to end: ``prepare``.

The input is listed (``photos.listing``), OUT_DIR checked (``photos.pack.check_out_dir``), the work folder opened
for this input and these settings (``photos.work``), the photos not done yet processed (``photos.pipeline``) and
the results packed (``photos.pack``). Running it again after an interruption continues the work. See docs/data.md
("From your own photos").
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from alignment import FaceDetector
from photos.listing import list_photo_folder, read_landmarks, read_photo_list, sorted_photos
from photos.pack import check_out_dir, pack
from photos.pipeline import Settings, run_photos
from photos.work import WorkFolder, fingerprint
from utils.cli import UsageError


def prepare(source: Path, out: Path, settings: Settings, device: torch.device, landmarks_file: Path | None = None,
            holdout: int = 0, max_pairs: int = 3000, seed: int = 0, workers: int = 0, overwrite: bool = False,
            work_opened: Callable[[WorkFolder], None] = lambda work: None) -> str:
    """Write the training set of the photos ``source`` names into ``out``; the summary line. ``device`` runs the
    detector (``settings.device`` is its type); ``work_opened`` is told the work folder once it is open (where an
    interrupted run's results are). Raises ``UsageError``, ``BadData`` (``photos.pack.pack``) and
    ``alignment.DetectorUnavailable`` (before anything is written)."""
    if not source.exists():
        raise UsageError(f"PHOTOS_DIR {source} does not exist")
    check_out_dir(out, source, overwrite)
    photos = sorted_photos(list_photo_folder(source) if source.is_dir() else read_photo_list(source))
    landmarks, landmarks_digest = {}, None
    if landmarks_file is not None:
        if not landmarks_file.is_file():
            raise UsageError(f"--landmarks {landmarks_file} is not a file")
        landmarks = read_landmarks(landmarks_file, source if source.is_dir() else source.parent, photos)
        landmarks_digest = hashlib.sha256(landmarks_file.read_bytes()).hexdigest()
    stamp = {"tool": "scripts/prepare_faces.py", "input": str(source.resolve()), "settings": asdict(settings),
             "landmarks": landmarks_digest}
    detector = None
    if len(landmarks) < len(photos):
        # Built before anything is written, so that a missing package leaves no trace. It reports every face; the
        # policy (photos.policy.decide) applies the thresholds, so that the report can say why a face was not counted.
        detector = FaceDetector(device, min_score=0.0, min_face_size=0.0, detect_size=settings.detect_size,
                                batch_size=settings.batch_size)
    out.mkdir(parents=True, exist_ok=True)
    work = WorkFolder(out, {**stamp, "photos": len(photos), "fingerprint": fingerprint(photos)})
    work.open()
    work_opened(work)
    run_photos(photos, landmarks, work, settings, workers, detector)
    return pack(out, photos, work.load(), holdout, max_pairs, seed,
                {**stamp, "holdout": holdout, "pairs": max_pairs, "seed": seed})
