"""Synthetic face identities rendered as aligned 112x112 RGB crops, for demos and tests without real data.

An identity is a set of face parameters (``identity_params``) drawn from an RNG keyed by ``(seed, identity)``;
an image renders it (``render``) under per-image nuisances (``NuisanceConfig``: pose, expression, lighting,
blur, noise, occlusion, JPEG quality) from an RNG keyed by ``(seed, split, identity, image index)``: the same
seed gives byte-identical JPEGs in any order or process count. Every part is a soft-edged signed-distance mask
evaluated only inside its bounding box, alpha-composited back to front. Training identities are
``0 .. num_classes-1``, verification ones start at ``EVAL_ID_BASE[kind]``, so the splits are disjoint.
``write_dataset`` writes the real formats. docs/data.md#synthetic-identities.
"""
from __future__ import annotations

import io
import json
import logging
import math
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image
from tqdm import tqdm

from dataset.recordio import write_insightface_rec
from dataset.verification_set import save_bin
from utils.files import staged

logger = logging.getLogger(__name__)

IMAGE_SIZE = 112
# Canonical face coordinates: the image spans [-1, 1] on both axes at scale 1 (y points down).
_HALF = IMAGE_SIZE / 2.0
_CENTRE = (IMAGE_SIZE - 1) / 2.0

Split = Literal["train", "easy", "hard"]
# Verification identities start far above any training id so the splits cannot overlap.
EVAL_ID_BASE: dict[str, int] = {"easy": 10_000_000, "hard": 20_000_000}
# Tags that separate the RNG streams of identities, images and pair layouts.
_TAG_IDENTITY, _TAG_IMAGE, _TAG_PAIRS = 1, 3, 4
_SPLIT_TAG = {"train": 0, "easy": 1, "hard": 2}

HAIR_STYLES = ("bald", "short", "fringe", "side", "long")
_SKIN = np.array([[0.98, 0.87, 0.77], [0.93, 0.76, 0.62], [0.80, 0.60, 0.45],
                  [0.62, 0.43, 0.30], [0.42, 0.28, 0.19]], np.float32)
_HAIR = np.array([[0.08, 0.07, 0.07], [0.30, 0.19, 0.10], [0.55, 0.38, 0.20], [0.85, 0.72, 0.45],
                  [0.62, 0.25, 0.10], [0.65, 0.65, 0.65], [0.92, 0.92, 0.90]], np.float32)
_IRIS = np.array([[0.30, 0.18, 0.08], [0.12, 0.08, 0.05], [0.25, 0.45, 0.75], [0.30, 0.55, 0.35],
                  [0.50, 0.55, 0.60]], np.float32)
_FRAME = np.array([[0.05, 0.05, 0.05], [0.55, 0.35, 0.15], [0.75, 0.70, 0.60], [0.60, 0.10, 0.10],
                   [0.10, 0.20, 0.55]], np.float32)

Colour = tuple[float, float, float]


@dataclass(frozen=True)
class IdentityParams:
    """One synthetic person, in canonical face coordinates (image = [-1, 1]^2, y down)."""

    skin: Colour
    face_w: float          # half-width of the face ellipse
    face_h: float          # half-height of the face ellipse
    jaw_taper: float       # 0 = round jaw, larger = narrower chin
    ear_size: float
    eye_dx: float          # half the distance between the eye centres
    eye_y: float
    eye_w: float
    eye_h: float
    eye_tilt: float        # radians, outer corners up when positive
    iris: Colour
    brow_dy: float         # brow height above the eye centre
    brow_len: float
    brow_thick: float
    brow_angle: float
    brow_curve: float
    nose_len: float        # from the eye line to the nose tip
    nose_w: float
    mouth_y: float
    mouth_w: float
    lip_thick: float
    lip: Colour
    hair_style: str        # one of HAIR_STYLES
    hair: Colour
    hairline: float        # y of the hairline at the centre
    hair_volume: float     # how far the hair stands out of the face outline
    hair_slope: float      # tilt of the fringe / parting line
    glasses: bool
    frame: Colour
    lens_r: float
    beard: bool
    moustache: bool
    moles: tuple[tuple[float, float, float], ...]  # (x, y, radius) of dark spots


