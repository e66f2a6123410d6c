"""eval.ijb_protocol (the training data's five-point alignment, template aggregation, the 1:1 protocol) and
scripts/ijb.py (also run as ``python -m eval.ijb``) on a generated mini IJB folder."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torchvision.io import encode_png

from alignment import ARCFACE_TEMPLATE, align_face, warp_to_template
from eval import ijb_protocol
from scripts import ijb
from tests.helpers import ROOT, UNWRITABLE


def _similarity(scale: float, angle: float, tx: float, ty: float) -> np.ndarray:
    c, s = scale * math.cos(angle), scale * math.sin(angle)
    return np.array([[c, -s, tx], [s, c, ty]])


def _apply(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    return points @ matrix[:, :2].T + matrix[:, 2]


def _face(identity: int, g: torch.Generator) -> torch.Tensor:
    """A 112×112 "face" of an identity: a smooth identity-specific colour pattern plus a little noise."""
    ys, xs = torch.meshgrid(torch.linspace(0, 1, 112), torch.linspace(0, 1, 112), indexing="ij")
    base = [torch.stack([xs, ys, 1 - xs]), torch.stack([1 - ys, xs * ys, ys])][identity] * 200 + 25
    return (base + 8 * torch.randn(3, 112, 112, generator=g)).clamp(0, 255).to(torch.uint8)


def _loose_crop(face: torch.Tensor, matrix: np.ndarray, size: int) -> tuple[torch.Tensor, np.ndarray]:
    """``face`` placed into a larger (size x size) image by the similarity ``matrix``; its landmarks there."""
    return warp_to_template(face, matrix, size), _apply(matrix, ARCFACE_TEMPLATE)


def test_the_protocol_aligns_with_the_training_data_s_alignment_and_undoes_the_placement_of_a_face(tmp_path):
    face = _face(0, torch.Generator().manual_seed(0))
    image, landmarks = _loose_crop(face, _similarity(1.3, 0.25, 40.0, 20.0), 200)
    (tmp_path / "loose_crop").mkdir()
    (tmp_path / "loose_crop" / "1.png").write_bytes(encode_png(image).numpy().tobytes())
    meta = ijb_protocol.IJBMeta(["1.png"], np.array([1]), np.array([1]), landmarks[None].astype(np.float32),
                                np.array([1.0], dtype=np.float32), np.array([[1, 1]]), np.array([1]))
    aligned = ijb_protocol.AlignedFaces(tmp_path / "loose_crop", meta)[0]
    assert torch.equal(aligned, align_face(image, landmarks.astype(np.float32)))
    assert aligned.shape == (3, 112, 112)
    inner = (slice(None), slice(10, 102), slice(10, 102))  # away from the border, which resampling blurs
    assert (aligned[inner].float() - face[inner].float()).abs().mean() < 6


def test_template_features_average_media_then_sum():
    feats = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 5.0]])
    templates = np.array([7, 7, 7, 9])
    medias = np.array([1, 1, 2, 1])  # template 7: media 1 (two frames), media 2 (one photo)
    ids, out = ijb_protocol.template_features(feats, templates, medias)
    assert ids.tolist() == [7, 9]
    expected = np.array([2.0, 2.0]) / np.linalg.norm([2.0, 2.0])  # mean(1, 3) = 2 for media 1, plus (0, 2)
    np.testing.assert_allclose(out, [expected, [0.0, 1.0]])
    # The same media id in another template is another media.
    ids, out = ijb_protocol.template_features(feats, np.array([7, 7, 9, 9]), np.array([1, 1, 1, 1]))
    np.testing.assert_allclose(out, [[1.0, 0.0], [0.0, 1.0]])


def test_tar_at_far_reads_the_nearest_roc_point():
    labels = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    scores = np.array([0.9, 0.8, 0.3, 0.2, 0.85, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    tar, fpr, tpr, area = ijb_protocol.tar_at_far(labels, scores, far_levels=(1e-3, 0.1))
    # sklearn's ROC: (0, 0), (0, .25), (.1, .25), (.1, 1), (1, 1). Of the points tied at the nearest FAR
    # the first (strictest threshold) is read, as in the published evaluation: 0 at FAR 0, .25 at FAR .1.
    assert tar == {"0.001": 0.0, "0.1": 0.25}
    with pytest.raises(ValueError, match="only label 1"):
        ijb_protocol.tar_at_far(np.ones(3, dtype=int), scores[:3])


@pytest.fixture(scope="module")
def mini_ijb(tmp_path_factory):
    """IJBC-like folder: 2 identities x 2 templates; every template has 2 media, the first with 2 frames."""
    root = tmp_path_factory.mktemp("IJBC")
    (root / "loose_crop").mkdir()
    (root / "meta").mkdir()
    g = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    faces, landmarks = [], []
    image_id, media_id = 1, 100
    for template in range(1, 5):
        identity = (template - 1) // 2
        for media, frames in ((0, 2), (1, 1)):
            for _ in range(frames):
                matrix = _similarity(rng.uniform(1.1, 1.6), rng.uniform(-0.3, 0.3), rng.uniform(10, 40),
                                     rng.uniform(10, 40))
                image, points = _loose_crop(_face(identity, g), matrix, 230)
                name = f"{image_id}.png"
                (root / "loose_crop" / name).write_bytes(encode_png(image).numpy().tobytes())
                faces.append(f"{name} {template} {media_id + media}")
                coords = " ".join(f"{v:.3f}" for v in points.reshape(-1))
                landmarks.append(f"{name} {coords} {rng.uniform(0.8, 1.0):.4f}")
                image_id += 1
            media_id += 2
    pairs = [f"{a} {b} {int((a - 1) // 2 == (b - 1) // 2)}" for a in range(1, 5) for b in range(a + 1, 5)]
    (root / "meta" / "ijbc_face_tid_mid.txt").write_text("\n".join(faces) + "\n")
    (root / "meta" / "ijbc_name_5pts_score.txt").write_text("\n".join(landmarks) + "\n")
    (root / "meta" / "ijbc_template_pair_label.txt").write_text("\n".join(pairs) + "\n")
    return root


class _ColourNet(nn.Module):
    """A fixed "backbone": mean colour of a 4x4 grid of cells; enough to tell the two identities apart."""

    def forward(self, x):
        return nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)  # (N, 48)


def test_protocol_on_mini_ijb(mini_ijb):
    meta = ijb_protocol.read_meta(mini_ijb, "IJBC")
    assert len(meta.names) == 12 and meta.pairs.shape == (6, 2) and meta.labels.tolist() == [1, 0, 0, 0, 0, 1]
    result = ijb_protocol.evaluate_ijb(mini_ijb, "IJBC", _ColourNet(), batch_size=5)
    assert result["images"] == 12 and result["templates"] == 4 and result["pairs"] == 6
    # Every genuine pair scores above every impostor pair. (TAR read at the nearest ROC point is 0 here:
    # with 4 impostors the nearest point to any small FAR is the first one at FAR 0, tpr 0.)
    assert result["auc"] == 1.0
    assert set(result["tar"]) == {f"{far:g}" for far in ijb_protocol.FAR_LEVELS}


def test_bad_protocol_files_are_named(mini_ijb, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ijbb_face_tid_mid\.txt"):
        ijb_protocol.read_meta(mini_ijb, "IJBB")
    bad = tmp_path / "meta"
    bad.mkdir()
    for name in ("ijbc_face_tid_mid.txt", "ijbc_template_pair_label.txt"):
        (bad / name).write_text((mini_ijb / "meta" / name).read_text())
    lines = (mini_ijb / "meta" / "ijbc_name_5pts_score.txt").read_text().splitlines()
    (bad / "ijbc_name_5pts_score.txt").write_text("\n".join(lines[:2] + [lines[2].rsplit(" ", 1)[0]]) + "\n")
    with pytest.raises(ValueError, match=r"ijbc_name_5pts_score\.txt:3: expected 12 space-separated fields, got 11"):
        ijb_protocol.read_meta(tmp_path, "IJBC")


def test_a_folder_for_a_protocol_file_and_a_file_for_the_image_folder_are_named(mini_ijb, tmp_path):
    shutil.copytree(mini_ijb / "meta", tmp_path / "meta")
    (tmp_path / "loose_crop").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as exc:
        ijb_protocol.evaluate_ijb(tmp_path, "IJBC", torch.nn.Identity())
    assert str(exc.value) == f"IJB image folder is a file, not a folder: {tmp_path / 'loose_crop'}"
    (tmp_path / "meta" / "ijbc_face_tid_mid.txt").unlink()
    (tmp_path / "meta" / "ijbc_face_tid_mid.txt").mkdir()
    with pytest.raises(FileNotFoundError) as exc:
        ijb_protocol.read_meta(tmp_path, "IJBC")
    assert str(exc.value) == f"IJB protocol file is a folder, not a file: {tmp_path / 'meta' / 'ijbc_face_tid_mid.txt'}"


def test_empty_protocol_files_are_named(tmp_path):
    (tmp_path / "meta").mkdir()
    for name in ("ijbc_face_tid_mid.txt", "ijbc_template_pair_label.txt", "ijbc_name_5pts_score.txt"):
        (tmp_path / "meta" / name).write_text("\n")
    with pytest.raises(ValueError, match=r"ijbc_face_tid_mid\.txt: no rows"):
        ijb_protocol.read_meta(tmp_path, "IJBC")


def test_cli_names_an_output_it_cannot_write_after_the_table(mini_ijb, capsys):
    rc = ijb.main(["--network", "tiny", "--embedding-size", "8", "--network-kwargs", '{"widths": [4, 4, 8, 8]}',
                   "--random-init", "0", "--data-dir", str(mini_ijb), "--target", "IJBC", "--num-workers", "0",
                   "--batch-size", "6", "--json", f"{UNWRITABLE}/ijb.json"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out.splitlines()[1].startswith("IJBC")  # the results are printed first
    err = [line for line in captured.err.replace("\r", "\n").splitlines() if line.startswith("ijb")]
    assert len(err) == 1 and err[0].startswith("ijb: error: ") and UNWRITABLE in err[0], err
    assert "Traceback" not in captured.err


@pytest.mark.process
@pytest.mark.timeout(120)
def test_cli_names_an_image_that_fails_in_a_loader_worker(mini_ijb, tmp_path, capsys):
    data = tmp_path / "IJBC"
    shutil.copytree(mini_ijb, data)
    (data / "loose_crop" / "3.png").write_bytes(b"not an image")
    rc = ijb.main(["--network", "tiny", "--embedding-size", "8", "--network-kwargs", '{"widths": [4, 4, 8, 8]}',
                   "--random-init", "0", "--data-dir", str(data), "--target", "IJBC", "--num-workers", "1",
                   "--batch-size", "6"])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.startswith("ijb")]
    assert rc == 2 and len(err) == 1 and "3.png" in err[0], err
    assert "Traceback" not in err[0] and "Caught" not in err[0] and len(err[0]) < 600, err


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cli_on_mini_ijb(mini_ijb, tmp_path, capsys, monkeypatch, precision):
    pytest.importorskip("backbones")
    evaluated = []  # the backbone the protocol ran: under bf16 autocast with --precision bf16
    protocol = ijb.evaluate_ijb
    monkeypatch.setattr(ijb, "evaluate_ijb", lambda data, target, backbone, *rest: (
        evaluated.append(backbone), protocol(data, target, backbone, *rest))[1])
    rc = ijb.main(["--network", "tiny", "--embedding-size", "8", "--network-kwargs", '{"widths": [4, 4, 8, 8]}',
                   "--random-init", "0", "--data-dir", str(mini_ijb), "--target", "IJBC", "--num-workers", "0",
                   "--batch-size", "6", "--json", str(tmp_path / "ijb.json"), "--roc", str(tmp_path / "roc.png"),
                   "--precision", precision])
    assert getattr(evaluated[0], "dtype", None) == {"fp32": None, "bf16": torch.bfloat16}[precision]
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and "FAR=1e-06" in out[0] and out[1].startswith("IJBC")
    summary = json.loads((tmp_path / "ijb.json").read_text())["IJBC"]
    assert set(summary["tar"]) == {"1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.1"} and summary["pairs"] == 6
    assert (tmp_path / "roc.png").stat().st_size > 0


@pytest.mark.process
@pytest.mark.timeout(120)
def test_python_m_eval_ijb_still_runs_the_tool(mini_ijb, tmp_path):
    """The old command runs scripts/ijb.py with its arguments, exit status and messages."""
    model = ["--network", "tiny", "--embedding-size", "8", "--network-kwargs", '{"widths": [4, 4, 8, 8]}',
             "--random-init", "0", "--num-workers", "0", "--batch-size", "6"]
    proc = subprocess.run([sys.executable, "-m", "eval.ijb", *model, "--data-dir", str(mini_ijb), "--json",
                           str(tmp_path / "ijb.json")], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and proc.stdout.splitlines()[1].startswith("IJBC"), proc.stderr
    assert json.loads((tmp_path / "ijb.json").read_text())["IJBC"]["pairs"] == 6
    proc = subprocess.run([sys.executable, "-m", "eval.ijb", *model, "--data-dir", str(tmp_path / "none")],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"ijb: error: IJB protocol file not found: {tmp_path / 'none' / 'meta' / 'ijbc_face_tid_mid.txt'}"]
