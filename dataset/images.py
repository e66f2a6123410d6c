"""Face images: decoding, resizing and the one normalisation every reader of the project feeds a backbone.

A decoded image is a ``(3, H, W)`` uint8 RGB tensor. ``normalise`` turns uint8 images into the float32
values a backbone sees, ``(x - 127.5) / 127.5``: the trainer's loader, the verification and IJB protocols
and single-image inference all call it, so a model is evaluated on exactly the values it was trained on.
"""
from __future__ import annotations

from typing import Callable

import torch
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
Transform = Callable[[torch.Tensor], torch.Tensor]

# (x - PIXEL_MEAN) / PIXEL_STD maps uint8 0..255 onto [-1, 1], the input range of insightface's backbones.
PIXEL_MEAN = 127.5
PIXEL_STD = 127.5
# How model.json states it (checked by the evaluation tools against what the trainer wrote).
NORMALISATION = f"RGB, (x - {PIXEL_MEAN}) / {PIXEL_STD}"


def decode(data: bytes, where: str, image_size: tuple[int, int] | None = None) -> torch.Tensor:
    """Decode JPEG or PNG bytes to a ``(3, H, W)`` uint8 RGB tensor.

    ``ValueError`` naming ``where`` when the bytes do not decode, or, with ``image_size`` (H, W), when the
    image has another size.
    """
    # bytearray: torch.frombuffer needs a writable buffer; the copy of a ~5 KB JPEG costs nothing.
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    try:
        if data[:2] == b"\xff\xd8":
            image = decode_jpeg(raw, mode=ImageReadMode.RGB)  # (3, H, W)
        else:
            image = decode_image(raw, mode=ImageReadMode.RGB)  # (3, H, W)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{where}: cannot decode image ({len(data)} bytes, starts with {data[:8]!r}): "
                         f"{exc}") from exc
    if image_size is not None and tuple(image.shape[1:]) != tuple(image_size):
        raise ValueError(f"{where}: image is {image.shape[1]}x{image.shape[2]} (HxW), expected "
                         f"{image_size[0]}x{image_size[1]}; re-align or rebuild with scripts/make_rec.py "
                         f"--image-size")
    return image


def resize(image: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``(3, h, w)`` -> uint8 ``(3, H, W)``: bilinear with antialiasing, rounded to the nearest level."""
    out = torch.nn.functional.interpolate(image[None].float(), size=tuple(image_size), mode="bilinear",
                                          align_corners=False, antialias=True)  # (1, 3, H, W)
    return out[0].round_().clamp_(0, 255).to(torch.uint8)


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 images ``(..., 3, H, W)`` -> float32 ``(x - 127.5) / 127.5`` in [-1, 1], on the same device."""
    if images.dtype != torch.uint8:
        # A float input would be normalised twice by a caller that already did it: refuse rather than guess.
        raise ValueError(f"normalise expects uint8 images (0..255); got {images.dtype}")
    return images.float().sub_(PIXEL_MEAN).div_(PIXEL_STD)  # (..., 3, H, W), a new tensor
