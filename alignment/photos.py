"""Any photo a user has, as an RGB uint8 tensor, upright, or one error saying what is wrong with it: ``read_photo``,
the one reader of a face photo from a file (the training decoder, ``dataset.images.decode``, applies the EXIF
orientation as it does)."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

MAX_PIXELS = 100_000_000  # larger images are refused as decompression bombs (Pillow itself refuses beyond 179M)


class PhotoError(ValueError):
    """A photo that cannot be used; the message starts with its path and says why."""


def read_photo(path: str | os.PathLike, max_pixels: int = MAX_PIXELS) -> torch.Tensor:
    """The photo at ``path`` as a (3, H, W) uint8 RGB tensor, upright.

    Every format Pillow reads (JPEG, PNG, WebP, BMP, TIFF, ...). The EXIF orientation is applied. Grayscale,
    CMYK and palette images become RGB. Transparent pixels are composited onto white. A 16-bit image is scaled
    to 8 bits (divided by 257). Raises ``PhotoError`` naming the file for:
    - a missing or unreadable path;
    - an empty, truncated or corrupt file, or one that is not an image;
    - an image of more than ``max_pixels`` pixels (a decompression bomb).
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # max_pixels decides, below
            with Image.open(path) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise PhotoError(f"{path}: {width}x{height} pixels is more than the {max_pixels:,} allowed "
                                     f"(a decompression bomb?)")
                image.load()
                image = ImageOps.exif_transpose(image)
                array = _as_rgb(image, path)
    except PhotoError:
        raise
    except FileNotFoundError as exc:
        raise PhotoError(f"{path}: no such file") from exc
    except PermissionError as exc:
        raise PhotoError(f"{path}: not readable (permission denied)") from exc
    except IsADirectoryError as exc:
        raise PhotoError(f"{path}: a folder, not a photo") from exc
    except UnidentifiedImageError as exc:
        what = "an empty file" if path.stat().st_size == 0 else "not an image Pillow can read"
        raise PhotoError(f"{path}: {what}") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PhotoError(f"{path}: too many pixels (a decompression bomb?): {exc}") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt data, as Pillow reports it
        raise PhotoError(f"{path}: cannot decode: {exc}") from exc
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))  # (3, H, W)


def _as_rgb(image, path: Path) -> np.ndarray:
    """(H, W, 3) uint8 of a loaded Pillow image of any mode."""
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
    return np.asarray(image.convert("RGB"), dtype=np.uint8)
