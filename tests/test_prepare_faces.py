"""scripts/prepare_faces.py and its library ``photos``: photos -> detected, aligned faces -> train.rec, holdout.bin,
report.csv, preview.png.

The photos are made from the one real face at hand, scikit-image's astronaut: five "identities" of her under
different tints, places, rotations, scales and mirroring, plus photos without a face (noise, a flat colour), one
with a second smaller face beside hers (left out: no model tells which face is bob's), a 16-bit grey copy of
alice's first photo (readable, and marked as a duplicate), and bad files (truncated, empty, not an image, a
decompression bomb, a dangling link, a file nobody may read). The main flow runs as a user types it, in a
process; the photos go on to train.py and eval.verify. MTCNN takes about 0.2 s a photo on one core, so the sets
stay small and the main output is made once per module; the detections it keeps let the other runs over the
same photos decide without detecting.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.io import encode_jpeg

from alignment import ARCFACE_TEMPLATE, FacePolicy, align_face, decide, read_photo
from alignment.detect import INSTALL, Face, FaceDetector
from alignment.template import apply_transform
from dataset import build_dataset
from dataset.recordio import write_insightface_rec
from dataset.verification_set import load_bin
from photos.holdout import form_pairs
from photos.pack import OUTPUT_FILES
from photos.report import REPORT_COLUMNS
from photos.work import WORK
from scripts import prepare_faces
from tests.helpers import ROOT, subprocess_env, tiny_run, train

pytest.importorskip("facenet_pytorch")
pytest.importorskip("skimage")
pytestmark = pytest.mark.process  # scripts/prepare_faces.py runs in processes from module fixtures

SCRIPT = str(ROOT / "scripts" / "prepare_faces.py")
# The flags of the main output: batches of 3 photos, so that a run interrupted has photos done and photos to do.
FLAGS = ["--holdout", "2", "--batch-size", "3"]
TINTS = {"alice": (1.0, 1.0, 1.0), "bob": (1.15, 0.95, 0.8), "carol": (0.8, 0.95, 1.15), "dave": (0.9, 1.1, 0.9),
         "eve": (1.1, 0.85, 1.1)}
ROOT_USER = os.geteuid() == 0  # root reads a file whatever its mode: the chmod 000 photo is left out


# ------------------------------------------------------------------------------------------------ photos

def astronaut(angle: float = 0.0, scale: float = 1.0, tint=(1.0, 1.0, 1.0), mirror: bool = False,
              canvas: tuple[int, int] = (640, 560), at: tuple[int, int] = (40, 20)):
    """A PIL photo of the astronaut (512x512, one face) tinted, mirrored, scaled, rotated and pasted on a grey
    canvas (W, H) at ``at``."""
    from PIL import Image
    from skimage.data import astronaut as photo

    image = Image.fromarray(photo())
    if mirror:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    image = Image.fromarray((np.asarray(image, np.float32) * np.float32(tint)).clip(0, 255).astype(np.uint8))
    if scale != 1:
        image = image.resize((round(512 * scale),) * 2, Image.Resampling.BILINEAR)
    if angle:
        image = image.rotate(angle, resample=Image.Resampling.BILINEAR, expand=True, fillcolor=(90, 90, 90))
    background = Image.new("RGB", canvas, (90, 90, 90))
    background.paste(image, at)
    return background


def _encoded(image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A PNG whose header announces ``width x height`` pixels (a decompression bomb), a few bytes on disk."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + chunk(b"IEND", b""))


# What each photo of make_photos must become: (status, words of the reason).
EXPECTED = {
    "alice/0.jpg": ("kept", ""), "alice/1.jpg": ("kept", ""), "alice/2.png": ("kept", ""),
    "alice/3.jpg": ("no_face", "no face found"), "alice/4-16bit.png": ("kept", ""),
    "bob/0.jpg": ("kept", ""), "bob/1.jpg": ("kept", ""), "bob/2.webp": ("kept", ""),
    "bob/3-two-faces.jpg": ("several_faces", "2 faces: telling which is the identity's needs a recognition model"),
    "bob/4-truncated.jpg": ("unreadable", "cannot decode"),
    "carol/0.jpg": ("kept", ""), "carol/1.jpg": ("kept", ""), "carol/2.png": ("kept", ""),
    "carol/3-flat.png": ("no_face", "no face found"), "carol/4-empty.jpg": ("unreadable", "an empty file"),
    "dave/0.jpg": ("kept", ""), "dave/1.jpg": ("kept", ""), "dave/2.png": ("kept", ""),
    "dave/3-text.jpg": ("unreadable", "not an image Pillow can read"),
    "dave/4-bomb.png": ("unreadable", "decompression bomb"),
    "eve/0.jpg": ("kept", ""), "eve/1.jpg": ("kept", ""), "eve/2.png": ("kept", ""),
    "eve/3-link.jpg": ("unreadable", "no such file"),
    **({} if ROOT_USER else {"eve/4-locked.jpg": ("unreadable", "permission denied")}),
}


def make_photos(root: Path) -> Path:
    """The test photos of EXPECTED under ``root/<identity>/``, and two files that are not photos."""
    from PIL import Image

    def put(name: str, data: bytes) -> None:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)

    for k, (identity, tint) in enumerate(TINTS.items()):
        shift = (40 + 14 * k, 20 + 6 * k)  # each identity's photos elsewhere on the canvas: no copies of alice's
        put(f"{identity}/0.jpg", _encoded(astronaut(0, 1.0, tint, at=shift), "JPEG", quality=90))
        put(f"{identity}/1.jpg", _encoded(astronaut(12, 0.8, tint, canvas=(700, 600), at=shift), "JPEG", quality=90))
        put(f"{identity}/2.{'webp' if identity == 'bob' else 'png'}",
            _encoded(astronaut(-10, 0.6, tint, mirror=True, canvas=(500, 480), at=shift),
                     "WEBP" if identity == "bob" else "PNG", **({"quality": 90} if identity == "bob" else {})))
    rng = np.random.default_rng(0)
    put("alice/3.jpg", _encoded(Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)), "JPEG"))
    gray = np.asarray(astronaut().convert("L"), np.uint16) * 257  # 16 bits per pixel, 0..65535
    put("alice/4-16bit.png", _encoded(Image.fromarray(gray), "PNG"))
    two = astronaut(canvas=(900, 600), at=(0, 40))
    two.paste(astronaut(scale=0.6).crop((0, 0, 330, 300)), (560, 120))  # her face again, 51 px to her 88
    put("bob/3-two-faces.jpg", _encoded(two, "JPEG", quality=90))
    full = _encoded(astronaut(tint=TINTS["bob"]), "JPEG", quality=90)
    put("bob/4-truncated.jpg", full[: len(full) // 2])
    put("carol/3-flat.png", _encoded(Image.new("RGB", (320, 240), (200, 180, 160)), "PNG"))
    put("carol/4-empty.jpg", b"")
    put("dave/3-text.jpg", b"this is not a photo\n")
    put("dave/4-bomb.png", _bomb_png())
    (root / "eve" / "3-link.jpg").symlink_to(root / "eve" / "gone.jpg")
    if not ROOT_USER:
        put("eve/4-locked.jpg", full)
        (root / "eve" / "4-locked.jpg").chmod(0)
    put("notes.txt", b"not an identity\n")
    put("dave/readme.txt", b"not a photo\n")
    return root


def tree_digest(root: Path) -> str:
    """Every name, link target, mode and file content under ``root``."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(f"{path.relative_to(root)}|{oct(path.lstat().st_mode)}|".encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file() and os.access(path, os.R_OK):
            digest.update(path.read_bytes())
    return digest.hexdigest()


