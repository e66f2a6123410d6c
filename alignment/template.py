"""The 5-point similarity transform onto the ArcFace template, and the warp that applies it.

Coordinates are in pixels with pixel centres at integers (x to the right, y down), the convention of the template
and of the landmark detectors: the centre of the top-left pixel is (0, 0).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

CROP_SIZE = 112
# The standard ArcFace template for 112x112 crops: left eye, right eye, nose tip, left and right mouth corners
# (the subject's left eye is on the image's left).
ARCFACE_TEMPLATE = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655],
                             [70.7299, 92.2041]], dtype=np.float64)


def similarity_transform(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The least-squares similarity (rotation, uniform scale, translation; no reflection) taking the points
    ``src (K, 2)`` to ``dst (K, 2)``, as a (2, 3) matrix ``M`` with ``dst ≈ M @ [x, y, 1]`` (Umeyama, 1991).

    With ``c`` the centred points and ``Σ = cov(dst, src) = U S Vᵀ``: ``R = U diag(1, d) Vᵀ`` with ``d`` the sign of
    ``det(U) det(V)`` (a reflection is never returned), ``scale = tr(S diag(1, d)) / var(src)``, ``t = mean(dst) −
    scale · R mean(src)``. Computed in float64.
    """
    src, dst = np.asarray(src, dtype=np.float64), np.asarray(dst, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2 or src.shape[0] < 2:
        raise ValueError(f"similarity_transform needs two (K, 2) point sets with K >= 2; got {src.shape} and "
                         f"{dst.shape}")
    mean_src, mean_dst = src.mean(0), dst.mean(0)
    src_c, dst_c = src - mean_src, dst - mean_dst
    var_src = (src_c ** 2).sum(1).mean()
    if var_src == 0:
        raise ValueError("similarity_transform: the source points are all the same point")
    u, s, vt = np.linalg.svd(dst_c.T @ src_c / len(src))
    d = np.array([1.0, np.sign(np.linalg.det(u) * np.linalg.det(vt)) or 1.0])
    rotation = u @ np.diag(d) @ vt
    scale = (s * d).sum() / var_src
    matrix = np.empty((2, 3))
    matrix[:, :2] = scale * rotation
    matrix[:, 2] = mean_dst - scale * rotation @ mean_src
    return matrix


def apply_transform(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``points (K, 2)`` mapped by the (2, 3) ``matrix``."""
    points = np.asarray(points, dtype=np.float64)
    return points @ matrix[:, :2].T + matrix[:, 2]


def warp_to_template(image: torch.Tensor, matrix: np.ndarray, size: int = CROP_SIZE) -> torch.Tensor:
    """The ``size x size`` crop whose pixel ``(x, y)`` is ``image`` at ``M⁻¹ (x, y)``: ``image`` (3, H, W) uint8 (any
    device), ``matrix`` (2, 3) from photo to crop coordinates. Bilinear interpolation (``grid_sample``); where the
    crop reaches outside the photo it is black, as in the insightface crops. Returns (3, size, size) uint8.

    Only the photo's pixels under the crop (its corners' preimages and one pixel around them, for the bilinear
    neighbours) are converted to float and sampled, so the cost does not grow with the photo's size."""
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"warp_to_template needs a (3, H, W) uint8 image; got {tuple(image.shape)} {image.dtype}")
    height, width = image.shape[1:]
    inverse = np.linalg.inv(np.vstack([matrix, [0.0, 0.0, 1.0]]))[:2]  # crop -> photo
    corners = apply_transform(inverse, np.array([[0.0, 0.0], [size - 1, 0.0], [0.0, size - 1], [size - 1, size - 1]]))
    x0, y0 = (max(int(np.floor(v)) - 1, 0) for v in corners.min(0))
    x1, y1 = min(int(np.floor(corners[:, 0].max())) + 2, width), min(int(np.floor(corners[:, 1].max())) + 2, height)
    if x0 >= x1 or y0 >= y1:  # the crop lies wholly outside the photo
        return torch.zeros((3, size, size), dtype=torch.uint8, device=image.device)
    region = image[:, y0:y1, x0:x1]  # (3, h, w): every pixel a crop pixel's bilinear sample reads
    inverse[:, 2] -= (x0, y0)  # crop -> region
    height, width = y1 - y0, x1 - x0
    # Region pixel coordinates of every crop pixel centre, then grid_sample's [-1, 1] with align_corners=True
    # (-1 and 1 are the centres of the first and last pixels).
    to_unit = np.array([[2.0 / max(width - 1, 1), 0.0, -1.0], [0.0, 2.0 / max(height - 1, 1), -1.0]])
    theta = to_unit @ np.vstack([inverse, [0.0, 0.0, 1.0]])  # (2, 3): crop pixel (x, y, 1) -> unit region coords
    coords = torch.arange(size, dtype=torch.float64, device=image.device)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")  # (size, size) each
    pixels = torch.stack([xs, ys, torch.ones_like(xs)], dim=-1)  # (size, size, 3)
    grid = pixels @ torch.as_tensor(theta, device=image.device).T  # (size, size, 2) as (x, y)
    crop = F.grid_sample(region[None].float(), grid[None].float(), mode="bilinear", padding_mode="zeros",
                         align_corners=True)  # (1, 3, size, size)
    return crop[0].round_().clamp_(0, 255).to(torch.uint8)


def align_face(image: torch.Tensor, points: np.ndarray) -> torch.Tensor:
    """The (3, 112, 112) uint8 crop of ``image`` (3, H, W) uint8 that puts the five ``points (5, 2)`` (left eye,
    right eye, nose, left and right mouth corners, in photo pixels) onto the ArcFace template."""
    return warp_to_template(image, similarity_transform(points, ARCFACE_TEMPLATE))
