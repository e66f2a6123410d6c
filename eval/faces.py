"""The face crops the tools embed, from photo files: aligned by the detector, or taken as aligned crops.

Every photo is read by ``alignment.read_photo`` (any format Pillow reads, EXIF orientation applied), so
``scripts/inference.py`` and ``scripts/compare.py`` see the same pixels, and the training decoder
(``dataset.images.decode``) sees them too for the same file. With a detector the face is found and aligned onto
the ArcFace template (``alignment.align_photo``); without, the photo is taken as an aligned 112x112 crop, another
size resized. docs/evaluation.md#raw-photos-and-comparing-two-faces describes both.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from alignment import CROP_SIZE, DetectorUnavailable, FaceDetector, align_photo, read_photo
from dataset.images import resize
from utils.cli import UsageError


def face_detector(device: torch.device | str) -> FaceDetector:
    """The detector the tools align photos with, on ``device``; ``utils.cli.UsageError`` (exit status 2) whose
    message is the command that installs ``facenet-pytorch`` when it is missing."""
    try:
        return FaceDetector(device=device)
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


def face_crop(path: str | os.PathLike, detector: FaceDetector | None,
              warn: Callable[[str], None] | None = None) -> torch.Tensor:
    """The (3, 112, 112) uint8 face crop of the photo at ``path``: the face ``detector`` finds, aligned
    (``alignment.align_photo``: the largest face nearest the centre), or with ``detector=None`` the photo as a
    crop (``read_crop``). ``alignment.PhotoError`` (a ``ValueError``) naming the file when it cannot be read or
    holds no face."""
    return align_photo(path, detector) if detector is not None else read_crop(path, warn)
