"""Each photo's result: decoded on worker processes, faces detected in batches, the policy applied, the kept faces
aligned and encoded, saved chunk by chunk in the work folder.

A result is a dict: ``status``, ``faces`` (counted; None without detection), ``reason``, ``score``/``box``/
``points`` of the face the report shows, and ``crops`` (per kept face: its JPEG as a uint8 tensor and its
score, box and points). Detection batches never cross a chunk, so a continued run detects in the batches of an
uninterrupted one. See docs/data.md ("From your own photos").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.io import encode_jpeg
from tqdm import tqdm

from alignment import Face, FaceDetector, PhotoError, align_face, read_photo
from photos.listing import Photo
from photos.policy import FacePolicy, decide
from photos.work import WorkFolder

logger = logging.getLogger(__name__)

JPEG_QUALITY = 95


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

    @property
    def policy(self) -> FacePolicy:
        return FacePolicy(self.multi, self.min_score, self.min_face_size)


def _face_fields(face: Face | None) -> dict[str, Any]:
    if face is None:
        return {"score": None, "box": None, "points": None}
    return {"score": face.score, "box": [float(v) for v in face.box],
            "points": [float(v) for v in np.asarray(face.points).reshape(-1)]}


def crop(image: torch.Tensor, points: np.ndarray) -> torch.Tensor:
    """The face at ``points`` aligned, as JPEG bytes in a uint8 tensor (libjpeg's output is a function of the
    pixels)."""
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
            logger.info("unreadable %s: %s", photos[index].name, reason)
            results[index] = {"status": "unreadable", "faces": None, "reason": reason, "crops": [],
                              **_face_fields(None)}
        elif index in landmarks:
            points = landmarks[index]
            fields = {"score": None, "box": None, "points": [float(v) for v in points.reshape(-1)]}
            try:
                crops = [{"jpeg": crop(image, points), **fields}]
                status, reason = "kept", "landmarks from --landmarks"
            except ValueError as exc:  # points that fit no similarity (all the same point)
                crops, status, reason = [], "bad_landmarks", str(exc)
            results[index] = {"status": status, "faces": None, "reason": reason, "crops": crops, **fields}
        else:
            to_detect.append((index, image))
    if to_detect:
        assert detector is not None, "photos to detect but no detector"
        for (index, image), faces in zip(to_detect, detector.detect([image for _, image in to_detect])):
            decision = decide(faces, tuple(image.shape[1:]), settings.policy)
            crops = [{"jpeg": crop(image, face.points), **_face_fields(face)} for face in decision.keep]
            results[index] = {"status": decision.status, "faces": decision.counted, "reason": decision.reason,
                              "crops": crops, **_face_fields(decision.shown)}
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
    with tqdm(total=len(photos), initial=len(photos) - len(pending), desc="prepare_faces", unit="photo",
              disable=None) as bar:
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