@dataclass(frozen=True)
class NuisanceConfig:
    """Bounds of the per-image nuisances, each drawn per image: smile and brow raise uniform in [-0.3, 1]·bound;
    mouth opening and eye closing u²·bound (u uniform in [0, 1]: mostly small); illumination, blur and noise
    uniform in [0, bound]; the others uniform in ±bound. ``occlusion_p`` is a probability, ``jpeg_quality`` the
    range of qualities."""

    rotation_deg: float = 8.0
    scale: float = 0.06           # relative, +-
    shift_px: float = 4.0
    yaw: float = 0.04             # sideways slide of the inner features, canonical units
    smile: float = 0.8
    mouth_open: float = 0.5
    brow_raise: float = 0.03
    eye_close: float = 0.4        # fraction of the eye height that may be closed
    illumination: float = 0.3     # strength of the multiplicative gradient
    brightness: float = 0.1
    contrast: float = 0.15
    colour_jitter: float = 0.05   # per-channel gain, +-
    blur_sigma: float = 0.8
    noise_sigma: float = 5.0      # in 0..255 units
    occlusion_p: float = 0.15
    occlusion_size: float = 0.4   # max side of the occluder, canonical units
    jpeg_quality: tuple[int, int] = (70, 95)


_STRONG = NuisanceConfig(rotation_deg=12.0, scale=0.09, shift_px=6.0, yaw=0.06, illumination=0.45,
                         brightness=0.15, contrast=0.25, colour_jitter=0.08, blur_sigma=1.2, noise_sigma=8.0,
                         occlusion_p=0.3, occlusion_size=0.5, jpeg_quality=(50, 90))
# Training images carry the strongest nuisances, so a network can learn to ignore everything the
# verification sets vary. Both sets keep the strong photometric nuisances (lighting, brightness, contrast,
# colour cast): an untrained network matches faces by their colours, which those scramble. syn_easy has
# mild geometric nuisances (pose, scale, shift, blur, occlusion), syn_hard the default ones. (Harder
# variants, look-alike negatives sharing skin tone and some features, or syn_hard at the training
# strength, left the tiny demo network at 0.81-0.92 however long it trained in the demo's budget: tasks
# for a bigger network, not for the 10-minute CPU demo.)
_PHOTOMETRIC = {"illumination": 0.45, "brightness": 0.15, "contrast": 0.25, "colour_jitter": 0.08}
_MILD = NuisanceConfig(rotation_deg=5.0, scale=0.04, shift_px=3.0, yaw=0.03, smile=0.6, mouth_open=0.3,
                       blur_sigma=0.5, noise_sigma=3.0, occlusion_p=0.08, occlusion_size=0.3,
                       jpeg_quality=(80, 95), **_PHOTOMETRIC)
NUISANCE: dict[str, NuisanceConfig] = {"train": _STRONG, "easy": _MILD, "hard": NuisanceConfig(**_PHOTOMETRIC)}


def _pick(rng: np.random.Generator, palette: np.ndarray, spread: float) -> Colour:
    """A palette colour, blended with its neighbour and perturbed, so colours are continuous."""
    t = rng.uniform(0, len(palette) - 1)
    i = int(t)
    j = min(i + 1, len(palette) - 1)
    c = palette[i] * (1 - (t - i)) + palette[j] * (t - i) + rng.uniform(-spread, spread, 3)
    return tuple(float(x) for x in np.clip(c, 0.0, 1.0))


