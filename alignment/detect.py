"""Faces and their five landmarks in photos: MTCNN from the optional ``facenet-pytorch`` package, in batches.

Each photo is looked at on a canvas no larger than its scale needs (``detection_scale``): a large photo is shrunk
to fit ``detect_size``, a small one is not enlarged beyond what lets MTCNN see its smallest face of interest;
photos whose canvases have the same size go through the networks together. Boxes and landmarks come back in the
photo's own pixels. A photo's faces do not depend on the photos beside it in a batch (tests/test_alignment.py
checks it on the CPU). ``facenet-pytorch`` carries its networks' weights in its wheel, so detection works
offline. Its metadata pins old releases of torch, numpy and Pillow; install it without its dependencies
(``pip install --no-deps facenet-pytorch==2.6.0``, after ``pip install requests``, which it imports).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

INSTALL = "pip install requests && pip install --no-deps facenet-pytorch==2.6.0"
MTCNN_MIN_FACE = 20  # the smallest face MTCNN looks for, in pixels of the canvas it is given (its default)


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


def detection_scale(height: int, width: int, detect_size: int, smallest_face: float) -> float:
    """The scale a (height, width) photo is detected at: shrunk to fit a ``detect_size`` square, and never enlarged
    beyond what makes a face of ``smallest_face`` pixels MTCNN's smallest (1 for the usual 20; ``smallest_face``
    0: enlarged to fit the square)."""
    fit = detect_size / max(height, width)
    return fit if smallest_face <= 0 else min(fit, MTCNN_MIN_FACE / smallest_face)


class FaceDetector:
    """MTCNN over batches of photos: ``detect(images)`` gives every face of each photo above ``min_score`` and at
    least ``min_face_size`` pixels (shorter box side, in the photo's pixels), highest score first.

    ``images`` are (3, H, W) uint8 tensors of any sizes. Each is resized by ``detection_scale`` (``detect_size``;
    ``smallest_face``: the smallest face, in the photo's pixels, a small photo must still show MTCNN; by default
    ``min_face_size``'s, at most MTCNN's own 20), and ``batch_size`` photos of one canvas size go through the
    networks together (on ``device``: the CPU, or a GPU where the photos are many).

    With ``refine`` (the default) each face's landmarks are found a second time in an upright view of it:
    the face warped from the full photo by the similarity that puts its first landmarks on the ArcFace template,
    centred in a ``REFINE_SIZE`` square, where MTCNN looks only for faces of about that size
    (``REFINE_MIN_FACE``), and in that view's mirror image; the two are averaged and mapped back to the photo.
    MTCNN's landmarks are best on upright faces (on the test photo rotated by 30°, the first pass is a few pixels
    off), and it does not place them symmetrically: the mirrored view makes a mirrored photo's points the
    mirror image of the original's.
    """

    REFINE_SIZE = 224
    REFINE_MIN_FACE = 48  # the face in the view is 80-90 px: its pyramid starts at 12/48 instead of 12/20

    def __init__(self, device: torch.device | str = "cpu", min_score: float = 0.9, min_face_size: float = 40.0,
                 detect_size: int = 640, batch_size: int = 16, refine: bool = True,
                 smallest_face: float | None = None) -> None:
        try:
            from facenet_pytorch import MTCNN
        except ImportError as exc:
            raise DetectorUnavailable(f"face detection needs the facenet-pytorch package ({exc}); install it "
                                      f"with: {INSTALL}") from exc
        self.device = torch.device(device)
        self.min_score, self.min_face_size = float(min_score), float(min_face_size)
        self.smallest_face = float(min(min_face_size, MTCNN_MIN_FACE) if smallest_face is None else smallest_face)
        self.detect_size, self.batch_size, self.refine = int(detect_size), int(batch_size), bool(refine)
        self._mtcnn = MTCNN(keep_all=True, device=self.device)
        self._refine_mtcnn = MTCNN(keep_all=True, device=self.device, min_face_size=self.REFINE_MIN_FACE)

    def scale(self, height: int, width: int) -> float:
        """The scale a (height, width) photo is detected at (``detection_scale``)."""
        return detection_scale(height, width, self.detect_size, self.smallest_face)

    def _canvas(self, image: torch.Tensor, reduced: torch.Tensor) -> tuple[torch.Tensor, tuple[float, float]]:
        """(h, w, 3) float32 canvas of ``image`` (made from ``reduced``, a smaller copy of it, or itself), and the
        photo-to-canvas scales along x and y."""
        height, width = image.shape[1:]
        scale = self.scale(height, width)
        h, w = max(1, round(height * scale)), max(1, round(width * scale))
        source = reduced.to(self.device, torch.float32)[None]  # (1, 3, h', w')
        if source.shape[2:] != (h, w):
            source = F.interpolate(source, size=(h, w), mode="bilinear", antialias=h < reduced.shape[1],
                                   align_corners=False)
        # The canvas pixel (x, y) shows the photo at ((x + 0.5) / sx - 0.5, ...) with pixel centres at integers, sx
        # the exact ratio of the sizes (which differs from `scale` by rounding).
        return source[0].clamp_(0, 255).permute(1, 2, 0), (w / width, h / height)

    @torch.no_grad()
    def detect(self, images: Sequence[torch.Tensor], reduced: Sequence[torch.Tensor] | None = None
               ) -> list[list[Face]]:
        """The faces of each photo, highest score first. ``reduced[i]``, when given, is a smaller copy of
        ``images[i]`` (e.g. ``alignment.read_photo_reduced``'s) to make its canvas from; the faces are still in
        ``images[i]``'s pixels and their landmarks refined there."""
        reduced = images if reduced is None else reduced
        canvases = [self._canvas(image, small) for image, small in zip(images, reduced)]
        out: list[list[Face]] = [[] for _ in images]
        by_size: dict[tuple[int, ...], list[int]] = {}
        for k, (canvas, _) in enumerate(canvases):
            by_size.setdefault(tuple(canvas.shape), []).append(k)
        for members in by_size.values():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                boxes, scores, points = self._mtcnn.detect(torch.stack([canvases[k][0] for k in chunk]),
                                                           landmarks=True)
                for k, b, s, p in zip(chunk, boxes, scores, points):
                    out[k] = self._faces(b, s, p, canvases[k][1])
        if self.refine:
            pairs = [(image, face) for image, faces in zip(images, out) for face in faces]
            refined = iter(self._refined_points(pairs))
            out = [[Face(face.box, face.score, next(refined)) for face in faces] for faces in out]
        return out

    def _faces(self, boxes, scores, points, scale: tuple[float, float]) -> list[Face]:
        """MTCNN's detections on one canvas as faces in the photo's pixels, above the thresholds, best first."""
        if boxes is None:
            return []
        sx, sy = scale
        faces = []
        for box, score, pts in zip(np.asarray(boxes, np.float64), np.asarray(scores, np.float64),
                                   np.asarray(points, np.float64)):
            box = (box + 0.5) / np.array([sx, sy, sx, sy]) - 0.5
            face = Face(tuple(float(v) for v in box), float(score), (pts + 0.5) / np.array([sx, sy]) - 0.5)
            if face.score >= self.min_score and face.size >= self.min_face_size:
                faces.append(face)
        return sorted(faces, key=lambda f: -f.score)

    def _refined_points(self, pairs: list[tuple[torch.Tensor, Face]]) -> list[np.ndarray]:
        """The landmarks of each (photo, face) found again in an upright ``REFINE_SIZE`` view of the face and in
        the view's mirror image (its points mirrored back), averaged; the first pass's where the second finds no
        face there."""
        from alignment.template import ARCFACE_TEMPLATE, apply_transform, similarity_transform, warp_to_template

        size = self.REFINE_SIZE
        target = ARCFACE_TEMPLATE + (size - 112) / 2  # the template, centred in the view

        def mirrored(points: np.ndarray) -> np.ndarray:  # (5, 2) across the view's vertical axis, left <-> right
            return np.stack([size - 1 - points[:, 0], points[:, 1]], axis=1)[[1, 0, 2, 4, 3]]

        points = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start:start + self.batch_size]
            matrices = [similarity_transform(face.points, target) for _, face in chunk]
            views = torch.stack([warp_to_template(image.to(self.device), matrix, size).permute(1, 2, 0)
                                 for (image, _), matrix in zip(chunk, matrices)]).float()  # (n, size, size, 3)
            _, _, found = self._refine_mtcnn.detect(torch.cat([views, views.flip(2)]), landmarks=True)
            for k, ((_, face), matrix) in enumerate(zip(chunk, matrices)):
                seen = []
                for candidates, expected, back in ((found[k], target, None), (found[len(chunk) + k], mirrored(target),
                                                                             mirrored)):
                    if candidates is not None and len(candidates):
                        nearest = min(np.asarray(candidates, np.float64),
                                      key=lambda p: float(np.abs(p - expected).sum()))
                        seen.append(nearest if back is None else back(nearest))
                if not seen:
                    points.append(face.points)
                    continue
                to_photo = np.linalg.inv(np.vstack([matrix, [0.0, 0.0, 1.0]]))[:2]  # view -> photo
                points.append(apply_transform(to_photo, np.mean(seen, axis=0)))
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
