"""A folder (or list file) of photos to a training set in OUT_DIR, from start to end: ``prepare``.

The input is listed (``photos.listing``), OUT_DIR checked (``photos.pack.check_out_dir``), a recognition model
loaded when one is given (``photos.matching``), the work folder of detections opened (``photos.work``), the photos
not detected yet detected (``photos.pipeline``), every photo decided (``photos.policy``), matched to its identity
(``photos.matching``), checked for copies (``photos.duplicates``), and the outcomes packed (``photos.pack``). Running
it again after an interruption continues the work; running it with another policy only decides and packs. See
docs/data.md ("From your own photos").
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from photos.duplicates import find_copies
from photos.listing import Photo, count, list_photo_folder, read_landmarks, read_photo_list, sorted_photos
from photos.matching import DEFAULT_THRESHOLD, check_identities, embedder, load_model
from photos.pack import check_out_dir, pack
from photos.pipeline import Settings, make_detector, run_photos
from photos.policy import FaceCrop, Outcome, outcome
from photos.work import WorkFolder, content_key
from utils.cli import UsageError

logger = logging.getLogger(__name__)


def outcomes_of(photos: list[Photo], results: list[dict], landmarks: dict[int, np.ndarray], settings: Settings
                ) -> list[Outcome]:
    """Each photo's outcome under ``settings.policy`` from what ``run_photos`` made of it, with its copies marked
    (``photos.duplicates``)."""
    outcomes = []
    for index, result in enumerate(results):
        if "error" in result:
            logger.info("unreadable %s: %s", photos[index].name, result["error"])
            outcomes.append(Outcome("unreadable", result["error"], None))
        elif "aligned" in result:
            points = landmarks[index]
            if isinstance(result["aligned"], str):
                outcomes.append(Outcome("bad_landmarks", result["aligned"], None,
                                        FaceCrop(None, None, points, b"")))
            else:
                face = FaceCrop(None, None, points, result["aligned"])
                outcomes.append(Outcome("kept", "landmarks from --landmarks", None, kept=[face]))
        else:
            outcomes.append(outcome(result, settings.policy))
    copies = find_copies([r.get("key") for r in results], [r.get("thumb") for r in results],
                         [tuple(r["size"]) if "size" in r else None for r in results])
    for o, first in zip(outcomes, copies):
        o.duplicate_of = first
    return outcomes


def prepare(source: Path, out: Path, settings: Settings, device: torch.device, landmarks_file: Path | None = None,
            holdout: int = 0, max_pairs: int = 3000, seed: int = 0, workers: int = 0, overwrite: bool = False,
            model: Path | None = None, network: str | None = None, match_threshold: float = DEFAULT_THRESHOLD,
            work_opened: Callable[[WorkFolder, int], None] = lambda work, photos: None) -> str:
    """Write the training set of the photos ``source`` names into ``out``; the summary line. ``device`` runs the
    detector and the recognition ``model`` (``photos.matching.load_model``; ``network`` names its architecture
    where no model.json is beside it); ``work_opened`` is told the work folder and the number of photos once it is
    open. Raises ``UsageError``, ``BadData`` (``photos.pack.pack``), the model's loading errors and
    ``alignment.DetectorUnavailable``, all before anything is written."""
    if not source.exists():
        raise UsageError(f"PHOTOS_DIR {source} does not exist")
    aside = check_out_dir(out, source, overwrite)
    photos = sorted_photos(list_photo_folder(source) if source.is_dir() else read_photo_list(source))
    landmarks, landmarks_digest = {}, None
    if landmarks_file is not None:
        if not landmarks_file.is_file():
            raise UsageError(f"--landmarks {landmarks_file} is not a file")
        landmarks = read_landmarks(landmarks_file, source if source.is_dir() else source.parent, photos)
        landmarks_digest = content_key(landmarks_file.read_bytes())
    recognition = None if model is None else load_model(model, network, device)
    detector = make_detector(settings, device) if len(landmarks) < len(photos) else None
    out.mkdir(parents=True, exist_ok=True)
    work = WorkFolder(out, settings.detector)
    work.open()
    work_opened(work, len(photos))
    results = run_photos(photos, landmarks, work, settings, workers, detector)
    if reused := sum(bool(r.get("saved_before")) for r in results):
        logger.info("%d of %s detected in an earlier run (%s): not detected again", reused,
                    count(len(photos), "photo", "photos"), work.dir)
    outcomes = outcomes_of(photos, results, landmarks, settings)
    if recognition is not None:
        check_identities(photos, outcomes, embedder(recognition), match_threshold)
    stamp = {"tool": "scripts/prepare_faces.py", "input": str(source.resolve()), "settings": asdict(settings),
             "landmarks": landmarks_digest, "holdout": holdout, "pairs": max_pairs, "seed": seed,
             "model": None if model is None else str(model.resolve()), "network": network,
             "match_threshold": None if model is None else match_threshold}
    return pack(out, photos, outcomes, holdout, max_pairs, seed, stamp, aside)