def _draw_identity(rng: np.random.Generator) -> IdentityParams:
    u = rng.uniform
    skin = _pick(rng, _SKIN, 0.03)
    hair_style = HAIR_STYLES[int(rng.integers(len(HAIR_STYLES)))]
    beard = bool(rng.random() < 0.2)
    n_moles = int(rng.integers(0, 3))
    lip = tuple(float(x) for x in np.clip(np.array(skin) * u(0.55, 0.8) + np.array([0.2, 0.0, 0.02]), 0, 1))
    return IdentityParams(
        skin=skin, face_w=u(0.60, 0.80), face_h=u(0.84, 1.04), jaw_taper=u(0.0, 0.45), ear_size=u(0.09, 0.17),
        eye_dx=u(0.25, 0.38), eye_y=u(-0.17, -0.04), eye_w=u(0.07, 0.16), eye_h=u(0.03, 0.075),
        eye_tilt=u(-0.2, 0.2), iris=_pick(rng, _IRIS, 0.05),
        brow_dy=u(0.10, 0.18), brow_len=u(0.08, 0.14), brow_thick=u(0.01, 0.05), brow_angle=u(-0.3, 0.3),
        brow_curve=u(-1.0, 3.0),
        nose_len=u(0.18, 0.38), nose_w=u(0.04, 0.15),
        mouth_y=u(0.44, 0.62), mouth_w=u(0.10, 0.28), lip_thick=u(0.01, 0.045), lip=lip,
        hair_style=hair_style, hair=_pick(rng, _HAIR, 0.04), hairline=u(-0.70, -0.40),
        hair_volume=u(0.04, 0.18), hair_slope=u(-0.5, 0.5),
        glasses=bool(rng.random() < 0.25), frame=_pick(rng, _FRAME, 0.05), lens_r=u(0.10, 0.16),
        beard=beard, moustache=bool(beard or rng.random() < 0.12),
        moles=tuple((u(-0.5, 0.5), u(-0.3, 0.6), u(0.012, 0.025)) for _ in range(n_moles)),
    )


def identity_params(seed: int, identity: int) -> IdentityParams:
    """The parameters of identity ``identity`` (any non-negative int); independent of other identities."""
    if identity < 0:
        raise ValueError(f"identity must be >= 0, got {identity}")
    return _draw_identity(np.random.default_rng([seed, _TAG_IDENTITY, identity]))


@dataclass(frozen=True)
class Nuisance:
    """The per-image nuisance values drawn from a NuisanceConfig."""

    angle: float
    scale: float
    shift: tuple[float, float]
    yaw: float
    smile: float
    mouth_open: float
    brow_raise: float
    eye_open: float
    background: tuple[Colour, Colour]
    light_dir: float
    light: float
    brightness: float
    contrast: float
    gains: Colour
    blur_sigma: float
    noise_sigma: float
    noise_seed: int
    occluder: tuple[float, float, float, float, Colour] | None  # (x, y, half_w, half_h, colour)
    jpeg_quality: int


def sample_nuisance(rng: np.random.Generator, cfg: NuisanceConfig) -> Nuisance:
    """Draw one image's nuisances from ``cfg``."""
    u = rng.uniform
    occluder = None
    if rng.random() < cfg.occlusion_p:
        s = cfg.occlusion_size
        occluder = (u(-0.7, 0.7), u(-0.4, 0.9), u(0.15, s), u(0.15, s),
                    tuple(float(x) for x in rng.uniform(0, 1, 3)))
    return Nuisance(
        angle=math.radians(u(-cfg.rotation_deg, cfg.rotation_deg)),
        scale=1.0 + u(-cfg.scale, cfg.scale),
        shift=(u(-cfg.shift_px, cfg.shift_px), u(-cfg.shift_px, cfg.shift_px)),
        yaw=u(-cfg.yaw, cfg.yaw),
        smile=u(-0.3, 1.0) * cfg.smile,
        mouth_open=u(0, 1) ** 2 * cfg.mouth_open,
        brow_raise=u(-0.3, 1.0) * cfg.brow_raise,
        eye_open=1.0 - u(0, 1) ** 2 * cfg.eye_close,
        background=(tuple(float(x) for x in rng.uniform(0, 1, 3)), tuple(float(x) for x in rng.uniform(0, 1, 3))),
        light_dir=u(0, 2 * math.pi),
        light=u(0, cfg.illumination),
        brightness=u(-cfg.brightness, cfg.brightness),
        contrast=1.0 + u(-cfg.contrast, cfg.contrast),
        gains=tuple(float(x) for x in 1.0 + rng.uniform(-cfg.colour_jitter, cfg.colour_jitter, 3)),
        blur_sigma=u(0, cfg.blur_sigma),
        noise_sigma=u(0, cfg.noise_sigma),
        noise_seed=int(rng.integers(2**63)),
        occluder=occluder,
        jpeg_quality=int(rng.integers(cfg.jpeg_quality[0], cfg.jpeg_quality[1] + 1)),
    )