def output_bytes(out: Path) -> dict[str, bytes]:
    """Every file under ``out`` (hidden ones included) by its relative name."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def report(out: Path) -> list[dict[str, str]]:
    with open(out / "report.csv", newline="") as f:
        return list(csv.DictReader(f))


def cli(*args, timeout: float = 240, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout, **popen)


def run_main(capsys, *args) -> tuple[int, str, str]:
    """``prepare_faces.main`` in this process (faster than a process for the smaller cases)."""
    rc = prepare_faces.main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The main output, made once as a user makes it: ``(photos, out, completed process, input digest before)``."""
    base = tmp_path_factory.mktemp("faces")
    photos = make_photos(base / "photos")
    before = tree_digest(photos)
    proc = cli(photos, base / "out", *FLAGS, "--workers", "1", timeout=280)
    assert proc.returncode == 0, proc.stderr
    return photos, base / "out", proc, before


# ---------------------------------------------------------------------------------------------- the main flow

@pytest.mark.timeout(300)
def test_every_photo_gets_its_decision_in_the_report_and_one_summary_line(made):
    photos, out, proc, before = made
    assert tree_digest(photos) == before, "the input folder was modified"
    rows = report(out)
    assert list(rows[0]) == list(REPORT_COLUMNS)
    assert [r["path"] for r in rows] == sorted(EXPECTED, key=lambda p: (p.split("/")[0], p))
    for row in rows:
        status, reason = EXPECTED[row["path"]]
        assert row["identity"] == row["path"].split("/")[0]
        assert row["status"] == status or (status == "kept" and row["status"] == "holdout"), row
        assert reason in row["reason"], row
        if status == "kept":
            assert float(row["score"]) >= 0.9 and row["faces"] == "1", row
            assert len(row["box"].split()) == 4 and len(row["landmarks"].split()) == 10, row
        elif status != "several_faces":
            assert row["label"] == "" and row["landmarks"] == "", row
        assert row["similarity"] == "", row  # no model
        assert row["duplicate_of"] == ("alice/0.jpg" if row["path"] == "alice/4-16bit.png" else ""), row
    held = sorted({r["identity"] for r in rows if r["status"] == "holdout"})
    train_ids = [i for i in TINTS if i not in held]
    assert len(held) == 2 and all(r["label"] == "" for r in rows if r["status"] == "holdout")
    for row in rows:
        if row["status"] == "kept":
            assert row["label"] == str(train_ids.index(row["identity"])), row  # class ids follow sorted names
    # The photo with two faces is left out of bob's class, counted as such, and shows its best face.
    two = next(r for r in rows if "two-faces" in r["path"])
    assert two["label"] == "" and two["faces"] == "2" and len(two["landmarks"].split()) == 10, two

    # One line per unreadable photo on stderr, and the files without a photo suffix named once.
    unreadable = [p for p, (s, _) in EXPECTED.items() if s == "unreadable"]
    lines = proc.stderr.strip().splitlines()
    assert sorted(line.split()[2].rstrip(":") for line in lines if " unreadable " in line) == sorted(unreadable), lines
    assert sum("ignored" in line for line in lines) == 2 and len(lines) == len(unreadable) + 2, lines

    kept = sum(r["status"] in ("kept", "holdout") for r in rows)
    per_id = [sum(r["identity"] == i and r["status"] == "kept" for r in rows) for i in train_ids]
    held_faces = [sum(r["identity"] == i for r in rows if r["status"] == "holdout") for i in held]
    # Every same-identity pair but that of alice's photo and its grey copy, which is never a pair.
    pairs = 2 * min(sum(n * (n - 1) // 2 for n in held_faces) - ("alice" in held), 1500)
    summary = (f"prepare_faces: {len(rows)} photos: {kept} kept, 2 no face, 1 several faces, 0 below the "
               f"thresholds, {len(unreadable)} unreadable, 1 duplicate; 3 identities in train.rec ({sum(per_id)} "
               f"faces, {min(per_id)}-{max(per_id)} per identity), 2 held out in holdout.bin ({pairs} pairs)")
    assert proc.stdout.strip().splitlines() == [summary]
    assert json.loads((out / "prepare_faces.json").read_text())["summary"] == summary
    assert sorted(p.name for p in out.iterdir()) == sorted([*OUTPUT_FILES, WORK])  # the detections are kept


@pytest.mark.timeout(120)
def test_the_rec_reads_back_with_every_label_and_the_bin_pairs_the_held_out_faces(made):
    _, out, _, _ = made
    rows = report(out)
    dataset = build_dataset(str(out))
    kept = [r for r in rows if r["status"] == "kept"]
    assert dataset.num_classes == 3 and len(dataset) == len(kept)
    # Records are grouped by class id, in the report's order within a class.
    expected = [int(r["label"]) for r in sorted(kept, key=lambda r: int(r["label"]))]
    assert [dataset.raw(i)[1] for i in range(len(dataset))] == expected
    image, label = dataset[0]
    assert image.shape == (3, 112, 112) and image.dtype == torch.uint8 and int(label) == 0

    held = [r for r in rows if r["status"] == "holdout"]
    data = load_bin(out / "holdout.bin")
    assert len(data.issame) == len(data.images) // 2 and data.images.shape[1:] == (3, 112, 112)
    assert data.issame == [i % 2 == 0 for i in range(len(data.issame))]  # same, different, same, ...
    # Each crop in the .bin is one of the held-out faces, and a pair is "same" when both are of one identity.
    faces = {}
    dataset_images = {dataset[i][0].numpy().tobytes() for i in range(len(dataset))}
    for image in data.images:
        assert image.numpy().tobytes() not in dataset_images, "a held-out face is in train.rec"
        faces.setdefault(image.numpy().tobytes(), len(faces))
    assert len(faces) <= len(held)
    identity_of = _identities_of_bin_images(data, out, held)
    for i, same in enumerate(data.issame):
        a, b = identity_of[2 * i], identity_of[2 * i + 1]
        assert (a == b) == same and data.images[2 * i].numpy().tobytes() != data.images[2 * i + 1].numpy().tobytes()


def _identities_of_bin_images(data, out: Path, held: list[dict]) -> list[str]:
    """Which held-out identity each image of the .bin shows: each image is matched to the crop of the photo its
    report row names (the crop is made again from the photo and the row's landmarks)."""
    photos = out.parent / "photos"
    crops = {}
    for row in held:
        points = np.array(row["landmarks"].split(), dtype=np.float64).reshape(5, 2)
        crop = align_face(read_photo(photos / row["path"]), points).float()
        crops[row["path"]] = (crop, row["identity"])
    identities = []
    for image in data.images:
        # The report's landmarks are rounded to 0.1 px and the .bin holds JPEGs: the nearest crop is the one.
        path = min(crops, key=lambda p: (crops[p][0] - image.float()).abs().mean())
        identities.append(crops[path][1])
    return identities


@pytest.mark.timeout(300)
def test_the_output_trains_and_its_holdout_bin_is_scored_by_eval_verify(made, tmp_path):
    _, out, _, _ = made
    run = tmp_path / "run"
    train("configs/debug_cpu", run, f"rec={out}", "num_classes=none", "num_image=none", "max_steps=20",
          "batch_size=4", "val_targets=holdout", "verbose=10", "frequent=5", "save_every_steps=0")
    log = (run / "training.log").read_text()
    assert f"data {out}: num_classes = 3 (from the dataset)" in log and "step 20/20" in log, log[-3000:]
    assert "verification target holdout" in log and "verification at step 20" in log, log[-3000:]
    proc = subprocess.run([sys.executable, "-m", "eval.verify", "--weights", str(run / "model.pt"), "--data-dir",
                           str(out), "--targets", "holdout", "--device", "cpu", "--json", str(tmp_path / "v.json")],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    scored = json.loads((tmp_path / "v.json").read_text())["holdout"]
    assert scored["pairs"] == len(load_bin(out / "holdout.bin").issame) and 0 <= scored["acc"] <= 1


@pytest.mark.timeout(300)
def test_the_same_input_gives_the_same_bytes(made, tmp_path):
    """Another run, decoding in two processes instead of one, writes every file byte for byte the same."""
    photos, out, _, before = made
    proc = cli(photos, tmp_path / "again", *FLAGS, "--workers", "2", timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert output_bytes(tmp_path / "again") == output_bytes(out)
    assert tree_digest(photos) == before


def _entries(work: Path) -> int:
    """How many photos' detections the work folder holds."""
    return len(list(work.glob("detections/*/*/*.pt")))


def _wait_for_entries(work: Path, count: int, proc: subprocess.Popen, timeout: float = 200) -> None:
    deadline = time.monotonic() + timeout
    while _entries(work) < count:
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {count} photos were saved"
        assert time.monotonic() < deadline, f"fewer than {count} photos saved in {work} after {timeout} s"
        time.sleep(0.01)


@pytest.mark.timeout(400)
def test_an_interrupted_run_continues_where_it_stopped_and_gives_the_same_bytes(made, tmp_path):
    photos, out, _, before = made
    again = tmp_path / "out"
    work = again / WORK
    command = [sys.executable, SCRIPT, str(photos), str(again), *FLAGS, "--workers", "0"]

    # Ctrl-C after a batch: exit 130, one line saying how much is saved and how to go on. (A suite started in the
    # background of a shell inherits SIGINT ignored, and so would the tool: it gets the terminal's default.)
    proc = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for_entries(work, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = re.fullmatch(rf"prepare_faces: interrupted; the detections of (\d+) of {len(EXPECTED)} photos are saved "
                        rf"in {re.escape(str(work))}: run the same command again to continue",
                        err.strip().splitlines()[-1])
    assert said and 3 <= int(said[1]) <= _entries(work), err
    assert not (again / "train.rec").exists()

    # Killed outright (no clean-up at all) after more photos.
    proc = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for_entries(work, _entries(work) + 3, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert not (again / "train.rec").exists()
    done = _entries(work)
    assert 6 <= done < len(EXPECTED), done

    proc = cli(photos, again, *FLAGS, "--workers", "0", timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert f"prepare_faces: {done} of {len(EXPECTED)} photos detected in an earlier run" in proc.stderr
    assert output_bytes(again) == output_bytes(out)
    assert tree_digest(photos) == before


# ------------------------------------------------------------------------------------------------ the policy

def _face(box, score: float = 0.99) -> Face:
    x0, y0, x1, y1 = box
    return Face((x0, y0, x1, y1), score, np.zeros((5, 2)))


def _settings(**changes) -> FacePolicy:
    return FacePolicy(**changes)  # the defaults: match, 0.9, 40 (the tool's)


def test_the_policy_decides_and_says_why():
    size = (400, 600)  # (H, W)
    big, small, centred = _face((0, 0, 100, 100)), _face((500, 0, 545, 45)), _face((250, 150, 345, 245))
    assert decide([], size, _settings())[::3] == ("no_face", 0)
    status, chosen, shown, counted, reason = decide([_face((0, 0, 100, 100), 0.8)], size, _settings())
    assert (status, chosen, counted) == ("low_score", [], 0) and shown.score == 0.8
    assert reason == "the best face scores 0.8000, below --min-score 0.9"
    status, _, shown, _, reason = decide([_face((0, 0, 30, 30))], size, _settings())
    assert status == "small_face" and reason == "the largest face is 30 px, below --min-face-size 40"
    # Several faces, --multi largest: the largest, and among faces within 10 % of its size the one nearest the
    # centre (without a model, the default leaves the photo out: tests/test_photos.py).
    status, chosen, _, counted, reason = decide([big, small, centred], size, _settings(multi="largest"))
    assert status == "kept" and chosen == [centred] and counted == 3
    assert reason == "the largest of 3 faces, nearest the centre"
    assert decide([big, small], size, _settings(multi="skip"))[::3] == ("several_faces", 2)
    status, chosen, _, _, reason = decide([big, small], size, _settings(multi="all"))
    assert chosen == [big, small] and reason == "all 2 faces (--multi all)"
    # Faces below the thresholds are not counted, and the reason says so.
    status, chosen, _, counted, reason = decide([big, _face((0, 0, 20, 20))], size, _settings(multi="skip"))
    assert (status, chosen, counted) == ("kept", [big], 1)
    assert reason == "1 more below --min-score/--min-face-size"


@pytest.mark.timeout(120)
def test_other_policies_decide_over_the_kept_detections_without_detecting(made, tmp_path, capsys, monkeypatch):
    """--multi all, then skip, --min-face-size, --min-score and largest into the same OUT_DIR: the first run
    detects; the others only decide (the detector raises if asked) and each output is that policy's."""
    photos = tmp_path / "two"
    (photos / "a").mkdir(parents=True)
    (photos / "a" / "two.jpg").write_bytes((made[0] / "bob" / "3-two-faces.jpg").read_bytes())
    (photos / "a" / "one.jpg").write_bytes((made[0] / "alice" / "0.jpg").read_bytes())
    out = tmp_path / "out"
    rc, said, err = run_main(capsys, photos, out, "--multi", "all", "--workers", "0")
    assert rc == 0, err
    rows = report(out)
    assert [(r["path"], r["status"], r["faces"]) for r in rows] == [
        ("a/one.jpg", "kept", "1"), ("a/two.jpg", "kept", "2"), ("a/two.jpg", "kept", "2")]
    assert len(build_dataset(str(out))) == 3
    assert "2 photos: 2 kept, 0 no face, 1 several faces (1 kept)" in said
    assert "1 identity in train.rec (3 faces, 3-3 per identity)" in said

    def no_detection(self, images):
        raise AssertionError("detection ran")

    monkeypatch.setattr(FaceDetector, "detect", no_detection)
    rc, said, err = run_main(capsys, photos, out, "--multi", "skip", "--workers", "0")
    assert rc == 0, err
    assert [(r["status"], r["reason"]) for r in report(out)] == [
        ("kept", ""), ("several_faces", "2 faces (--multi skip)")]
    assert "1 kept, 0 no face, 1 several faces" in said and "2 of 2 photos detected in an earlier run" in err

    # Her face's box is 88 px on its shorter side in both photos, the second face in two.jpg 51 px.
    rc, said, err = run_main(capsys, photos, out, "--min-face-size", "80", "--workers", "0")
    assert rc == 0, err
    rows = report(out)
    assert rows[1]["status"] == "kept" and rows[1]["faces"] == "1"
    assert rows[1]["reason"] == "1 more below --min-score/--min-face-size"
    before = output_bytes(out)
    rc, said, err = run_main(capsys, photos, out, "--min-score", "1", "--workers", "0")
    assert rc == 1 and err.strip().splitlines()[-1] == (
        f"prepare_faces: error: no face kept in any of the 2 photos (0 without a face, 0 unreadable); every photo's "
        f"reason is in {out / WORK / 'report.csv'}"), err
    assert {r["status"] for r in report(out / WORK)} == {"low_score"}
    assert {k: v for k, v in output_bytes(out).items() if not k.startswith(WORK)} == {
        k: v for k, v in before.items() if not k.startswith(WORK)}  # the earlier output stays as it was
    rc, said, err = run_main(capsys, photos, out, "--multi", "largest", "--workers", "0")
    assert rc == 0 and [r["reason"] for r in report(out)] == ["", "the largest of 2 faces, nearest the centre"], err


def test_pairs_are_balanced_distinct_and_follow_the_seed():
    groups = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    pairs = form_pairs(groups, 3000, np.random.default_rng(0))
    owner = {item: k for k, group in enumerate(groups) for item in group}
    assert len(pairs) == 2 * (3 + 1 + 6) and [same for *_, same in pairs] == [True, False] * 10
    assert all((owner[a] == owner[b]) == same and a < b for a, b, same in pairs)
    assert len({(a, b) for a, b, _ in pairs}) == len(pairs)
    assert pairs == form_pairs(groups, 3000, np.random.default_rng(0))
    assert len(form_pairs(groups, 6, np.random.default_rng(0))) == 6
    # Many faces: the different-identity pairs are drawn, not listed.
    big = [list(range(k * 200, (k + 1) * 200)) for k in range(50)]
    pairs = form_pairs(big, 1000, np.random.default_rng(1))
    assert len(pairs) == 1000 and len(set(pairs)) == 1000
    assert all(((a // 200) == (b // 200)) == same for a, b, same in pairs)


# ------------------------------------------------------------------------------- landmarks and list files

def _pattern_photo(path: Path, seed: int, size=(200, 240)) -> np.ndarray:
    """A PNG of noise (lossless: read back exactly) and 5 points on it: the template moved by a similarity."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    angle, scale = np.deg2rad(rng.uniform(-20, 20)), rng.uniform(0.8, 1.3)
    matrix = np.array([[scale * np.cos(angle), -scale * np.sin(angle), 40], [scale * np.sin(angle),
                                                                              scale * np.cos(angle), 30]])
    return apply_transform(matrix, ARCFACE_TEMPLATE)


@pytest.mark.timeout(120)
def test_landmarks_files_align_without_detection(tmp_path, capsys, monkeypatch):
    photos = tmp_path / "photos"
    points = {}
    for k, name in enumerate(["p/a.png", "p/b.png", "q/c.png", "q/d.png"]):
        (photos / name).parent.mkdir(parents=True, exist_ok=True)
        points[name] = np.array([float(f"{v:.6f}") for v in _pattern_photo(photos / name, k).reshape(-1)])  # as written
    lines = ["path,lex,ley,rex,rey,nx,ny,lmx,lmy,rmx,rmy"]
    lines += [",".join([name, *(f"{v:.6f}" for v in p)]) for name, p in points.items()]
    (tmp_path / "points.csv").write_text("\n".join(lines) + "\n")
    # No detector at all: every photo has its points.
    monkeypatch.setitem(sys.modules, "facenet_pytorch", None)
    rc, out, err = run_main(capsys, photos, tmp_path / "out", "--landmarks", tmp_path / "points.csv", "--workers", "0")
    assert rc == 0, err
    rows = report(tmp_path / "out")
    assert [(r["path"], r["label"], r["status"], r["score"], r["faces"]) for r in rows] == [
        ("p/a.png", "0", "kept", "", ""), ("p/b.png", "0", "kept", "", ""), ("q/c.png", "1", "kept", "", ""),
        ("q/d.png", "1", "kept", "", "")]
    assert {r["reason"] for r in rows} == {"landmarks from --landmarks"}
    dataset = build_dataset(str(tmp_path / "out"))
    for i, (name, p) in enumerate(points.items()):
        expected = encode_jpeg(align_face(read_photo(photos / name), p.reshape(5, 2)), quality=95).numpy().tobytes()
        assert dataset.raw(i)[0] == expected and rows[i]["landmarks"].split() == [f"{v:.1f}" for v in p]
    assert "4 photos: 4 kept" in out and "2 identities in train.rec (4 faces, 2-2 per identity)" in out

    # JSON, as a list of {path, landmarks}, with points that fit no similarity for one photo.
    entries = [{"path": name, "landmarks": p.reshape(5, 2).tolist()} for name, p in points.items()]
    entries[1]["landmarks"] = [[5.0, 5.0]] * 5
    (tmp_path / "points.json").write_text(json.dumps(entries))
    rc, out, err = run_main(capsys, photos, tmp_path / "json", "--landmarks", tmp_path / "points.json",
                            "--workers", "0")
    assert rc == 0, err
    rows = report(tmp_path / "json")
    assert rows[1]["status"] == "bad_landmarks" and "all the same point" in rows[1]["reason"]
    assert "3 kept" in out and "1 bad landmarks" in out


@pytest.mark.timeout(120)
def test_a_list_file_of_paths_and_labels(made, tmp_path, capsys):
    photos = made[0]
    listed = [(photos / "alice" / "0.jpg", "10"), (photos / "bob" / "0.jpg", "9"), (photos / "carol" / "0.jpg", "9"),
              (tmp_path / "missing.jpg", "10")]
    (tmp_path / "list.txt").write_text("# path label\n\n" + "".join(f"{p} {label}\n" for p, label in listed))
    rc, out, err = run_main(capsys, tmp_path / "list.txt", tmp_path / "out", "--workers", "0")
    assert rc == 0, err
    rows = report(tmp_path / "out")
    # Numeric labels sort as numbers: 9 before 10; class ids follow them.
    assert [(r["identity"], r["label"], r["status"]) for r in rows] == [
        ("9", "0", "kept"), ("9", "0", "kept"), ("10", "1", "kept"), ("10", "", "unreadable")]
    assert rows[3]["reason"] == "no such file" and err.count("unreadable") == 1
    assert [build_dataset(str(tmp_path / "out")).raw(i)[1] for i in range(3)] == [0, 0, 1]


# ---------------------------------------------------------------------------------------------- the errors

def _one_photo(made, folder: Path) -> Path:
    """A folder with one identity and one photo of her."""
    (folder / "alice").mkdir(parents=True)
    (folder / "alice" / "0.jpg").write_bytes((made[0] / "alice" / "0.jpg").read_bytes())
    return folder


@pytest.mark.timeout(120)
def test_without_facenet_pytorch_one_line_says_how_to_install_it(made, tmp_path):
    """A process where ``import facenet_pytorch`` fails, as it does where the package is not installed."""
    shim = ("import runpy, sys; sys.modules['facenet_pytorch'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    photos = _one_photo(made, tmp_path / "photos")
    proc = subprocess.run([sys.executable, "-c", shim, SCRIPT, str(photos), str(tmp_path / "out")], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=100)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("prepare_faces: error: face detection needs the facenet-pytorch package")
    assert lines[0].endswith(INSTALL) and not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_usage_errors_are_one_line_and_exit_2(made, tmp_path, capsys):
    photos = _one_photo(made, tmp_path / "photos")
    (tmp_path / "empty").mkdir()
    (tmp_path / "list.txt").write_text("a.jpg 1\njust-a-path\n")
    (tmp_path / "bad.csv").write_text("a.jpg,1,2,3\n")
    (tmp_path / "file").write_text("x")
    cases = [
        ((tmp_path / "nope", tmp_path / "o"), f"PHOTOS_DIR {tmp_path / 'nope'} does not exist"),
        ((tmp_path / "empty", tmp_path / "o"), f"{tmp_path / 'empty'} holds no identity folders"),
        ((tmp_path / "list.txt", tmp_path / "o"),
         f"{tmp_path / 'list.txt'}:2: expected 'path label', got 'just-a-path'"),
        ((photos, tmp_path / "o", "--landmarks", tmp_path / "bad.csv"),
         f"--landmarks {tmp_path / 'bad.csv'}:1: 4 fields"),
        ((photos, tmp_path / "o", "--landmarks", tmp_path / "none.csv"),
         f"--landmarks {tmp_path / 'none.csv'} is not a file"),
        ((photos, photos / "alice" / "out"), f"OUT_DIR {photos / 'alice' / 'out'} is inside PHOTOS_DIR {photos}"),
        ((photos, tmp_path / "file"), f"OUT_DIR {tmp_path / 'file'} is a file, not a folder"),
    ]
    for args, message in cases:
        rc, _, err = run_main(capsys, *args)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"prepare_faces: error: {message}"), err
    assert not (tmp_path / "o").exists() and not (photos / "alice" / "out").exists()
    for flags, message in ((["--holdout", "1"], "--holdout must be 0 or >= 2"),
                           (["--min-score", "1.5"], "--min-score must be in [0, 1]"),
                           (["--multi", "best"], "invalid choice: 'best'"),
                           (["--workers", "-1"], "--workers must be >= 0"),
                           (["--device", "tpu"], "--device tpu"),
                           (["--match-threshold", "2"], "--match-threshold is a cosine similarity, in [-1, 1]"),
                           (["--network", "r50"], "--network describes the model of --weights; pass --weights too"),
                           (["--weights", "m.onnx", "--network", "r50"], "is an ONNX model, run as it is")):
        with pytest.raises(SystemExit) as exc:
            prepare_faces.main([str(photos), str(tmp_path / "o"), *flags])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    # A model that cannot be loaded is one line, before anything is written.
    rc, _, err = run_main(capsys, photos, tmp_path / "o", "--weights", tmp_path / "nothing.pt")
    assert rc == 2 and err.startswith(f"prepare_faces: error: --weights {tmp_path / 'nothing.pt'}: no such file"), err
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(120)
def test_an_out_dir_holding_another_dataset_is_refused_unless_overwrite(tmp_path, capsys):
    photos = tmp_path / "photos"
    points = []
    for k, name in enumerate(["p/a.png", "p/b.png", "q/c.png", "q/d.png", "r/e.png", "r/f.png"]):
        (photos / name).parent.mkdir(parents=True, exist_ok=True)
        points.append([name, *_pattern_photo(photos / name, k).reshape(-1).tolist()])
    with open(tmp_path / "points.csv", "w", newline="") as f:
        csv.writer(f).writerows(points)
    common = ["--landmarks", tmp_path / "points.csv", "--workers", "0"]

    out = tmp_path / "out"
    write_insightface_rec(out, [(0, b"\xff\xd8 another")], 1)  # a rec of another tool
    (out / "syn_easy.bin").write_bytes(b"a verification set training would read")
    theirs = output_bytes(out)
    rc, _, err = run_main(capsys, photos, out, *common)
    assert rc == 2 and err.strip().splitlines() == [
        f"prepare_faces: error: OUT_DIR {out} holds another dataset (train.rec, train.idx, property, syn_easy.bin) "
        f"not made by prepare_faces.py from {photos}; pass --overwrite to move its files aside (into "
        f"{out / 'replaced'}), or choose another folder"], err
    assert output_bytes(out) == theirs
    rc, _, err = run_main(capsys, photos, out, *common, "--overwrite", "--holdout", "2")
    assert rc == 0, err
    assert build_dataset(str(out)).num_classes == 1 and (out / "holdout.bin").exists()
    # Nothing of theirs is left beside the new records, and nothing is lost.
    assert not (out / "syn_easy.bin").exists() and output_bytes(out / "replaced") == theirs
    assert f"--overwrite: 4 entries of another dataset moved from {out} into {out / 'replaced'}" in err

    # The same input again is its own output: no --overwrite needed; what it no longer writes is removed.
    rc, _, err = run_main(capsys, photos, out, *common)
    assert rc == 0, err
    assert build_dataset(str(out)).num_classes == 3 and not (out / "holdout.bin").exists()
    # Another input is refused.
    other = tmp_path / "other"
    (other / "x").mkdir(parents=True)
    (other / "x" / "a.png").write_bytes((photos / "p" / "a.png").read_bytes())
    rc, _, err = run_main(capsys, other, out, *common)
    assert rc == 2 and "holds another dataset (train.rec, train.idx, property, report.csv, preview.png, " \
                       "prepare_faces.json) not made by prepare_faces.py from" in err, err

    # A --holdout the photos cannot fill: exit 1; then one it can.
    rc, _, err = run_main(capsys, photos, tmp_path / "few", *common, "--holdout", "3")
    assert rc == 1 and err.strip().splitlines() == [
        "prepare_faces: error: --holdout 3: 3 identities kept a face; holding out 3 leaves none for training"], err
    rc, _, err = run_main(capsys, photos, tmp_path / "few", *common, "--holdout", "2")
    assert rc == 0, err


# ---------------------------------------------------------------------------------- formats, models, Ctrl-C

@pytest.mark.timeout(120)
def test_a_folder_of_pgm_photos_as_academic_face_sets_ship_them(tmp_path, capsys):
    """Grey .pgm photos (an academic face set's layout: s1/1.pgm ...) are photos, not files to ignore."""
    for k, identity in enumerate(("s1", "s2")):
        for n in (1, 2):
            image = astronaut(scale=0.5, canvas=(320, 300), at=(10 + 20 * n + 60 * k, 10 + 10 * n)).convert("L")
            (tmp_path / "faces" / identity).mkdir(parents=True, exist_ok=True)
            image.save(tmp_path / "faces" / identity / f"{n}.pgm")
    rc, said, err = run_main(capsys, tmp_path / "faces", tmp_path / "out", "--workers", "0", "--chunk-size", "4")
    assert rc == 0, err
    assert [(r["path"], r["status"]) for r in report(tmp_path / "out")] == [
        ("s1/1.pgm", "kept"), ("s1/2.pgm", "kept"), ("s2/1.pgm", "kept"), ("s2/2.pgm", "kept")]
    assert "2 identities in train.rec (4 faces, 2-2 per identity)" in said
    # The flag of the chunked work folder is taken and said to be needless.
    assert err.strip().splitlines() == ["prepare_faces: warning: --chunk-size is no longer needed (each photo's "
                                        "detections are saved as soon as it is done); ignored"], err


@pytest.mark.timeout(200)
def test_a_recognition_model_decides_the_group_photo_and_its_similarities_are_reported(made, tmp_path, capsys):
    """--weights with a run folder (model.pt and model.json, as the trainer writes them): the faces are embedded,
    every face checked has its similarity in the report, and the group photo is decided by the model (an
    untrained one here: with --match-threshold -1 every face matches, and the best one is kept). Which face is
    right is tests/test_photos.py's, with a model that knows."""
    tiny_run(tmp_path / "run", {"widths": [4, 8, 8, 16]})
    photos = tmp_path / "photos"
    for name, source in (("bob/0.jpg", "bob/0.jpg"), ("bob/1.jpg", "bob/1.jpg"), ("bob/party.jpg",
                                                                                  "bob/3-two-faces.jpg")):
        (photos / name).parent.mkdir(parents=True, exist_ok=True)
        (photos / name).write_bytes((made[0] / source).read_bytes())
    rc, said, err = run_main(capsys, photos, tmp_path / "out", "--weights", tmp_path / "run", "--match-threshold",
                             "-1", "--workers", "0")
    assert rc == 0, err
    rows = {r["path"]: r for r in report(tmp_path / "out")}
    assert rows["bob/party.jpg"]["status"] == "kept" and rows["bob/party.jpg"]["faces"] == "2", rows
    assert rows["bob/party.jpg"]["reason"].startswith("the face of 2 that matches bob's 2 photos with one face")
    assert all(-1 <= float(r["similarity"]) <= 1 for r in rows.values()), rows
    assert "3 photos: 3 kept, 0 no face, 1 several faces (1 kept)" in said
    stamp = json.loads((tmp_path / "out" / "prepare_faces.json").read_text())
    assert stamp["model"] == str((tmp_path / "run").resolve()) and stamp["match_threshold"] == -1


@pytest.mark.timeout(120)
def test_ctrl_c_while_the_tool_is_still_importing_is_one_line(tmp_path):
    """SIGINT while torch is being imported (held there: the import waits until the signal comes): one line and
    exit 130, no traceback."""
    marker = tmp_path / "importing"
    shim = ("import importlib.abc, pathlib, runpy, sys, time\n"
            "class Slow(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch':\n"
            f"            pathlib.Path({str(marker)!r}).touch()\n"
            "            time.sleep(60)\n"
            "        return None\n"
            "sys.meta_path.insert(0, Slow())\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    proc = subprocess.Popen([sys.executable, "-c", shim, SCRIPT, str(tmp_path / "photos"), str(tmp_path / "out")],
                            cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "prepare_faces: interrupted\n" and out == "", err
