"""Faces and their five landmarks in photos: MTCNN from the optional ``facenet-pytorch`` package, in batches.

Each photo is looked at on a canvas no larger than its scale needs (``detection_scale``): a large photo is shrunk
to fit ``detect_size`` (in uint8, where it is decoded), a small one is not enlarged beyond what lets MTCNN see its
smallest face of interest; photos whose canvases have the same size go through the networks together (the batch
changes a photo's faces only in their last bits). Boxes and landmarks come back in the photo's own pixels.
``facenet-pytorch`` carries its networks' weights in its wheel, so detection works offline. Its metadata pins old
releases of torch, numpy and Pillow; install it without its dependencies (``pip install --no-deps
facenet-pytorch==2.6.0``, after ``pip install requests``, which it imports).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def smallest_face_for(min_face_size: float) -> float:
    """The smallest face, in the photo's pixels, a small photo must still show MTCNN when faces from
    ``min_face_size`` up are of interest: that size, at most MTCNN's own 20 (faces from MTCNN's smallest up are
    found whatever the threshold is; a smaller one makes small photos be looked at enlarged)."""
    return float(min(min_face_size, MTCNN_MIN_FACE))


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

    With ``refine`` (the default) each face's landmarks are found a second time by MTCNN's last network (O-Net)
    alone, in an upright view of the face warped from the full photo (the similarity that puts its first
    landmarks on the ArcFace template, framed by its box as MTCNN frames O-Net's input) and in that view's mirror
    image; the two are averaged and mapped back to the photo. MTCNN's landmarks are best on upright faces (on the
    test photo rotated by 30°, the first pass is a few pixels off), and it does not place them symmetrically: the
    mirrored view makes a mirrored photo's points the mirror image of the original's.
    """

    ONET_SIZE = 48  # O-Net's input
    SUPERSAMPLE = 4  # the view is warped at 4x and averaged down, as MTCNN resamples its crops (by area)

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
        self.smallest_face = smallest_face_for(min_face_size) if smallest_face is None else float(smallest_face)
        self.detect_size, self.batch_size, self.refine = int(detect_size), int(batch_size), bool(refine)
        # Channels last: MTCNN's inputs are crops of a channels-last photo, and its pooling runs several times faster
        # on them (the CPU's NCHW max-pooling with ceil_mode is slow).
        self._mtcnn = MTCNN(keep_all=True, device=self.device).to(memory_format=torch.channels_last)

    def _canvas(self, image: torch.Tensor) -> tuple[torch.Tensor, tuple[float, float]]:
        """(h, w, 3) float32 canvas of ``image`` on the detector's device, and the photo-to-canvas scales along x
        and y. The photo is resized where it is, in uint8 (antialiased when shrunk: a few milliseconds for 12
        megapixels on one CPU core, where a float copy of it alone takes far longer), and only the canvas moves."""
        height, width = image.shape[1:]
        scale = detection_scale(height, width, self.detect_size, self.smallest_face)
        h, w = max(1, round(height * scale)), max(1, round(width * scale))
        canvas = image[None]  # (1, 3, H, W) uint8
        if (h, w) != (height, width):
            canvas = F.interpolate(canvas, size=(h, w), mode="bilinear", antialias=h < height, align_corners=False)
        # The canvas pixel (x, y) shows the photo at ((x + 0.5) / sx - 0.5, ...) with pixel centres at integers, sx
        # the exact ratio of the sizes (which differs from `scale` by rounding).
        return canvas[0].to(self.device, torch.float32).permute(1, 2, 0), (w / width, h / height)

    @torch.no_grad()
    def detect(self, images: Sequence[torch.Tensor]) -> list[list[Face]]:
        """The faces of each photo, highest score first; ``images`` stay where they are (the CPU, as
        ``read_photo`` gives them): what goes to the device is their canvases and the views of their faces."""
        canvases = [self._canvas(image) for image in images]
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
        """The landmarks of each (photo, face) found again by MTCNN's last network (O-Net) in an upright view of
        the face and in that view's mirror image (its points mirrored back), averaged and mapped to the photo."""
        from alignment.template import apply_transform, warp_to_template

        size, fine = self.ONET_SIZE, self.ONET_SIZE * self.SUPERSAMPLE
        points = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start:start + self.batch_size]
            matrices = [self._onet_view(face) for _, face in chunk]  # photo -> O-Net input, (2, 3) each
            upscale = np.diag([self.SUPERSAMPLE, self.SUPERSAMPLE, 1.0])
            views = torch.stack([warp_to_template(image, (upscale @ np.vstack([m, [0, 0, 1]]))[:2]
                                                  + [[0, 0, (self.SUPERSAMPLE - 1) / 2]] * 2, fine).to(self.device)
                                 for (image, _), m in zip(chunk, matrices)]).float()  # (n, 3, fine, fine)
            views = F.interpolate(views, size=(size, size), mode="area")  # (n, 3, 48, 48): MTCNN's own resampling
            both = (torch.cat([views, views.flip(3)]) - 127.5) * 0.0078125  # (2n, 3, 48, 48), as MTCNN scales
            _, found, _ = self._mtcnn.onet(both.contiguous(memory_format=torch.channels_last))  # (2n, 10): 5 x, 5 y
            found = found.double().cpu().numpy()
            for k, matrix in enumerate(matrices):
                seen = []
                for row, mirrored in ((k, False), (len(chunk) + k, True)):
                    # O-Net gives each point as a fraction of the input's side; pixel centres are at integers.
                    p = np.stack([found[row, :5], found[row, 5:]], axis=1) * size - 0.5  # (5, 2)
                    if mirrored:  # across the vertical axis, left <-> right
                        p = np.stack([size - 1 - p[:, 0], p[:, 1]], axis=1)[[1, 0, 2, 4, 3]]
                    seen.append(p)
                to_photo = np.linalg.inv(np.vstack([matrix, [0.0, 0.0, 1.0]]))[:2]
                points.append(apply_transform(to_photo, np.mean(seen, axis=0)))
        return points

    def _onet_view(self, face: Face) -> np.ndarray:
        """The (2, 3) similarity from the photo to O-Net's upright input for ``face``: the rotation and scale that
        put its landmarks on the ArcFace template, and the square of its box's longer side around the box's centre
        (the framing MTCNN gives O-Net) onto the ``ONET_SIZE`` square."""
        from alignment.template import ARCFACE_TEMPLATE, apply_transform, similarity_transform

        to_template = similarity_transform(face.points, ARCFACE_TEMPLATE)  # (2, 3)
        x0, y0, x1, y1 = face.box
        centre = apply_transform(to_template, np.array([[(x0 + x1) / 2, (y0 + y1) / 2]]))[0]
        side = max(x1 - x0, y1 - y0) * float(np.sqrt(abs(np.linalg.det(to_template[:, :2]))))
        k = self.ONET_SIZE / side
        # Template -> input: the square's edges onto the input's edges (pixel centres at 0 .. ONET_SIZE - 1).
        to_input = np.array([[k, 0.0, -k * (centre[0] - side / 2) - 0.5], [0.0, k, -k * (centre[1] - side / 2) - 0.5]])
        return (np.vstack([to_input, [0.0, 0.0, 1.0]]) @ np.vstack([to_template, [0.0, 0.0, 1.0]]))[:2]


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