class _Canvas:
    """An HWC float32 image plus the canonical coordinates (u, v) of every pixel for one pose."""

    _ys, _xs = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32)
    # Fixed per-pixel fields shared by every image.
    _ramp = ((_xs * 0.7 + _ys * 0.3) / IMAGE_SIZE)[..., None]  # (H, W, 1)
    _xc = (_xs - _CENTRE) / _HALF  # (H, W) in [-1, 1]
    _yc = (_ys - _CENTRE) / _HALF  # (H, W)
    # One noise texture, cropped at a random offset per image: far cheaper than fresh noise per image.
    _noise = np.random.default_rng(12345).standard_normal((2 * IMAGE_SIZE, 2 * IMAGE_SIZE, 3)).astype(np.float32)

    def __init__(self, n: Nuisance) -> None:
        self.cos, self.sin = math.cos(n.angle), math.sin(n.angle)
        self.px = 1.0 / (_HALF * n.scale)  # one pixel in canonical units: the anti-aliasing width
        self.ox = _CENTRE + n.shift[0]
        self.oy = _CENTRE + n.shift[1]
        self.k = _HALF * n.scale
        dx = self._xs - self.ox  # (H, W)
        dy = self._ys - self.oy  # (H, W)
        self.u = (self.cos * dx + self.sin * dy) * self.px  # (H, W)
        self.v = (-self.sin * dx + self.cos * dy) * self.px  # (H, W)
        self.img = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), np.float32)

    def box(self, cx: float, cy: float, r: float) -> tuple[slice, slice] | None:
        """Pixel slices covering the canonical disc (cx, cy, r), or None when it is off the image."""
        x = self.ox + self.k * (self.cos * cx - self.sin * cy)
        y = self.oy + self.k * (self.sin * cx + self.cos * cy)
        rp = r * self.k + 2.0
        x0, x1 = max(int(x - rp), 0), min(int(x + rp) + 2, IMAGE_SIZE)
        y0, y1 = max(int(y - rp), 0), min(int(y + rp) + 2, IMAGE_SIZE)
        if x0 >= x1 or y0 >= y1:
            return None
        return slice(y0, y1), slice(x0, x1)

    def paint(self, sl: tuple[slice, slice], dist: np.ndarray, colour: Colour | np.ndarray,
              opacity: float = 1.0) -> None:
        """Alpha-blend ``colour`` where the signed distance ``dist`` (canonical units) is negative."""
        alpha = dist * np.float32(-1.0 / self.px)  # (h, w): one-pixel soft edge
        alpha += np.float32(0.5)
        np.clip(alpha, 0.0, opacity, out=alpha)
        region = self.img[sl]  # (h, w, 3) view
        region += alpha[..., None] * (np.asarray(colour, np.float32) - region)


