"""Faces and their five landmarks in photos: MTCNN from the optional ``facenet-pytorch`` package, in batches.

Every photo is scaled (keeping its aspect ratio) and padded into one ``detect_size`` square canvas, so photos of
any size go through the detector together, in batches of a fixed shape; boxes and landmarks come back in the
photo's own pixels. ``facenet-pytorch`` carries its networks' weights in its wheel, so detection works offline.
Its metadata pins old releases of torch, numpy and Pillow; install it without its dependencies
(``pip install --no-deps facenet-pytorch==2.6.0``, after ``pip install requests``, which it imports).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

INSTALL = "pip install requests && pip install --no-deps facenet-pytorch==2.6.0"


class DetectorUnavailable(RuntimeError):
    """The face detector's package is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Face:
    """One detected face, in the photo's pixels: ``box`` (x0, y0, x1, y1), ``score`` in [0, 1], ``points`` (5, 2):
    left eye, right eye, nose, left and right mouth corners (the subject's left eye is on the image's left)."""

    box: tuple[float, float, float, float]
    score: float
    points: np.ndarray

    @property
    def size(self) -> float:
        """The box's shorter side, in pixels."""
        return min(self.box[2] - self.box[0], self.box[3] - self.box[1])


class FaceDetector:
    """MTCNN over batches of photos: ``detect(images)`` gives every face of each photo above ``min_score`` and at
    least ``min_face_size`` pixels (shorter box side, in the photo's pixels), highest score first.

    ``images`` are (3, H, W) uint8 tensors of any sizes. Each is resized so that its longer side is
    ``detect_size`` pixels and padded with black to a ``detect_size`` square; ``batch_size`` of them go through
    the networks together (on ``device``: the CPU, or a GPU where the photos are many).

    With ``refine`` (the default) each face's landmarks are found a second time in an upright view of it:
    the face warped by the similarity that puts its first landmarks on the ArcFace template, centred in a
    ``REFINE_SIZE`` square. MTCNN's landmarks are best on upright faces: on the test photo rotated by 30°, the
    first pass is up to 3.7 px off and the second 0.8 px. The second pass's points are mapped back to the photo.
    """

    REFINE_SIZE = 224

    def __init__(self, device: torch.device | str = "cpu", min_score: float = 0.9, min_face_size: float = 40.0,
                 detect_size: int = 640, batch_size: int = 16, refine: bool = True) -> None:
        try:
            from facenet_pytorch import MTCNN
        except ImportError as exc:
            raise DetectorUnavailable(f"face detection needs the facenet-pytorch package ({exc}); install it "
                                      f"with: {INSTALL}") from exc
        self.device = torch.device(device)
        self.min_score, self.min_face_size = float(min_score), float(min_face_size)
        self.detect_size, self.batch_size, self.refine = int(detect_size), int(batch_size), bool(refine)
        self._mtcnn = MTCNN(keep_all=True, device=self.device)

    def _canvas(self, image: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(detect_size, detect_size, 3) float32 canvas of ``image``, and the photo-to-canvas scale."""
        height, width = image.shape[1:]
        scale = self.detect_size / max(height, width)
        h, w = max(1, round(height * scale)), max(1, round(width * scale))
        resized = F.interpolate(image[None].to(self.device, torch.float32), size=(h, w), mode="bilinear",
                                antialias=scale < 1, align_corners=False)[0]  # (3, h, w)
        canvas = resized.new_zeros((3, self.detect_size, self.detect_size))
        canvas[:, :h, :w] = resized.clamp_(0, 255)
        # The canvas pixel (x, y) shows the photo at ((x + 0.5) / scale - 0.5, ...) with pixel centres at integers;
        # keep the exact ratio of the sizes used, which differs from `scale` by rounding.
        return canvas.permute(1, 2, 0), (w / width + h / height) / 2

    @torch.no_grad()
    def detect(self, images: Sequence[torch.Tensor]) -> list[list[Face]]:
        """The faces of each photo, highest score first."""
        out: list[list[Face]] = []
        for start in range(0, len(images), self.batch_size):
            chunk = images[start:start + self.batch_size]
            canvases, scales = zip(*(self._canvas(image) for image in chunk))
            boxes, scores, points = self._mtcnn.detect(torch.stack(canvases), landmarks=True)
            for image, scale, b, s, p in zip(chunk, scales, boxes, scores, points):
                faces = []
                if b is not None:
                    for box, score, pts in zip(np.asarray(b, np.float64), np.asarray(s, np.float64),
                                               np.asarray(p, np.float64)):
                        box = (box + 0.5) / scale - 0.5
                        face = Face(tuple(float(v) for v in box), float(score), (pts + 0.5) / scale - 0.5)
                        if face.score >= self.min_score and face.size >= self.min_face_size:
                            faces.append(face)
                out.append(sorted(faces, key=lambda f: -f.score))
        if self.refine:
            pairs = [(image, face) for image, faces in zip(images, out) for face in faces]
            refined = iter(self._refined_points(pairs))
            out = [[Face(face.box, face.score, next(refined)) for face in faces] for faces in out]
        return out

    def _refined_points(self, pairs: list[tuple[torch.Tensor, Face]]) -> list[np.ndarray]:
        """The landmarks of each (photo, face) found again in an upright ``REFINE_SIZE`` view of the face; the
        first pass's where the second finds no face there."""
        from alignment.template import ARCFACE_TEMPLATE, apply_transform, similarity_transform, warp_to_template

        size = self.REFINE_SIZE
        target = ARCFACE_TEMPLATE + (size - 112) / 2  # the template, centred in the view
        points = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start:start + self.batch_size]
            matrices = [similarity_transform(face.points, target) for _, face in chunk]
            views = torch.stack([warp_to_template(image.to(self.device), matrix, size).permute(1, 2, 0)
                                 for (image, _), matrix in zip(chunk, matrices)]).float()  # (n, size, size, 3)
            _, _, found = self._mtcnn.detect(views, landmarks=True)
            for (_, face), matrix, candidates in zip(chunk, matrices, found):
                if candidates is None or len(candidates) == 0:
                    points.append(face.points)
                    continue
                nearest = min(np.asarray(candidates, np.float64), key=lambda p: float(np.abs(p - target).sum()))
                back = np.linalg.inv(np.vstack([matrix, [0.0, 0.0, 1.0]]))[:2]  # view -> photo
                points.append(apply_transform(back, nearest))
        return points


def choose_faces(faces: list[Face], photo_size: tuple[int, int], multi: str = "largest") -> list[Face]:
    """The faces of one photo to keep: ``multi = "largest"`` the largest face, the one nearest the photo's centre
    among faces within 10 % of that size; ``"skip"`` the only face, or none when there are several; ``"all"``
    every face. ``photo_size`` is (H, W)."""
    if multi not in ("largest", "skip", "all"):
        raise ValueError(f"multi = {multi!r}; expected largest, skip or all")
    if multi == "all" or len(faces) <= 1:
        return list(faces)
    if multi == "skip":
        return []
    height, width = photo_size
    largest = max(face.size for face in faces)
    near = [face for face in faces if face.size >= 0.9 * largest]

    def off_centre(face: Face) -> float:
        cx, cy = (face.box[0] + face.box[2]) / 2, (face.box[1] + face.box[3]) / 2
        return (cx - (width - 1) / 2) ** 2 + (cy - (height - 1) / 2) ** 2

    return [min(near, key=off_centre)]
