"""Face images: decoding, resizing and the one normalisation every reader of the project feeds a backbone.

A decoded image is a ``(3, H, W)`` uint8 RGB tensor, upright: the EXIF orientation is applied, as
``alignment.read_photo`` applies it, so a photo trains as every tool reads it. ``normalise`` turns uint8
images into the float32 values a backbone sees, ``(x - 127.5) / 127.5``: the trainer's loader, the
verification and IJB protocols and single-image inference all call it, so a model is evaluated on exactly the
values it was trained on.
``decode_many`` and ``stack_flipped`` are the loader's batch path: a worker decodes a whole batch per call
into one uint8 tensor.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

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
    """Decode JPEG or PNG bytes to a ``(3, H, W)`` uint8 RGB tensor, its EXIF orientation applied.

    ``ValueError`` naming ``where`` when the bytes do not decode, or, with ``image_size`` (H, W), when the
    image has another size.
    """
    # bytearray: torch.frombuffer needs a writable buffer; the copy of a ~5 KB JPEG costs nothing.
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    try:
        if is_jpeg(data):
            image = decode_jpeg(raw, mode=ImageReadMode.RGB, apply_exif_orientation=True)  # (3, H, W)
        else:
            image = decode_image(raw, mode=ImageReadMode.RGB, apply_exif_orientation=True)  # (3, H, W)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{where}: cannot decode image ({len(data)} bytes, starts with {data[:8]!r}): "
                         f"{exc}") from exc
    if image_size is not None and tuple(image.shape[1:]) != tuple(image_size):
        raise _size_error(image, where, image_size)
    return image


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def is_jpeg(data: bytes) -> bool:
    """Whether ``data`` starts as a JPEG does (the SOI marker ``FF D8``)."""
    return data[:2] == b"\xff\xd8"


def is_png(data: bytes) -> bool:
    """Whether ``data`` starts with the 8-byte PNG signature."""
    return data[:8] == _PNG_SIGNATURE


def decode_many(data: Sequence[bytes], where: Sequence[str], image_size: tuple[int, int] | None = None
                ) -> list[torch.Tensor]:
    """``[decode(d, w, image_size) for d, w in zip(data, where)]``: the same images, faster. With several bad
    images the error may name another of them than the loop would (undecodable JPEGs are found first).

    All the JPEGs go to the decoder in one call, their bytes in one buffer: torchvision's per-call checks and
    one buffer per image are a noticeable share of decoding a 112x112 face. Other formats take ``decode``.
    """
    if len(data) != len(where):
        raise ValueError(f"decode_many: {len(data)} images but {len(where)} names")
    images: list[torch.Tensor | None] = [None] * len(data)
    jpegs = [j for j, d in enumerate(data) if is_jpeg(d)]
    if jpegs:
        whole = torch.frombuffer(bytearray(b"".join(data[j] for j in jpegs)), dtype=torch.uint8)  # (total bytes,)
        raws, start = [], 0
        for j in jpegs:
            raws.append(whole[start:start + len(data[j])])  # (len,) view, no copy
            start += len(data[j])
        try:
            decoded = decode_jpeg(raws, mode=ImageReadMode.RGB, apply_exif_orientation=True)  # [(3, H, W)]
        except (RuntimeError, ValueError):
            # One bad image fails the whole call; decode one by one so the error names that image.
            decoded = [decode(data[j], where[j]) for j in jpegs]
        for j, image in zip(jpegs, decoded):
            images[j] = image
    for j, image in enumerate(images):
        if image is None:
            images[j] = image = decode(data[j], where[j])
        if image_size is not None and tuple(image.shape[1:]) != tuple(image_size):
            raise _size_error(image, where[j], image_size)
    return images  # type: ignore[return-value]  # every slot filled above


def _size_error(image: torch.Tensor, where: str, image_size: tuple[int, int]) -> ValueError:
    return ValueError(f"{where}: image is {image.shape[1]}x{image.shape[2]} (HxW), expected "
                      f"{image_size[0]}x{image_size[1]}; re-align or rebuild with scripts/make_rec.py "
                      f"--image-size")


def stack_flipped(images: Sequence[torch.Tensor], flips: Sequence[bool]) -> torch.Tensor:
    """``(3, H, W)`` images -> one ``(B, 3, H, W)`` batch, image ``j`` mirrored left-right where ``flips[j]``.

    The batch is stored channels-last (its ``permute(0, 2, 3, 1)`` is contiguous), the layout the JPEG
    decoder writes: each image is then one memcpy instead of a transposing copy, and the transpose happens
    once per batch in ``normalise``, on the training device.
    """
    if len(images) != len(flips) or not images:
        raise ValueError(f"stack_flipped: {len(images)} images and {len(flips)} flips; need as many, at least one")
    first = images[0].shape
    if len(first) != 3:
        raise ValueError(f"stack_flipped: images must be (C, H, W); image 0 is {tuple(first)}")
    out = torch.empty(len(images), first[1], first[2], first[0], dtype=images[0].dtype)  # (B, H, W, C)
    for j, (image, flip) in enumerate(zip(images, flips)):
        if image.shape != first:
            raise ValueError(f"stack_flipped: image {j} is {tuple(image.shape)}, image 0 is {tuple(first)}; "
                             f"a batch needs one size")
        out[j].copy_((image.flip(-1) if flip else image).permute(1, 2, 0))  # (H, W, C)
    return out.permute(0, 3, 1, 2)  # (B, C, H, W) view of the channels-last storage


def resize(image: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``(3, h, w)`` -> uint8 ``(3, H, W)``: bilinear with antialiasing, rounded to the nearest level."""
    out = torch.nn.functional.interpolate(image[None].float(), size=tuple(image_size), mode="bilinear",
                                          align_corners=False, antialias=True)  # (1, 3, H, W)
    return out[0].round_().clamp_(0, 255).to(torch.uint8)


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 images ``(..., 3, H, W)`` of any strides -> a new contiguous float32 tensor ``(x - 127.5) / 127.5``
    in [-1, 1], on the same device."""
    if images.dtype != torch.uint8:
        # A float input would be normalised twice by a caller that already did it: refuse rather than guess.
        raise ValueError(f"normalise expects uint8 images (0..255); got {images.dtype}")
    # copy_ converts and makes the layout contiguous in one pass (a channels-last batch from stack_flipped
    # or a decoder's HWC image would otherwise give the backbone channels-last input).
    out = torch.empty(images.shape, dtype=torch.float32, device=images.device)  # (..., 3, H, W)
    # A multiplication by the fp32 reciprocal, not a division: CUDA divides by a scalar as exactly this
    # multiplication while the CPU divides, which differ in the last bit for 126 of the 256 pixel values.
    return out.copy_(images).sub_(PIXEL_MEAN).mul_(1.0 / PIXEL_STD)