def _local(u: np.ndarray, v: np.ndarray, cx: float, cy: float, angle: float) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates in a frame centred at (cx, cy) and rotated by ``angle``."""
    c, s = math.cos(angle), math.sin(angle)
    du, dv = u - cx, v - cy
    return c * du + s * dv, -s * du + c * dv


def _ellipse_sdf(x: np.ndarray, y: np.ndarray, a: float, b: float) -> np.ndarray:
    """Approximate signed distance to an axis-aligned ellipse (first-order: (k-1)/|grad k|)."""
    qx, qy = x / a, y / b
    k = np.sqrt(qx * qx + qy * qy) + 1e-6
    grad = np.sqrt((qx / a) ** 2 + (qy / b) ** 2) / k + 1e-6
    return (k - 1.0) / grad


def _ellipse(cv: _Canvas, cx: float, cy: float, a: float, b: float, colour, angle: float = 0.0,
             opacity: float = 1.0, ring: float = 0.0) -> None:
    sl = cv.box(cx, cy, max(a, b) + ring)
    if sl is None:
        return
    x, y = _local(cv.u[sl], cv.v[sl], cx, cy, angle)
    d = _ellipse_sdf(x, y, a, b)
    cv.paint(sl, np.abs(d) - ring if ring else d, colour, opacity)


def _curve(cv: _Canvas, cx: float, cy: float, half_len: float, bend: float, thick: float, colour,
           angle: float = 0.0, opacity: float = 1.0) -> None:
    """A thick parabola y = bend * x^2 over |x| <= half_len (brows, lips, eyelids)."""
    sl = cv.box(cx, cy, half_len + thick + abs(bend) * half_len * half_len)
    if sl is None:
        return
    x, y = _local(cv.u[sl], cv.v[sl], cx, cy, angle)
    # Taper the ends so strokes look drawn rather than cut.
    taper = thick * (1.0 - 0.6 * np.clip(np.abs(x) / half_len, 0, 1) ** 2)
    d = np.maximum(np.abs(y - bend * x * x) - taper, np.abs(x) - half_len)
    cv.paint(sl, d, colour, opacity)


def _darker(c: Colour, f: float) -> tuple[float, float, float]:
    return tuple(x * f for x in c)


def render(p: IdentityParams, n: Nuisance) -> np.ndarray:
    """Render identity ``p`` under nuisances ``n``: a (112, 112, 3) uint8 RGB array."""
    cv = _Canvas(n)
    img = cv.img
    # Background: a linear blend between two colours across the image.
    bg0, bg1 = np.asarray(n.background[0], np.float32), np.asarray(n.background[1], np.float32)
    np.multiply(cv._ramp, bg1 - bg0, out=img)
    img += bg0

    hair = p.hair
    face_cy = 0.08
    # Long hair falls behind the head and shoulders.
    if p.hair_style == "long":
        _ellipse(cv, 0.0, face_cy + 0.25, p.face_w + p.hair_volume + 0.08, p.face_h + 0.3, hair)
    # Neck and ears sit behind the face outline.
    _ellipse(cv, 0.0, face_cy + p.face_h * 0.9, p.face_w * 0.55, 0.5, _darker(p.skin, 0.9))
    for side in (-1.0, 1.0):
        _ellipse(cv, side * (p.face_w - 0.02), p.eye_y + 0.12, p.ear_size * 0.7, p.ear_size * 1.3,
                 _darker(p.skin, 0.93))
    # Face: an ellipse whose lower half narrows towards the chin by jaw_taper.
    sl = cv.box(0.0, face_cy, max(p.face_w, p.face_h))
    u, v = cv.u[sl], cv.v[sl]
    y = v - face_cy
    width = p.face_w * (1.0 - p.jaw_taper * np.clip(y / p.face_h, 0.0, 1.0) ** 2)
    face_d = _ellipse_sdf(u / width * p.face_w, y, p.face_w, p.face_h)
    cv.paint(sl, face_d, p.skin)

    # Inner features slide sideways with the fake yaw.
    fx = n.yaw
    if p.beard:
        # Beard: the face below a line under the nose, with an opening for the mouth.
        beard_d = np.maximum(face_d + 0.01, (p.eye_y + p.nose_len + 0.06) - v)
        cv.paint(sl, beard_d, hair, 0.9)
    if p.hair_style != "bald":
        # Hair cap: a slightly larger head outline, above a (tilted, wavy) hairline.
        cap = _ellipse_sdf(u, v - face_cy + p.hair_volume * 0.5, p.face_w + p.hair_volume,
                           p.face_h + p.hair_volume)
        line = p.hairline + p.hair_slope * u
        if p.hair_style == "fringe":
            line = line + 0.2 + 0.03 * np.sin(u * 25.0)
        elif p.hair_style == "side":
            line = line + 0.1 * np.abs(u - 0.3 * np.sign(p.hair_slope)) * 3.0
        elif p.hair_style == "long":
            # Long hair frames the face down the sides.
            line = np.where(np.abs(u) > p.face_w - 0.12, 2.0, line)
        hair_d = np.maximum(cap, v - line)
        cv.paint(sl, hair_d, hair)
    for mx, my, mr in p.moles:
        _ellipse(cv, mx + fx, my, mr, mr, _darker(p.skin, 0.45))

    # Eyes: white, iris, pupil, then an upper lid that closes with eye_open.
    eh = p.eye_h * n.eye_open
    for side in (-1.0, 1.0):
        ex = side * p.eye_dx + fx
        tilt = -side * p.eye_tilt
        _ellipse(cv, ex, p.eye_y, p.eye_w, eh, (0.95, 0.95, 0.93), tilt)
        _ellipse(cv, ex, p.eye_y, min(p.eye_h * 0.75, eh), min(p.eye_h * 0.75, eh), p.iris)
        _ellipse(cv, ex, p.eye_y, min(p.eye_h * 0.35, eh), min(p.eye_h * 0.35, eh), (0.02, 0.02, 0.02))
        _ellipse(cv, ex, p.eye_y, p.eye_w, eh, _darker(p.skin, 0.5), tilt, ring=0.008)
        # Brows follow the hair colour; expression raises them.
        by = p.eye_y - p.brow_dy - n.brow_raise
        _curve(cv, ex + side * 0.02, by, p.brow_len, -p.brow_curve, p.brow_thick, _darker(hair, 0.8),
               -side * p.brow_angle)
        if p.glasses:
            _ellipse(cv, ex, p.eye_y, p.lens_r * 1.2, p.lens_r, p.frame, ring=0.012)
    if p.glasses:
        _curve(cv, fx, p.eye_y - 0.02, p.eye_dx - p.lens_r * 1.2, -1.0, 0.01, p.frame)

    # Nose: a shaded ridge and two nostrils.
    tip = p.eye_y + p.nose_len
    _ellipse(cv, fx * 1.3, tip - p.nose_len * 0.4, p.nose_w * 0.35, p.nose_len * 0.45, _darker(p.skin, 0.85),
             opacity=0.6)
    for side in (-1.0, 1.0):
        _ellipse(cv, fx * 1.3 + side * p.nose_w * 0.5, tip, p.nose_w * 0.3, p.nose_w * 0.18,
                 _darker(p.skin, 0.45))

    # Mouth: an opening (dark ellipse) then the lips as a curve whose bend is the smile.
    if n.mouth_open > 0.05:
        _ellipse(cv, fx, p.mouth_y, p.mouth_w * 0.7, 0.05 * n.mouth_open, (0.25, 0.05, 0.05))
    if p.moustache:
        _curve(cv, fx, p.mouth_y - 0.06, p.mouth_w * 0.9, -1.0, 0.022, _darker(hair, 0.9))
    _curve(cv, fx, p.mouth_y, p.mouth_w, -n.smile * 1.5, p.lip_thick, p.lip)

    if n.occluder is not None:
        ox, oy, hw, hh, oc = n.occluder
        sl = cv.box(ox, oy, max(hw, hh))
        if sl is not None:
            x, y = _local(cv.u[sl], cv.v[sl], ox, oy, 0.0)
            cv.paint(sl, np.maximum(np.abs(x) - hw, np.abs(y) - hh), oc)

    # Photometric nuisances, in the order a camera would apply them.
    lx, ly = math.cos(n.light_dir) * n.light, math.sin(n.light_dir) * n.light
    light = cv._xc * np.float32(lx) + cv._yc * np.float32(ly)  # (H, W)
    light += np.float32(1.0)
    gain = np.asarray(n.gains, np.float32) * np.float32(255.0 * n.contrast)  # (3,)
    img *= light[..., None] * gain
    img += np.float32(255.0 * (n.brightness + 0.5 * (1.0 - n.contrast)) + 0.5)  # +0.5: round on the cast
    if n.blur_sigma > 0.3:
        img = _blur(img, n.blur_sigma)
    if n.noise_sigma > 0.5:
        oy, ox = divmod(n.noise_seed % (IMAGE_SIZE * IMAGE_SIZE), IMAGE_SIZE)
        img += cv._noise[oy: oy + IMAGE_SIZE, ox: ox + IMAGE_SIZE] * np.float32(n.noise_sigma)
    np.clip(img, 0.0, 255.0, out=img)
    return img.astype(np.uint8)


def _blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur with edge padding."""
    r = max(1, int(math.ceil(2.0 * sigma)))
    t = np.arange(-r, r + 1, dtype=np.float32)
    w = np.exp(-0.5 * (t / sigma) ** 2)
    w /= w.sum()
    pad = np.pad(img, ((r, r), (0, 0), (0, 0)), mode="edge")
    out = w[0] * pad[: IMAGE_SIZE]
    for i in range(1, 2 * r + 1):
        out += w[i] * pad[i: i + IMAGE_SIZE]
    pad = np.pad(out, ((0, 0), (r, r), (0, 0)), mode="edge")
    out = w[0] * pad[:, : IMAGE_SIZE]
    for i in range(1, 2 * r + 1):
        out += w[i] * pad[:, i: i + IMAGE_SIZE]
    return out


