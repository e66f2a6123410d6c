"""scripts/inference.py --align and scripts/compare.py as a user types them, on a real face photo (scikit-image's
astronaut), transforms of it and other pictures, with a tiny untrained network and the model.json the trainer
writes; and ``scripts/verify.py --save-threshold``, whose threshold compare.py reads. An untrained network is
enough for the mechanics: it maps two crops of one face to nearly the same embedding (cosine 0.997) and the
astronaut and the cameraman to different ones (0.77)."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.io import encode_png

from backbones.onnx_export import export
from tests.helpers import ROOT, tiny_run

pytest.importorskip("skimage")
DETECTOR = importlib.util.find_spec("facenet_pytorch") is not None
needs_detector = pytest.mark.skipif(not DETECTOR, reason="facenet-pytorch is not installed (requirements-faces.txt)")

TINY = {"widths": [4, 8, 8, 16]}
INSTALL = "pip install requests && pip install --no-deps facenet-pytorch==2.6.0"
# Runs a script's main as `python SCRIPT ARGS...` does, in a Python where `import facenet_pytorch` fails.
WITHOUT_FACENET = ("import runpy, sys; sys.modules['facenet_pytorch'] = None; sys.argv = sys.argv[1:]; "
                   "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """The astronaut as scikit-image ships it (512x512 PNG); turned by 20 degrees and scaled by 1.3 (JPEG);
    mirrored, scaled by 0.6 and pasted into a larger canvas (PNG); the cameraman (grayscale PNG, another face);
    coffee (no face); a truncated JPEG and a text file."""
    from PIL import Image
    from skimage import data

    folder = tmp_path_factory.mktemp("photos")
    astronaut = Image.fromarray(data.astronaut())
    astronaut.save(folder / "astronaut.png")
    turned = astronaut.rotate(20, resample=Image.BILINEAR, expand=True)
    turned.resize((round(1.3 * turned.width), round(1.3 * turned.height)), Image.BILINEAR).save(
        folder / "turned.jpg", quality=90)
    canvas = Image.new("RGB", (800, 600), (40, 90, 30))
    canvas.paste(astronaut.transpose(Image.FLIP_LEFT_RIGHT).resize((307, 307), Image.BILINEAR), (400, 200))
    canvas.save(folder / "mirrored.png")
    Image.fromarray(data.camera()).save(folder / "cameraman.png")
    Image.fromarray(data.coffee()).save(folder / "coffee.jpg", quality=90)
    (folder / "truncated.jpg").write_bytes((folder / "coffee.jpg").read_bytes()[:2000])
    (folder / "notes.txt").write_text("not a photo\n")
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder as the trainer leaves it: an untrained tiny network's model.pt and its model.json; and the
    network exported beside them as model.onnx, as torch2onnx.py writes it."""
    folder = tmp_path_factory.mktemp("run")
    net = tiny_run(folder, TINY, indent=1).eval()
    export(net, folder / "model.onnx")  # as scripts/torch2onnx.py writes it
    return folder


@pytest.fixture(scope="module")
def crops(photos, tmp_path_factory) -> Path:
    """The astronaut's and the mirrored astronaut's faces aligned by the library (``alignment.align_face`` on the
    detector's landmarks), as 112x112 PNGs."""
    from alignment import FaceDetector, align_face, choose_faces, read_photo

    folder = tmp_path_factory.mktemp("crops")
    detector = FaceDetector()
    for name in ("astronaut.png", "mirrored.png"):
        image = read_photo(photos / name)
        faces = choose_faces(detector.detect([image])[0], image.shape[1:])
        assert len(faces) == 1, faces
        (folder / name).write_bytes(encode_png(align_face(image, faces[0].points)).numpy().tobytes())
    return folder


def _cli(*argv, wrapper: str | None = None) -> subprocess.CompletedProcess:
    """``python ARGV...`` in the repository, as a user runs it (``wrapper``: through ``python -c WRAPPER``)."""
    prefix = [sys.executable] + (["-c", wrapper] if wrapper else [])
    return subprocess.run([*prefix, *map(str, argv)], cwd=ROOT, capture_output=True, text=True, timeout=150)


