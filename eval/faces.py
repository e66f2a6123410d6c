"""The face crops the tools embed, from photo files: aligned by the detector, or taken as aligned crops.

Every photo is read by ``alignment.read_photo`` (any format Pillow reads, EXIF orientation applied), so
``scripts/inference.py`` and ``scripts/compare.py`` see the same pixels, and the training decoder
(``dataset.images.decode``) sees them too for the same file. With a detector the face is found and aligned onto
the ArcFace template (``alignment.align_photo``: the largest face nearest the centre of those above the
``FacePolicy`` thresholds, and the tools say which); without, the photo is taken as an aligned 112x112 crop,
another size resized. docs/evaluation.md#raw-photos-and-comparing-two-faces describes both.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from alignment import (
    CROP_SIZE,
    LARGEST,
    DetectorUnavailable,
    FaceDetector,
    FacePolicy,
    align_photo,
    detector_for,
    read_photo,
)
from dataset.images import resize
from utils.cli import UsageError


def face_detector(device: torch.device | str, policy: FacePolicy) -> FaceDetector:
    """The detector the tools align photos with under ``policy``, on ``device``; ``utils.cli.UsageError`` (exit
    status 2) whose message is the command that installs ``facenet-pytorch`` when it is missing."""
    try:
        return detector_for(policy, device)
    except DetectorUnavailable as exc:
        raise UsageError(str(exc)) from None


def read_crop(path: str | os.PathLike, warn: Callable[[str], None] | None = None) -> torch.Tensor:
    """The photo at ``path`` taken as an aligned face crop: (3, 112, 112) uint8, resized (bilinear, antialiased)
    when the photo is another size, which ``warn(message)`` is told."""
    image = read_photo(path)  # (3, h, w)
    if tuple(image.shape[1:]) != (CROP_SIZE, CROP_SIZE):
        if warn is not None:
            warn(f"{path} is {image.shape[2]}x{image.shape[1]}, not {CROP_SIZE}x{CROP_SIZE}: resized; is it an "
                 f"aligned crop?")
        image = resize(image, (CROP_SIZE, CROP_SIZE))
    return image


def face_crop(path: str | os.PathLike, detector: FaceDetector | None, policy: FacePolicy = LARGEST,
              warn: Callable[[str], None] | None = None, say: Callable[[str], None] | None = None) -> torch.Tensor:
    """The (3, 112, 112) uint8 face crop of the photo at ``path``: the face ``detector`` finds that ``policy``
    keeps, aligned (``alignment.align_photo``), which ``say(line)`` is told (how many faces counted, which was
    used); or with ``detector=None`` the photo as a crop (``read_crop``). ``alignment.PhotoError`` (a
    ``ValueError``) naming the file when it cannot be read or no face counts, saying why."""
    if detector is None:
        return read_crop(path, warn)
    crop, decision = align_photo(path, detector, policy)
    if say is not None:  # the reason: "the largest of 3 faces, nearest the centre[; 1 more below ...]", or
        face = decision.keep[0]  # for one face "" or "1 more below --min-score/--min-face-size"
        only = "the only face counted" if decision.reason else "the only face found"
        reason = decision.reason if decision.counted > 1 else "; ".join(filter(None, [only, decision.reason]))
        say(f"{path}: used a {face.size:.0f} px face (score {face.score:.3f}): {reason}")
    return crop
