"""Copies of one photo among the input: the same file twice (exact), or the same picture re-encoded, resized or
colour-filtered (near).

Each photo is summarised by a ``THUMB x THUMB`` grey thumbnail (``thumbnail``, saved with its detections); two
photos are near duplicates when their aspect ratios agree within ``ASPECT_TOLERANCE`` and their thumbnails
correlate at ``NEAR`` or more. Re-encoded and resized copies correlate above 0.999, colour-filtered ones above
0.996; the same scene shifted by 1 % of its width, or turned by 2°, falls below 0.99. Candidates are first
sought with 8 x 8 means of the thumbnails, so that comparing every pair stays cheap for tens of thousands of
photos. See docs/data.md ("From your own photos", report.csv).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

THUMB = 32
NEAR = 0.995
COARSE = 0.98  # the 8 x 8 correlation a near duplicate exceeds (averaging raises correlations)
ASPECT_TOLERANCE = 0.02
_BLOCK = 512  # rows of the coarse correlation computed at once
_PAIRS = 65536  # candidate pairs whose fine correlation is computed at once


def thumbnail(image: torch.Tensor) -> bytes:
    """The THUMB x THUMB grey thumbnail of a (3, H, W) uint8 photo (shrunk in uint8, antialiased: cheap for a large
    photo), as the bytes of its rows."""
    small = F.interpolate(image[None], size=(THUMB, THUMB), mode="bilinear", antialias=True, align_corners=False)
    gray = (small[0].float() * torch.tensor([0.299, 0.587, 0.114], device=image.device)[:, None, None]).sum(0)
    return gray.round_().clamp_(0, 255).to(torch.uint8).cpu().numpy().tobytes()


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows centred and scaled to unit norm (a flat row stays zero)."""
    x = x - x.mean(dim=1, keepdim=True)
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-6)


def find_copies(keys: Sequence[str | None], thumbs: Sequence[bytes | None],
                sizes: Sequence[tuple[int, int] | None]) -> list[int | None]:
    """For each photo, the index of the first photo (in the given order) it is a copy of, or None: the same
    ``keys`` (file content), or near duplicates (thumbnails and aspect ratios, module docstring). ``None`` keys,
    thumbnails or (H, W) sizes mark photos that could not be read: they copy nothing."""
    n = len(keys)
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(i: int, j: int) -> None:
        a, b = root(i), root(j)
        parent[max(a, b)] = min(a, b)

    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key is not None:
            join(first.setdefault(key, i), i)
    known = [i for i in range(n) if thumbs[i] is not None and sizes[i] is not None]
    if len(known) > 1:
        pixels = torch.tensor(np.frombuffer(b"".join(thumbs[i] for i in known), np.uint8).reshape(-1, THUMB, THUMB),
                              dtype=torch.float32)  # (K, THUMB, THUMB)
        fine = _unit_rows(pixels.flatten(1))  # (K, THUMB²)
        coarse = _unit_rows(F.avg_pool2d(pixels[:, None], THUMB // 8).flatten(1))  # (K, 64)
        aspect = torch.tensor([np.log(sizes[i][1] / sizes[i][0]) for i in known])  # (K,)
        for start in range(0, len(known), _BLOCK):
            block = coarse[start:start + _BLOCK] @ coarse.T  # (b, K)
            rows, cols = torch.nonzero(block >= COARSE, as_tuple=True)
            rows = rows + start
            later = cols > rows
            rows, cols = rows[later], cols[later]
            same_shape = (aspect[rows] - aspect[cols]).abs() <= ASPECT_TOLERANCE
            rows, cols = rows[same_shape], cols[same_shape]
            for at in range(0, len(rows), _PAIRS):
                a, b = rows[at:at + _PAIRS], cols[at:at + _PAIRS]
                near = (fine[a] * fine[b]).sum(1) >= NEAR
                for i, j in zip(a[near].tolist(), b[near].tolist()):
                    join(known[i], known[j])
    return [None if root(i) == i else root(i) for i in range(n)]
