"""Corrupted RecordIO datasets: every defect gives one error naming the file, the key or offset and the bad
value, at open time when it can be known then and otherwise at the record, through the real trainer, through
``dataset.MXFaceDataset`` and through ``scripts/rec_info.py --check`` (all defects in one pass).

tests/test_recordio.py, tests/test_dataset.py and tests/test_rec_scripts.py test the readers on hand-made
im2rec files; here the folder is written by ``write_insightface_rec`` (the trainer's layout) and then damaged.
"""
from __future__ import annotations

import re
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.io import encode_jpeg

from dataset import MXFaceDataset
from dataset.inspection import rec_info
from dataset.recordio import IndexedRecordIO, write_insightface_rec
from scripts.rec_info import main as rec_info_main
from tests.helpers import ROOT, faces, run_main, subprocess_env, train, train_here

NUM_CLASSES, PER_CLASS = 4, 4  # 16 images: 2 steps of 8 per epoch on one rank, so every record is read
TRAIN = (f"num_classes={NUM_CLASSES}", f"num_image={NUM_CLASSES * PER_CLASS}", "max_steps=4",
         "save_all_states=false", "frequent=1")
BAD_KEY = 6  # the damaged image record (keys 1..16 are images; 17..20 the class ranges)


def build(root: Path, undecodable: bool = False) -> Path:
    g = torch.Generator().manual_seed(0)
    items = []
    for label in range(NUM_CLASSES):
        for _ in range(PER_CLASS):
            image = encode_jpeg(torch.randint(0, 256, (3, 112, 112), dtype=torch.uint8, generator=g)).numpy()
            items.append((label, image.tobytes()))
    if undecodable:
        items[BAD_KEY - 1] = (items[BAD_KEY - 1][0], b"\xff\xd8 this is not a jpeg")
    write_insightface_rec(root, items, NUM_CLASSES)
    return root


def offset(root: Path, key: int) -> int:
    with IndexedRecordIO(root / "train.idx", root / "train.rec", "r") as rec:
        return rec.offset(key)


