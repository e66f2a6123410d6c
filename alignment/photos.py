"""Any photo a user has, as an RGB uint8 tensor, upright, or one error saying what is wrong with it: ``read_photo``,
the one reader of a face photo from a file (the training decoder, ``dataset.images.decode``, applies the EXIF
orientation as it does)."""
from __future__ import annotations

import functools
import io
import os
import warnings
from pathlib import Path

import numpy as np
import torch

MAX_PIXELS = 100_000_000  # larger images are refused as decompression bombs (Pillow itself refuses beyond 179M)


class PhotoError(ValueError):
    """A photo that cannot be used; the message starts with its path and says why."""


@functools.cache
def register_plugins() -> tuple[str, ...]:
    """Register the optional Pillow plug-ins installed here, so that ``read_photo`` reads their formats too:
    pillow-heif (HEIC/HEIF, what phones write). Returns the names of those registered; idempotent."""
    try:
        from pillow_heif import register_heif_opener
    except ImportError:
        return ()
    register_heif_opener()
    return ("pillow-heif",)


def read_photo_bytes(path: str | os.PathLike) -> bytes:
    """The content of the photo file at ``path``; ``PhotoError`` naming it when it cannot be read."""
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise PhotoError(f"{path}: no such file") from exc
    except PermissionError as exc:
        raise PhotoError(f"{path}: not readable (permission denied)") from exc
    except IsADirectoryError as exc:
        raise PhotoError(f"{path}: a folder, not a photo") from exc
    except OSError as exc:
        raise PhotoError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def read_photo(path: str | os.PathLike, max_pixels: int = MAX_PIXELS, *, data: bytes | None = None) -> torch.Tensor:
    """The photo at ``path`` as a (3, H, W) uint8 RGB tensor, upright (its memory may be laid out channels last).

    Every format Pillow reads (JPEG, PNG, WebP, BMP, TIFF, PGM/PPM, ..., and HEIC/HEIF with pillow-heif
    installed: ``register_plugins``). The EXIF orientation is applied. Grayscale, CMYK and palette images become
    RGB. Transparent pixels are composited onto white. A 16-bit image is scaled to 8 bits (divided by 257).
    A colour or grey JPEG is decoded by libjpeg-turbo straight into the tensor (``torchvision.io.decode_jpeg``:
    Pillow's pixels, in a fraction of Pillow's time for a large photo); the rest by Pillow.
    ``data``: the file's content, already read (``read_photo_bytes``); ``path`` then only names it. Raises
    ``PhotoError`` naming the file for:
    - a missing or unreadable path;
    - an empty, truncated or corrupt file, or one that is not an image;
    - an image of more than ``max_pixels`` pixels (a decompression bomb).
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    path = Path(path)
    register_plugins()
    if data is None:
        data = read_photo_bytes(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # max_pixels decides, below
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise PhotoError(f"{path}: {width}x{height} pixels is more than the {max_pixels:,} allowed "
                                     f"(a decompression bomb?)")
                if image.format == "JPEG" and image.mode in ("RGB", "L"):
                    return _decode_jpeg(path, data)
                image.load()
                ImageOps.exif_transpose(image, in_place=True)  # without a copy of the whole photo
                array = np.asarray(_as_rgb(image, path), dtype=np.uint8)  # (H, W, 3)
    except PhotoError:
        raise
    except UnidentifiedImageError as exc:
        raise PhotoError(f"{path}: {'an empty file' if not data else 'not an image Pillow can read'}") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PhotoError(f"{path}: too many pixels (a decompression bomb?): {exc}") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt data, as Pillow reports it
        raise PhotoError(f"{path}: cannot decode: {exc}") from exc
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))  # (3, H, W)


def _decode_jpeg(path: Path, data: bytes) -> torch.Tensor:
    """A JPEG's (3, H, W) uint8 RGB pixels, upright, by libjpeg-turbo."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB,
                           apply_exif_orientation=True)
    except RuntimeError as exc:  # "decode_jpeg, <source>:<line>, <what>": the what
        raise PhotoError(f"{path}: cannot decode: {str(exc).rsplit(', ', 1)[-1].strip()}") from exc


def _as_rgb(image, path: Path):
    """The RGB Pillow image of a loaded one of any mode (a numpy array for 16-bit images)."""
    from PIL import Image

    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        values = np.asarray(image, dtype=np.float64)
        gray = np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8)  # 65535 -> 255
        return np.repeat(gray[:, :, None], 3, axis=2)
    if image.mode == "F":
        raise PhotoError(f"{path}: a floating-point image (mode F); save it as 8-bit RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image if image.mode == "RGB" else image.convert("RGB")