def encode_jpeg(img: np.ndarray, quality: int) -> bytes:
    """JPEG bytes of an (H, W, 3) uint8 RGB array."""
    buf = io.BytesIO()
    Image.fromarray(img, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def image_rng(seed: int, split: Split, identity: int, index: int) -> np.random.Generator:
    """The RNG of one image: keyed by everything that names it, so images are order-independent."""
    return np.random.default_rng([seed, _TAG_IMAGE, _SPLIT_TAG[split], identity, index])


def render_sample(seed: int, split: Split, params: IdentityParams, identity: int,
                  index: int) -> tuple[np.ndarray, int]:
    """Image ``index`` of an identity under split ``split``'s nuisances: (uint8 HWC array, JPEG quality)."""
    n = sample_nuisance(image_rng(seed, split, identity, index), NUISANCE[split])
    return render(p=params, n=n), n.jpeg_quality


def train_identity_images(seed: int, identity: int, images_per_class: int) -> list[bytes]:
    """The JPEG images of training identity ``identity``."""
    p = identity_params(seed, identity)
    out = []
    for i in range(images_per_class):
        img, q = render_sample(seed, "train", p, identity, i)
        out.append(encode_jpeg(img, q))
    return out


@dataclass(frozen=True)
class PairSpec:
    """Which identities and image indices make up one verification pair."""

    issame: bool
    a: int
    b: int
    index_a: int
    index_b: int


def pair_specs(seed: int, kind: Literal["easy", "hard"], num_pairs: int) -> list[PairSpec]:
    """The layout of a verification set: half same, half different, interleaved so every fold is balanced.

    Negatives are two different identities; ``kind`` picks the identity range (disjoint from training and
    from the other set) and, through ``NUISANCE``, how strongly the images vary.
    """
    if kind not in EVAL_ID_BASE:
        raise ValueError(f"kind must be one of {sorted(EVAL_ID_BASE)}, got {kind!r}")
    if num_pairs < 2:
        raise ValueError(f"num_pairs must be >= 2, got {num_pairs}")
    base = EVAL_ID_BASE[kind]
    rng = np.random.default_rng([seed, _TAG_PAIRS, _SPLIT_TAG[kind], num_pairs])
    # Every identity appears in about two positive pairs, like LFW's few images per person.
    n_ids = max(2, num_pairs // 4)
    specs = []
    for i in range(num_pairs):
        if i % 2 == 0:
            ident = base + int(rng.integers(n_ids))
            specs.append(PairSpec(True, ident, ident, 2 * i, 2 * i + 1))
        else:
            a, b = rng.choice(n_ids, size=2, replace=False)
            specs.append(PairSpec(False, base + int(a), base + int(b), 2 * i, 2 * i + 1))
    return specs


def render_pair_images(seed: int, kind: Literal["easy", "hard"], specs: list[PairSpec]) -> list[bytes]:
    """The 2 * len(specs) JPEG images of ``specs`` (pair i is images 2i, 2i+1)."""
    cache: dict[int, IdentityParams] = {}
    out = []
    for s in specs:
        for ident, index in ((s.a, s.index_a), (s.b, s.index_b)):
            if ident not in cache:
                cache[ident] = identity_params(seed, ident)
            img, q = render_sample(seed, kind, cache[ident], ident, index)
            out.append(encode_jpeg(img, q))
    return out


# ---------------------------------------------------------------------------------------------------------
# Whole datasets on disk: train.rec/train.idx/property plus syn_easy.bin / syn_hard.bin and a stamp.
# ---------------------------------------------------------------------------------------------------------

# Bump when the renderer or the parameter distributions change: cached datasets are then rebuilt.
GENERATOR_VERSION = 7
STAMP_NAME = "synthetic.json"
VERIFICATION_TARGETS = ("syn_easy", "syn_hard")
_PAIR_CHUNK = 50


def _train_job(args: tuple[int, int, int]) -> list[bytes]:
    return train_identity_images(*args)


def _pairs_job(args: tuple[int, str, list[PairSpec]]) -> list[bytes]:
    return render_pair_images(*args)


def dataset_stamp(num_classes: int, images_per_class: int, pairs: int, seed: int) -> dict:
    """The JSON stamp that identifies a complete dataset built with these parameters."""
    return {"generator_version": GENERATOR_VERSION, "num_classes": num_classes,
            "images_per_class": images_per_class, "pairs": pairs, "seed": seed,
            "train_ids": [0, num_classes],
            "eval_ids": {k: [EVAL_ID_BASE[k], EVAL_ID_BASE[k] + max(2, pairs // 4)] for k in EVAL_ID_BASE},
            "targets": list(VERIFICATION_TARGETS)}


def is_complete(out_dir: str | os.PathLike, stamp: dict) -> bool:
    """True when ``out_dir`` holds every file of a dataset whose stamp equals ``stamp``."""
    out = Path(out_dir)
    path = out / STAMP_NAME
    if not path.is_file():
        return False
    try:
        found = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("ignoring unreadable stamp %s: %s", path, exc)
        return False
    names = ["train.rec", "train.idx", "property"] + [f"{t}.bin" for t in VERIFICATION_TARGETS]
    return found == stamp and all((out / n).is_file() for n in names)


def write_dataset(out_dir: str | os.PathLike, num_classes: int = 1000, images_per_class: int = 20,
                  pairs: int = 3000, seed: int = 0, workers: int = 1, progress: bool = False) -> bool:
    """Write a synthetic dataset in the real formats; return False when an identical one was already there.

    ``out_dir`` receives ``train.rec``/``train.idx``/``property`` (insightface layout, labels
    ``0..num_classes-1``), ``syn_easy.bin`` and ``syn_hard.bin`` (``pairs`` pairs each, half same, from
    identities disjoint from the training ones) and, last, the stamp ``synthetic.json``. The output is
    byte-identical for the same parameters whatever ``workers`` is. The files are written in a staging folder
    (``utils.files.staged``): a new ``out_dir`` appears whole; into an existing one the files move in complete, the
    stamp last, so an interrupted build leaves no stamp and is rebuilt.
    """
    for name, value, low in (("num_classes", num_classes, 1), ("images_per_class", images_per_class, 1),
                             ("pairs", pairs, 2), ("workers", workers, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if num_classes >= min(EVAL_ID_BASE.values()):
        raise ValueError(f"num_classes must be < {min(EVAL_ID_BASE.values())} so training identities stay "
                         f"disjoint from verification identities, got {num_classes}")
    out = Path(out_dir)
    stamp = dataset_stamp(num_classes, images_per_class, pairs, seed)
    if is_complete(out, stamp):
        logger.info("%s already holds this synthetic dataset; nothing to do", out)
        return False
    # An old stamp goes first: a rebuild stopped while its files move in must not look complete.
    (out / STAMP_NAME).unlink(missing_ok=True)

    total = num_classes * images_per_class + 2 * 2 * pairs
    with staged(out, last=(STAMP_NAME,)) as stage:
        bar = tqdm(total=total, unit="img", desc=f"synthetic -> {out}", disable=not progress)
        pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else None
        imap = pool.imap if pool is not None else map
        try:
            def train_items() -> Iterator[tuple[int, bytes]]:
                jobs = ((seed, c, images_per_class) for c in range(num_classes))
                for c, images in enumerate(imap(_train_job, jobs)):
                    bar.update(len(images))
                    for jpeg in images:
                        yield c, jpeg

            write_insightface_rec(stage, train_items(), num_classes)
            for target, kind in zip(VERIFICATION_TARGETS, ("easy", "hard")):
                specs = pair_specs(seed, kind, pairs)
                images: list[bytes] = []
                chunks = ((seed, kind, specs[i:i + _PAIR_CHUNK]) for i in range(0, len(specs), _PAIR_CHUNK))
                for chunk in imap(_pairs_job, chunks):
                    images.extend(chunk)
                    bar.update(len(chunk))
                save_bin(stage / f"{target}.bin", images, [s.issame for s in specs])
            (stage / STAMP_NAME).write_text(json.dumps(stamp, indent=1))
        finally:
            if pool is not None:
                pool.close()
                pool.join()
            bar.close()
    return True


def preview_grid(path: str | os.PathLike, seed: int = 0, identities: int = 6, variations: int = 8,
                 split: Split = "train") -> None:
    """Write a PNG grid: one row per training identity, one column per nuisance draw."""
    rows = []
    for c in range(identities):
        p = identity_params(seed, c)
        rows.append(np.concatenate([render_sample(seed, split, p, c, i)[0] for i in range(variations)], axis=1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(rows, axis=0), "RGB").save(path, format="PNG")