def _similarity(stdout: str) -> float:
    """The number compare.py's similarity line prints (after a line per aligned photo)."""
    line = next((line for line in stdout.splitlines() if ": cosine similarity " in line), None)
    assert line is not None, stdout
    return float(line.rsplit(" ", 1)[1])


def _one_error_line(capsys, tool: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{tool}: error: "), err
    return err[0]


# ---------------------------------------------------------------------------------------- inference.py --align
@pytest.mark.process
@needs_detector
@pytest.mark.timeout(300)
def test_inference_align_embeds_the_crop_align_face_makes(photos, run, crops, tmp_path):
    """The raw photo through --align and the library's aligned crop without it: the same embedding."""
    raw = _cli("scripts/inference.py", "--weights", run, "--img", photos / "astronaut.png", "--align", "--device",
               "cpu", "--output", tmp_path / "raw.npy")
    assert raw.returncode == 0 and raw.stderr == "", raw.stderr
    used, embedded = raw.stdout.splitlines()[:2]
    assert re.fullmatch(rf"{re.escape(str(photos / 'astronaut.png'))}: used a \d+ px face \(score 1\.000\): the only "
                        rf"face found", used), raw.stdout
    assert embedded.startswith(f"{photos / 'astronaut.png'}: embedding of size 16, norm "), raw.stdout
    crop = _cli("scripts/inference.py", "--weights", run, "--img", crops / "astronaut.png", "--device", "cpu",
                "--output", tmp_path / "crop.npy")
    assert crop.returncode == 0, crop.stderr
    # The same crop (PNG is lossless) through the same network: the same numbers.
    np.testing.assert_array_equal(np.load(tmp_path / "raw.npy"), np.load(tmp_path / "crop.npy"))


@needs_detector
@pytest.mark.timeout(120)
def test_inference_align_errors_are_one_line(photos, run, capsys):
    from scripts import inference

    common = ["--weights", str(run), "--device", "cpu", "--align"]
    for name, message in (("coffee.jpg", "no face found"),
                          ("notes.txt", "not an image Pillow can read"), ("missing.jpg", "no such file")):
        assert inference.main([*common, "--img", str(photos / name)]) == 2, name
        assert _one_error_line(capsys, "inference") == f"inference: error: {photos / name}: {message}"
    assert inference.main([*common, "--img", str(photos / "truncated.jpg")]) == 2
    assert _one_error_line(capsys, "inference").startswith(f"inference: error: {photos / 'truncated.jpg'}: cannot "
                                                           f"decode: ")


@pytest.mark.timeout(120)
def test_inference_without_align_warns_that_a_whole_photo_is_not_a_crop(photos, run, capsys):
    """A raw photo without --align is embedded resized, with one warning saying so and what --align does."""
    from scripts import inference

    assert inference.main(["--weights", str(run), "--device", "cpu", "--img", str(photos / "astronaut.png")]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"inference: warning: {photos / 'astronaut.png'} is 512x512, not 112x112: resized; is it an aligned crop? "
        f"(--align detects and aligns it)"]
    assert f"{photos / 'astronaut.png'}: embedding of size 16" in captured.out


# ---------------------------------------------------------------------------------------- compare.py
@pytest.mark.process
@needs_detector
@pytest.mark.timeout(300)
def test_compare_transforms_of_one_photo_and_two_people(photos, run):
    same = _cli("scripts/compare.py", photos / "turned.jpg", photos / "mirrored.png", "--weights", run,
                "--threshold", "0.9", "--device", "cpu")
    assert same.returncode == 0 and same.stderr == "", same.stderr
    lines = same.stdout.splitlines()
    assert [line.split(": used a ")[0] for line in lines[:2]] == [str(photos / name) for name in ("turned.jpg",
                                                                                                   "mirrored.png")]
    assert lines[2].startswith(f"{photos / 'turned.jpg'} ~ {photos / 'mirrored.png'}: cosine similarity ")
    assert _similarity(same.stdout) > 0.99, same.stdout  # measured 0.9970
    assert lines[3:] == ["same person: above the threshold 0.9000 (--threshold)"], lines

    other = _cli("scripts/compare.py", photos / "astronaut.png", photos / "cameraman.png", "--weights",
                 run / "model.pt", "--threshold", "0.9", "--device", "cpu")
    assert other.returncode == 0, other.stderr
    assert _similarity(other.stdout) < 0.85, other.stdout  # measured 0.7687
    assert other.stdout.splitlines()[3:] == ["different people: not above the threshold 0.9000 (--threshold)"]


@pytest.mark.process
@needs_detector
@pytest.mark.timeout(300)
def test_verify_saves_thresholds_that_compare_reads(photos, run, tmp_path, capsys):
    from dataset.verification_set import save_bin
    from scripts import compare

    # A run of its own: --save-threshold writes into its model.json.
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    before = json.loads((folder / "model.json").read_text())
    g = torch.Generator().manual_seed(0)
    for name, pairs in (("synth", 20), ("other", 12)):
        images = torch.randint(0, 256, (2 * pairs, 3, 112, 112), dtype=torch.uint8, generator=g)
        save_bin(tmp_path / f"{name}.bin", [encode_png(im).numpy().tobytes() for im in images],
                 [i % 2 == 0 for i in range(pairs)])
    verify = _cli("scripts/verify.py", "--weights", folder, "--data-dir", tmp_path, "--targets", "synth,other",
                  "--device", "cpu", "--save-threshold", "--json", tmp_path / "scores.json")
    assert verify.returncode == 0, verify.stderr
    assert verify.stdout.splitlines()[-1] == f"saved the thresholds of synth, other in {folder / 'model.json'}"
    card = json.loads((folder / "model.json").read_text())
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert {k: v for k, v in card.items() if k != "thresholds"} == before  # the rest of the card as it was
    assert list(card["thresholds"]) == ["synth", "other"]
    for name, pairs in (("synth", 20), ("other", 12)):
        entry = card["thresholds"][name]
        assert entry["distance"] == scores[name]["threshold"] and entry["acc"] == scores[name]["acc"]
        assert entry["cosine"] == 1 - entry["distance"] / 2 and entry["pairs"] == pairs
        assert entry["file"] == str(tmp_path / f"{name}.bin") and entry["precision"] == "fp32"
        assert entry["embedding"] == "flip"  # what compare.py and inference.py embed with for it

    # compare.py without --threshold: the card's first target; --target another; by the exported model too.
    out = _cli("scripts/compare.py", photos / "astronaut.png", photos / "turned.jpg", "--weights", folder,
               "--device", "cpu")
    assert out.returncode == 0, out.stderr
    entry = card["thresholds"]["synth"]
    verdict = "same person: above" if _similarity(out.stdout) > entry["cosine"] else "different people: not above"
    assert out.stdout.splitlines()[3] == (f"{verdict} the threshold {entry['cosine']:.4f} (calibrated on synth by "
                                          f"scripts/verify.py: accuracy {entry['acc']:.5f} on 20 pairs)"), out.stdout
    pair = [photos / "astronaut.png", photos / "turned.jpg"]
    for model in (["--weights", str(folder / "model.pt")], ["--onnx", str(folder / "model.onnx")]):
        assert compare.main([*map(str, pair), *model, "--target", "other", "--device", "cpu"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert _similarity(lines[2]) == pytest.approx(_similarity(out.stdout), abs=2e-4), (model, lines)
        other = card["thresholds"]["other"]
        assert lines[3].endswith(f"the threshold {other['cosine']:.4f} (calibrated on other by scripts/verify.py: "
                                 f"accuracy {other['acc']:.5f} on 12 pairs)")

    # A target the card does not hold: one line, before any photo is read.
    assert compare.main([*map(str, pair), "--weights", str(folder), "--target", "lfw", "--device", "cpu"]) == 2
    assert _one_error_line(capsys, "compare") == (f"compare: error: --target lfw: {folder / 'model.json'} holds "
                                                  f"thresholds for synth, other")


def test_verify_save_threshold_needs_a_model_json(run, tmp_path, capsys):
    from scripts import verify

    (tmp_path / "backbone.pth").write_bytes((run / "model.pt").read_bytes())
    (tmp_path / "lfw.bin").write_bytes(b"")
    flags = ["--network", "tiny", "--embedding-size", "16", "--network-kwargs", json.dumps(TINY)]
    assert verify.main([*flags, "--weights", str(tmp_path / "backbone.pth"), "--data-dir", str(tmp_path),
                        "--targets", "lfw", "--device", "cpu", "--save-threshold"]) == 2
    assert _one_error_line(capsys, "verify") == (
        f"verify: error: --save-threshold writes into the model.json beside the model, and "
        f"{tmp_path / 'model.json'} does not exist (the trainer writes it beside model.pt); leave out "
        f"--save-threshold and give scripts/compare.py --threshold instead")
    (tmp_path / "model.json").write_text("[1, 2]")
    assert verify.main([*flags, "--weights", str(tmp_path / "backbone.pth"), "--data-dir", str(tmp_path),
                        "--targets", "lfw", "--device", "cpu", "--save-threshold"]) == 2
    assert _one_error_line(capsys, "verify") == (
        f"verify: error: {tmp_path / 'model.json'}: expected a JSON object whose 'thresholds' is an object; "
        f"--save-threshold cannot write into it")
    with pytest.raises(SystemExit) as stop:
        verify.main([*flags, "--random-init", "0", "--data-dir", str(tmp_path), "--save-threshold"])
    assert stop.value.code == 2 and "--random-init has none" in capsys.readouterr().err


@needs_detector
@pytest.mark.timeout(120)
def test_compare_without_a_threshold_says_so(photos, run, crops, tmp_path, capsys):
    from scripts import compare

    official = tmp_path / "backbone.pth"  # weights without a model.json, as an official download
    official.write_bytes((run / "model.pt").read_bytes())
    flags = ["--network", "tiny", "--embedding-size", "16", "--network-kwargs", json.dumps(TINY)]
    pair = [str(crops / "astronaut.png"), str(crops / "mirrored.png")]
    assert compare.main([*pair, *flags, "--weights", str(official), "--no-align", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert _similarity(out[0]) > 0.99 and out[1:] == [
        f"no threshold known: there is no {tmp_path / 'model.json'} to hold a calibrated one; pass --threshold"]
    assert compare.main([*pair, "--weights", str(run), "--no-align", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        f"no threshold known: {run / 'model.json'} holds no calibrated one; pass --threshold, or calibrate one: "
        f"python scripts/verify.py --weights {run} --data-dir DIR --targets lfw --save-threshold")


@needs_detector
@pytest.mark.timeout(180)
def test_compare_no_align_takes_crops_as_they_are(photos, run, crops, capsys):
    """--no-align: the library's crops give the similarity the raw photos give with alignment; a photo that is
    not a crop is resized with a warning."""
    from scripts import compare

    common = ["--weights", str(run), "--device", "cpu", "--threshold", "0.5"]
    assert compare.main([str(photos / "astronaut.png"), str(photos / "mirrored.png"), *common]) == 0
    aligned = _similarity(capsys.readouterr().out)
    assert compare.main([str(crops / "astronaut.png"), str(crops / "mirrored.png"), *common, "--no-align"]) == 0
    assert _similarity(capsys.readouterr().out) == aligned
    assert compare.main([str(crops / "astronaut.png"), str(photos / "astronaut.png"), *common, "--no-align"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"compare: warning: {photos / 'astronaut.png'} is 512x512, not 112x112: resized; is it an aligned crop? "
        f"(without --no-align the face is detected and aligned)"]
    assert _similarity(captured.out) < 0.99  # the whole photo squeezed is not the face


@needs_detector
@pytest.mark.timeout(120)
def test_compare_errors_are_one_line(photos, run, capsys):
    from scripts import compare

    common = ["--weights", str(run), "--device", "cpu"]
    for name, message in (("coffee.jpg", "no face found"),
                          ("missing.jpg", "no such file"), ("notes.txt", "not an image Pillow can read")):
        assert compare.main([str(photos / "astronaut.png"), str(photos / name), *common]) == 2, name
        assert _one_error_line(capsys, "compare") == f"compare: error: {photos / name}: {message}"
        assert capsys.readouterr().out == ""
    for argv, message in ((["--threshold", "1.5"], "--threshold is a cosine similarity, in [-1, 1]; got 1.5"),
                          (["--threshold", "0.3", "--target", "lfw"],
                           "--threshold 0.3 and --target lfw both choose the threshold; give one")):
        with pytest.raises(SystemExit) as stop:
            compare.main([str(photos / "astronaut.png"), str(photos / "turned.jpg"), *common, *argv])
        assert stop.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"compare.py: error: {message}"


@pytest.mark.process
@pytest.mark.timeout(180)
def test_without_facenet_pytorch_both_tools_say_how_to_install(photos, run, tmp_path):
    for script, argv in (("scripts/inference.py", ["--img", photos / "astronaut.png", "--align"]),
                         ("scripts/compare.py", [photos / "astronaut.png", photos / "turned.jpg"])):
        proc = _cli(script, *argv, "--weights", run, "--device", "cpu", wrapper=WITHOUT_FACENET)
        tool = Path(script).stem
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"{tool}: error: face detection needs the facenet-pytorch package (")
        assert lines[0].endswith(f"install it with: {INSTALL}") and proc.stdout == ""
    # Aligned crops need no detector.
    crop = tmp_path / "crop.png"
    crop.write_bytes(encode_png(torch.full((3, 112, 112), 120, dtype=torch.uint8)).numpy().tobytes())
    proc = _cli("scripts/compare.py", crop, crop, "--no-align", "--weights", run, "--device", "cpu",
                wrapper=WITHOUT_FACENET)
    assert proc.returncode == 0 and proc.stdout.startswith(f"{crop} ~ {crop}: cosine similarity 1.0000"), proc.stderr


# ---------------------------------------------------------------------------------------- which face, and why not
@pytest.fixture(scope="module")
def framed(tmp_path_factory) -> Path:
    """Two faces in one photo (the astronaut, and her copy at 0.6 beside her); her face alone at 0.35 (about 30 px)."""
    from PIL import Image
    from skimage import data

    folder = tmp_path_factory.mktemp("framed")
    astronaut = Image.fromarray(data.astronaut())
    group = Image.new("RGB", (900, 560), (40, 90, 30))
    group.paste(astronaut, (0, 0))
    group.paste(astronaut.resize((307, 307), Image.BILINEAR), (560, 120))
    group.save(folder / "group.png")
    small = Image.new("RGB", (400, 400), (40, 90, 30))
    small.paste(astronaut.resize((179, 179), Image.BILINEAR), (110, 110))
    small.save(folder / "small.png")
    return folder


@needs_detector
@pytest.mark.timeout(300)
def test_the_tools_say_which_face_they_used_and_why_one_does_not_count(framed, run, capsys):
    """inference --align and compare take --min-score / --min-face-size, say how many faces counted and which one
    they used; a face found but smaller than --min-face-size is named as small, not as 'no face found'."""
    from scripts import compare, inference

    common = ["--weights", str(run), "--device", "cpu"]
    assert inference.main([*common, "--img", str(framed / "group.png"), "--align"]) == 0
    used = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(rf"{re.escape(str(framed / 'group.png'))}: used a (\d+) px face \(score [01]\.\d{{3}}\): the "
                        rf"largest of 2 faces, nearest the centre", used), used
    assert int(re.search(r"used a (\d+) px", used)[1]) > 70  # the full-size astronaut's, not her copy's (~52 px)

    assert inference.main([*common, "--img", str(framed / "small.png"), "--align"]) == 2
    error = _one_error_line(capsys, "inference")
    assert re.fullmatch(rf"inference: error: {re.escape(str(framed / 'small.png'))}: the largest face is \d+ px, "
                        rf"below --min-face-size 40", error), error
    assert compare.main([str(framed / "small.png"), str(framed / "group.png"), *common, "--threshold", "0.5",
                         "--min-face-size", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"{re.escape(str(framed / 'small.png'))}: used a \d+ px face \(score [01]\.\d{{3}}\): the "
                        rf"only face found", lines[0]), lines
    assert lines[1].endswith("the largest of 2 faces, nearest the centre") and "cosine similarity" in lines[2]
    assert compare.main([str(framed / "group.png"), str(framed / "group.png"), *common, "--threshold", "0.5",
                         "--min-score", "1.0"]) == 2  # no face scores above 1.0: the best one's score is named
    assert re.search(r": the best face scores [01]\.\d{4}, below --min-score 1$", _one_error_line(capsys, "compare"))
    with pytest.raises(SystemExit) as stop:
        inference.main([*common, "--img", str(framed / "group.png"), "--align", "--min-score", "1.5"])
    assert stop.value.code == 2 and "--min-score must be in [0, 1], got 1.5" in capsys.readouterr().err
