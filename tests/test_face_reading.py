"""A face photo is read one way and embedded one way: the training decoder and the tools' reader agree on a photo's
orientation (EXIF), and the vector ``scripts/inference.py --output`` writes is the one ``scripts/compare.py`` scores,
with the embedding (flip or not) the model.json's calibrated threshold names."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from alignment import read_photo
from backbones import get_model
from dataset.images import decode, decode_many
from eval.model_card import MODEL_CARD
from eval.verification import embed
from scripts import compare
from tests.helpers import ROOT, tiny_run

TINY = {"widths": [4, 8, 8, 16]}
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


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder as the trainer leaves it: an untrained tiny network's model.pt and its model.json."""
    folder = tmp_path_factory.mktemp("run")
    tiny_run(folder, TINY)
    return folder


def _inference(run: Path, image: Path, output: Path) -> np.ndarray:
    """scripts/inference.py --output as a user runs it: the vector it writes."""
    proc = subprocess.run([sys.executable, "scripts/inference.py", "--weights", str(run), "--image", str(image),
                           "--device", "cpu", "--output", str(output)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return np.load(output)


def _compared(run: Path, first: Path, second: Path) -> np.ndarray:
    """(2, D): the vectors compare.py scores for the two photos (its own command line, its own threshold rule)."""
    args = compare.parse_args([str(first), str(second), "--weights", str(run), "--no-align", "--device", "cpu"])
    return compare.embeddings(args, compare.find_threshold(args).flip, [])


@pytest.mark.process
@pytest.mark.timeout(200)
def test_inference_output_is_the_vector_compare_scores_for_an_exif_turned_jpeg(run, tmp_path, capsys):
    stored = _picture(112, 112)
    (tmp_path / "turned.jpg").write_bytes(_saved(stored, "JPEG"))
    upright = read_photo(tmp_path / "turned.jpg")  # (3, 112, 112), differs from the stored pixels
    Image.fromarray(upright.permute(1, 2, 0).numpy()).save(tmp_path / "upright.png")
    Image.fromarray(stored).save(tmp_path / "stored.png")  # what a reader ignoring EXIF sees

    written = _inference(run, tmp_path / "turned.jpg", tmp_path / "turned.npy")  # (D,) float32
    scored = _compared(run, tmp_path / "turned.jpg", tmp_path / "upright.png")  # (2, D) float64
    assert written.shape == (16,) and written.dtype == np.float32
    np.testing.assert_allclose(written, scored[0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(scored[0], scored[1], rtol=0, atol=1e-6)  # the upright pixels, exactly
    # The flip embedding, of the pixels the training decoder gives for the same bytes.
    net = get_model("tiny", num_features=16, **TINY)
    net.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    trained = decode((tmp_path / "turned.jpg").read_bytes(), "turned.jpg")
    np.testing.assert_allclose(written, embed(trained[None], net, 1, flip=True)[0], rtol=0, atol=1e-6)
    # Read without its orientation the photo is another picture: compare.py tells them apart.
    ignored = _inference(run, tmp_path / "stored.png", tmp_path / "stored.npy")
    assert np.abs(ignored - written).max() > 1e-3
    assert compare.main([str(tmp_path / "turned.jpg"), str(tmp_path / "upright.png"), "--weights", str(run),
                         "--no-align", "--device", "cpu", "--threshold", "0.999"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("same person: above the threshold 0.9990")


@pytest.mark.process
@pytest.mark.timeout(200)
def test_compare_and_inference_embed_as_the_card_s_threshold_was_calibrated(run, tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "model.pt").write_bytes((run / "model.pt").read_bytes())
    card = json.loads((run / MODEL_CARD).read_text())
    face = tmp_path / "face.png"
    Image.fromarray(_picture(112, 112)).save(face)
    net = get_model("tiny", num_features=16, **TINY)
    net.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    crop = read_photo(face)[None]  # (1, 3, 112, 112)
    for embedding, flip in (("no-flip", False), ("flip", True), (None, True)):  # None: a card before the key
        entry = {"cosine": 0.5, "acc": 0.9, "pairs": 10} | ({"embedding": embedding} if embedding else {})
        (folder / MODEL_CARD).write_text(json.dumps({**card, "thresholds": {"lfw": entry}}))
        expected = embed(crop, net, 1, flip=flip)[0]
        np.testing.assert_allclose(_inference(folder, face, tmp_path / "e.npy"), expected, rtol=0, atol=1e-6)
        np.testing.assert_allclose(_compared(folder, face, face)[0], expected, rtol=0, atol=1e-6)
    assert not np.allclose(embed(crop, net, 1, flip=False), embed(crop, net, 1, flip=True) / 2, atol=1e-4)
    # An embedding the tools do not make is refused, naming the card and the key.
    (folder / MODEL_CARD).write_text(json.dumps({**card, "thresholds": {"lfw": {"cosine": 0.5, "embedding": "mean"}}}))
    assert compare.main([str(face), str(face), "--weights", str(folder), "--no-align", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == (f"compare: error: {folder / MODEL_CARD}: thresholds.lfw.embedding is "
                                               f"'mean'; expected one of flip, no-flip")
