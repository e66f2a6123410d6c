"""Each photo's detections: read and hashed, decoded, its faces detected and every face aligned and encoded, saved
in the work folder (``photos.work``) as soon as the photo is done.

A photo whose content is in the work folder is neither decoded nor detected again. Photos are read in
``--workers`` processes (``DataLoader`` workers). On the CPU each of those processes also detects and aligns its
photos, one photo at a time, on one thread: MTCNN's small convolutions and per-box loops gain little from threads
or batches, processes scale with the cores, and a photo's detections are then a function of the photo alone (its
last bits depend on the thread count and on the other photos of a batch), so an interrupted run's continuation
gives the bytes of an uninterrupted one. Without workers the main process does the same. On a GPU the main
process detects the photos the workers decoded, ``batch_size`` at a time, where a batch may change a crop by a
rounding. Photos with given landmarks are aligned at them, not detected, and not saved. See docs/data.md
("From your own photos").
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.io import encode_jpeg

from alignment import FaceDetector, FacePolicy, PhotoError, align_face, detector_for, read_photo, read_photo_bytes
from alignment.detect import smallest_face_for
from photos.duplicates import thumbnail
from photos.listing import Photo
from photos.work import DetectorSettings, WorkFolder, content_key
from utils.cli import Progress

logger = logging.getLogger(__name__)

JPEG_QUALITY = 95


@dataclass(frozen=True)
class Settings:
    """The tool's settings of the photos' processing: the policy (``policy``) and the detection (``detector``, what
    the saved detections depend on)."""

    multi: str
    min_score: float
    min_face_size: float
    detect_size: int
    batch_size: int
    device: str  # the device type: detection on a GPU may differ from the CPU in the last bits

    @property
    def policy(self) -> FacePolicy:
        return FacePolicy(self.multi, self.min_score, self.min_face_size)

    @property
    def detector(self) -> DetectorSettings:
        # Faces from MTCNN's smallest up are found whatever --min-face-size is, so that another value needs no
        # detection; a smaller --min-face-size makes small photos be looked at enlarged.
        return DetectorSettings(self.detect_size, smallest_face_for(self.min_face_size), self.device)


def make_detector(settings: Settings, device: torch.device) -> FaceDetector:
    """The detector of ``settings``, reporting every face it finds: the policy applies the thresholds
    (``alignment.decide``), so that the report can say why a face was not counted. ``DetectorUnavailable``
    without facenet-pytorch."""
    return detector_for(settings.policy, device, detect_size=settings.detect_size, batch_size=settings.batch_size)


def crop(image: torch.Tensor, points: np.ndarray) -> bytes:
    """The face at ``points`` aligned, as JPEG bytes (libjpeg's output is a function of the pixels)."""
    return encode_jpeg(align_face(image, points).cpu(), quality=JPEG_QUALITY).numpy().tobytes()


@contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """Torch on one CPU thread while the block runs: detection's last bits depend on the thread count."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def detect_and_save(detector: FaceDetector, decoded: list[tuple[int, str, torch.Tensor, bytes]],
                    work: WorkFolder) -> list[tuple[int, dict]]:
    """Detect the faces of decoded photos ``(index, key, photo, thumbnail)``, align every face, save each photo's
    entry (``photos.work``: plain numbers and bytes) under its key; ``(index, entry with its key)`` of each."""
    with _one_thread(detector.device):
        found = detector.detect([d[2] for d in decoded])
        done = []
        for (index, key, image, thumb), faces in zip(decoded, found):
            entry = {"size": list(image.shape[1:]), "thumb": thumb, "faces": [
                {"box": list(face.box), "score": face.score, "points": np.asarray(face.points).reshape(-1).tolist(),
                 "jpeg": crop(image, face.points)} for face in faces]}
            work.save(key, entry)
            done.append((index, {**entry, "key": key}))
    return done


def _as_list(items: list) -> list:
    return items


class _Jobs(Dataset):
    """A photo's index -> ``(the index, what became of the photo)``: ``{"error": message}`` (unreadable), an
    entry of the work folder (``"faces"``; ``"saved_before"`` when it was there already), ``{"decoded": (key,
    photo, thumbnail)}`` for the main process to detect, or for given landmarks ``{"aligned": JPEG bytes
    or an error message, "size", "thumb"}``. With a ``detector`` (the CPU) the photos are detected where they are
    read."""

    def __init__(self, photos: list[Photo], landmarks: dict[int, np.ndarray], work: WorkFolder,
                 detector: FaceDetector | None) -> None:
        self.paths, self.landmarks, self.work, self.detector = [p.path for p in photos], landmarks, work, detector

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, dict]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[int, dict]]:
        items = [self._read(index) for index in indices]
        decoded = [(index, *item["decoded"]) for index, item in items if "decoded" in item]
        if self.detector is not None and decoded:
            detected = dict(detect_and_save(self.detector, decoded, self.work))
            items = [(index, detected.get(index, item)) for index, item in items]
        return items

    def _read(self, index: int) -> tuple[int, dict]:
        path = self.paths[index]
        try:
            data = read_photo_bytes(path)
            key = content_key(data)
            if index not in self.landmarks and (entry := self.work.load(key)) is not None:
                return index, {**entry, "key": key, "saved_before": True}
            image = read_photo(path, data=data)
        except PhotoError as exc:
            return index, {"error": str(exc).removeprefix(f"{path}: ")}
        if index not in self.landmarks:
            return index, {"decoded": (key, image, thumbnail(image))}
        try:
            aligned: bytes | str = crop(image, self.landmarks[index])
        except ValueError as exc:  # points that fit no similarity (all the same point)
            aligned = str(exc)
        return index, {"key": key, "size": list(image.shape[1:]), "thumb": thumbnail(image), "aligned": aligned}


def run_photos(photos: list[Photo], landmarks: dict[int, np.ndarray], work: WorkFolder, settings: Settings,
               workers: int, detector: FaceDetector | None) -> list[dict[str, Any]]:
    """What became of every photo (``_Jobs``' items), in the photos' order."""
    results: list[dict[str, Any] | None] = [None] * len(photos)
    on_cpu = detector is None or detector.device.type == "cpu"
    jobs = _Jobs(photos, landmarks, work, detector if on_cpu else None)
    # A GPU detects a batch at once; on the CPU a photo is detected alone (as fast, the same bytes whatever the
    # batch, and every process busy to the end).
    loader = DataLoader(jobs, batch_size=1 if on_cpu else settings.batch_size, num_workers=workers,
                        collate_fn=_as_list)
    progress = Progress(len(photos), "photos", lambda line: logger.info("%s", line))
    try:
        for batch in loader:
            decoded = [(index, *item["decoded"]) for index, item in batch if "decoded" in item]
            if decoded:  # a GPU: detected here, in batches
                assert detector is not None, "photos to detect but no detector"
                batch = [*[(index, item) for index, item in batch if "decoded" not in item],
                         *detect_and_save(detector, decoded, work)]
            for index, item in batch:
                results[index] = item
            progress.update(len(batch))
    finally:
        progress.close()
    assert all(r is not None for r in results), "a photo without a result"
    return results  # type: ignore[return-value]
