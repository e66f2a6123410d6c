"""A face photo is read one way: the training decoder and the tools' reader agree on a photo's orientation (EXIF)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from alignment import read_photo
from dataset.images import decode, decode_many

ORIENTATION = 0x0112  # the EXIF tag; 6: the stored pixels are shown turned 90 degrees clockwise


def _picture(height: int, width: int) -> np.ndarray:
    """An (H, W, 3) uint8 picture that no turn or mirror maps onto itself: a bright left band, a green top band,
    texture."""
    rng = np.random.default_rng(height * 1000 + width)
    picture = rng.integers(0, 40, (height, width, 3), dtype=np.uint8)
    picture[:, : width // 3] += 180
    picture[: height // 5, :, 1] = 250
    return picture


def _saved(picture: np.ndarray, fmt: str, orientation: int = 6) -> bytes:
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format=fmt, exif=exif, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_exif_orientation_6_decodes_upright_and_the_same_through_both_readers(tmp_path, fmt):
    stored = _picture(96, 128)  # (H, W, 3) as the file stores it
    data = _saved(stored, fmt)
    path = tmp_path / f"turned.{fmt.lower()}"
    path.write_bytes(data)
    photo = read_photo(path)  # the tools' reader (Pillow)
    assert tuple(photo.shape) == (3, 128, 96)  # upright: turned, so height and width swap
    trained = decode(data, str(path), image_size=(128, 96))  # the training decoder (torchvision), size checked
    batch = decode_many([data, data], ["a", "b"])  # the loader's batch path
    # Both decoders are libjpeg(-turbo) with the same settings here: the same pixels exactly.
    assert torch.equal(trained, photo) and all(torch.equal(image, photo) for image in batch)
    unturned = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
    assert torch.equal(photo, torch.rot90(unturned, k=-1, dims=(1, 2)))  # turned clockwise, not mirrored
    with pytest.raises(ValueError, match=r"image is 128x96 \(HxW\), expected 96x128"):
        decode(data, str(path), image_size=(96, 128))  # the stored size is not the size a model is fed