def patch(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def flip_magic(root: Path) -> str:
    at = offset(root, BAD_KEY)
    patch(root / "train.rec", at, b"\x0b\x23\xd7\xce")  # one bit of the magic's low byte flipped
    return rf"train.rec \(key {BAD_KEY}\): bad magic 0xced7230b at byte {at}"


def truncate_last_record(root: Path) -> str:
    rec = root / "train.rec"
    size = rec.stat().st_size
    with IndexedRecordIO(root / "train.idx", rec, "r") as r:
        last_key = int(r.key_array[-1])
        last = r.offset(last_key)
    with open(rec, "r+b") as f:
        f.truncate(size - 3)
    return rf"train.rec \(key {last_key}\): record at byte {last} announces \d+ bytes but the file ends"


def offset_past_end(root: Path) -> str:
    with open(root / "train.idx", "a") as f:
        f.write("99\t123456789\n")
    return r"offsets are past the end of .*train.rec .*\(99, 123456789\)"


def undecodable(root: Path) -> str:
    build(root, undecodable=True)
    return rf"train.rec \(key {BAD_KEY}\): cannot decode image \(\d+ bytes, starts with b'\\xff\\xd8 this"


def label_out_of_range(root: Path) -> str:
    # IRHeader (flag uint32, label float32, ...) follows the 8-byte record header.
    patch(root / "train.rec", offset(root, BAD_KEY) + 8 + 4, struct.pack("<f", 7.0))
    return rf"train.rec \(key {BAD_KEY}\): label 7 is out of range for num_classes={NUM_CLASSES}"


def missing_idx(root: Path) -> str:
    (root / "train.idx").unlink()
    return r"missing train.idx|not train.idx|index \(.idx\) not found: .*train.idx"


DEFECTS: dict[str, Callable[[Path], str]] = {
    "flipped_magic": flip_magic, "truncated_last_record": truncate_last_record,
    "offset_past_end": offset_past_end, "undecodable_image": undecodable,
    "label_out_of_range": label_out_of_range, "missing_idx": missing_idx,
}
AT_OPEN = {"offset_past_end", "missing_idx", "truncated_last_record"}


def damaged(tmp_path: Path, defect: str) -> tuple[Path, str]:
    root = build(tmp_path / defect)
    return root, DEFECTS[defect](root)


def test_the_undamaged_folder_reads_and_checks_clean(tmp_path):
    root = build(tmp_path / "clean")
    ds = MXFaceDataset(root, num_classes=NUM_CLASSES)
    assert [int(ds[i][1]) for i in range(len(ds))] == [i // PER_CLASS for i in range(16)]
    assert rec_info(root, check=True)["problems"] == []


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_dataset_names_the_defect(tmp_path, defect):
    root, message = damaged(tmp_path, defect)
    if defect in AT_OPEN:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            MXFaceDataset(root, num_classes=NUM_CLASSES)
        return
    ds = MXFaceDataset(root, num_classes=NUM_CLASSES)
    met = 0
    for i in range(len(ds)):
        if int(ds.keys[i]) == BAD_KEY:
            met += 1
            with pytest.raises(ValueError, match=message):
                ds[i]
        else:
            ds[i]
    assert met == 1  # the damaged record is in the dataset, not dropped at open time


@pytest.mark.timeout(120)
@pytest.mark.parametrize("defect", [pytest.param(d, marks=pytest.mark.process) if d == "undecodable_image" else d
                                    for d in sorted(DEFECTS)])
def test_trainer_exits_with_the_defect(tmp_path, defect):
    """One rank in this process (``train_here``); the image the decoder meets, also through a real train.py process,
    where a crash of native code would be a signal instead of an exit code."""
    root, message = damaged(tmp_path, defect)
    run = train if defect == "undecodable_image" else train_here
    proc = run("configs/debug_cpu", tmp_path / "out", f"rec={root}", *TRAIN, check=False)
    assert proc.returncode not in (0, -11), proc.stderr[-3000:]  # failed, and not by a segfault
    assert re.search(message, proc.stderr + proc.stdout), proc.stderr[-3000:]
    assert 'train.py", line' not in proc.stderr + proc.stdout, proc.stderr[-3000:]  # no traceback of ours
    assert len(re.findall(message, proc.stderr + proc.stdout)) == 1, proc.stderr[-3000:]  # said once


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_rec_info_check_names_the_defect(tmp_path, defect, capsys):
    root, message = damaged(tmp_path, defect)
    code = rec_info_main([str(root), "--check"])
    err = capsys.readouterr().err
    assert code == (2 if defect == "missing_idx" else 1), err
    assert re.search(message, err), err  # the dataset's message: one checker


@pytest.mark.timeout(60)
def test_rec_info_check_finds_every_defect_in_one_pass(tmp_path):
    root = build(tmp_path / "all", undecodable=True)
    # Several defects in one folder; each must be listed (the undecodable image is key BAD_KEY, so the magic
    # and the label are damaged on other keys).
    at3, at9 = offset(root, 3), offset(root, 9)
    patch(root / "train.rec", at3, b"\x0b\x23\xd7\xce")
    patch(root / "train.rec", at9 + 12, struct.pack("<f", 7.0))
    truncated = truncate_last_record(root)
    offset_past_end(root)
    proc = run_main(rec_info_main, [str(root), "--check"], "scripts/rec_info.py")
    assert proc.returncode == 1, proc.stderr
    for needle in (rf"\(key 3\): bad magic 0xced7230b at byte {at3}", rf"\(key {BAD_KEY}\): cannot decode image",
                   rf"\(key 9\): label 7 is out of range for num_classes={NUM_CLASSES}", truncated,
                   r"1 index offsets are past the end .*\(99, 123456789\)"):
        assert re.search(needle, proc.stderr), f"{needle!r} not in:\n{proc.stderr}"
    assert "5 problems:" in proc.stderr, proc.stderr


def _folder_with_bad_images(root):
    faces(root, identities=8, per_identity=4)
    good = (root / "id3" / "0.jpg").read_bytes()
    (root / "id3" / "4.jpg").write_bytes(good[: len(good) // 3])  # truncated
    (root / "id6" / "4.jpg").write_bytes(np.random.default_rng(0).bytes(2000))  # random bytes
    return root


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_bad_image_under_torchrun_stops_every_rank_with_one_line_naming_it(tmp_path):
    """`torchrun --nproc_per_node=2 train.py configs/debug_cpu --set rec=FOLDER num_image=none num_classes=none`
    on a folder with a truncated JPEG and a file of random bytes: whichever rank meets one, every rank stops at
    that step with exit code 2 and the one line naming the file, in the console and in training.log; no gloo
    error. With skip_bad_images = True the run trains without them and lists them."""
    from tests.helpers import torchrun_command

    root = _folder_with_bad_images(tmp_path / "faces")
    output = tmp_path / "out"
    cmd = [*torchrun_command(2), "train.py", "configs/debug_cpu", "--set", f"rec={root}", "num_image=none",
           "num_classes=none", f"output={output}", "batch_size=4", "max_steps=8", "val_targets=", "frequent=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "Connection closed" not in text and "RuntimeError" not in text and "[rank" not in text, text[-3000:]
    # torchrun's lines about its workers: the first to stop exits 2; a rank still on its way to its own exit 2 when
    # torchrun sees that one may be stopped by torchrun's SIGTERM (-15), never by a collective's error.
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", text))
    root = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", text, re.S)
    assert root and root.group(1) == "2" and codes <= {"2", "-15"}, (codes, text[-3000:])
    errors = [line for line in (output / "training.log").read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot decode image" in errors[0], errors
    assert ("id3/4.jpg" in errors[0] or "id6/4.jpg" in errors[0]) and "skip_bad_images = True" in errors[0]
    assert errors[0].split(" ERROR ", 1)[1] in proc.stderr  # the console has the same line

    skipped = tmp_path / "skipped"
    cmd = [arg.replace(str(output), str(skipped)) for arg in cmd] + ["skip_bad_images=true", "max_steps=16"]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    log = (skipped / "training.log").read_text()
    assert "step 16/16" in log
    listed = [line for line in log.splitlines() if "skipped a sample that cannot be read (skip_bad_images)" in line]
    assert any("id3/4.jpg" in line for line in listed) and any("id6/4.jpg" in line for line in listed), listed
