"""scripts/make_rec.py, rec_info.py, shuffle_rec.py, unpack_rec.py."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest
from _paths import FIXTURES, ROOT
from PIL import Image

from dataset import ImageFolderDataset, MXFaceDataset
from scripts.make_rec import main as make_rec_main
from scripts.rec_info import main as rec_info_main
from scripts.rec_info import rec_info
from scripts.shuffle_rec import main as shuffle_rec_main
from scripts.shuffle_rec import shuffle_rec
from scripts.unpack_rec import main as unpack_rec_main
from scripts.unpack_rec import unpack_rec
from utils.recordio import IndexedRecordIO, IRHeader, pack, unpack


def _image(seed: int, size=(112, 112), fmt="JPEG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size[0], size[1], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.timeout(60)
def test_script_runs_from_repo_root():
    """One real subprocess (importing torch costs seconds); the others share the same sys.path set-up."""
    res = subprocess.run([sys.executable, "scripts/rec_info.py", str(FIXTURES / "rec_im2rec")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "im2rec layout, 12 images" in res.stdout, res.stderr


@pytest.mark.parametrize("main", [make_rec_main, rec_info_main, shuffle_rec_main, unpack_rec_main])
def test_help(main, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "usage:" in capsys.readouterr().out


def test_make_rec_round_trip(tmp_path, capsys):
    src = tmp_path / "faces"
    originals = {}
    for name, n in (("zed", 2), ("amy", 3)):
        (src / name).mkdir(parents=True)
        for i in range(n):
            data = _image(len(originals), fmt="PNG" if i == 1 else "JPEG")
            (src / name / f"{i}.{'png' if i == 1 else 'jpg'}").write_bytes(data)
            originals[(name, i)] = data
    (src / "zed" / "9.jpg").write_bytes(_image(99, size=(64, 80)))  # wrong size: re-encoded
    assert make_rec_main(["--images", str(src), "--out", str(tmp_path / "rec")]) == 0
    assert "wrote 6 images of 2 classes" in capsys.readouterr().out
    ds = MXFaceDataset(tmp_path / "rec")
    assert ds.layout == "insightface" and len(ds) == 6 and ds.num_classes == 2
    expected = [originals[("amy", i)] for i in range(3)] + [originals[("zed", i)] for i in range(2)]
    for i, data in enumerate(expected):
        payload, label, _ = ds.raw(i)
        assert payload == data and label == (0 if i < 3 else 1)
    assert tuple(ds[5][0].shape) == (3, 112, 112) and int(ds[5][1]) == 1


def test_make_rec_list_file_and_errors(tmp_path, capsys):
    (tmp_path / "a.jpg").write_bytes(_image(0))
    (tmp_path / "l.lst").write_text("a.jpg\t1\na.jpg\t0\n")
    assert make_rec_main(["--list", str(tmp_path / "l.lst"), "--out", str(tmp_path / "r")]) == 0
    assert MXFaceDataset(tmp_path / "r").num_classes == 2
    (tmp_path / "bad.lst").write_text("a.jpg 1\n")
    assert make_rec_main(["--list", str(tmp_path / "bad.lst"), "--out", str(tmp_path / "r2")]) == 2
    assert "bad.lst: line 1 is 'a.jpg 1'" in capsys.readouterr().err


def _planted(tmp_path):
    """An im2rec dataset with five different problems."""
    payloads = [pack(IRHeader(0, 0.0, 0, 0), _image(0)),
                pack(IRHeader(0, 5.0, 1, 0), _image(1)),            # label 5 >= num_classes 3
                pack(IRHeader(0, 1.0, 2, 0), b"\xff\xd8garbage"),   # undecodable
                pack(IRHeader(0, 1.0, 3, 0), _image(3)),            # magic overwritten below
                pack(IRHeader(0, 2.0, 4, 0), _image(4)),
                pack(IRHeader(0, 2.0, 5, 0), _image(5))]            # truncated below
    with IndexedRecordIO(tmp_path / "train.idx", tmp_path / "train.rec", "w") as w:
        for k, p in enumerate(payloads):
            w.write_idx(k, p)
    with IndexedRecordIO(tmp_path / "train.idx", tmp_path / "train.rec", "r") as r:
        off3 = r.offset(3)
    with open(tmp_path / "train.rec", "r+b") as f:
        f.seek(off3)
        f.write(b"BAD!")
    os.truncate(tmp_path / "train.rec", (tmp_path / "train.rec").stat().st_size - 10)
    with open(tmp_path / "train.idx", "a") as f:
        f.write("9\t10000000\n")                                   # offset past the end
    (tmp_path / "property").write_text("3,112,112")
    return off3


def test_rec_info_finds_all_planted_problems(tmp_path, capsys):
    off3 = _planted(tmp_path)
    info = rec_info(tmp_path, check=True)
    problems = "\n".join(info["problems"])
    assert len(info["problems"]) == 5, problems
    assert "(key 9): index offset 10000000 is past the end" in problems
    assert "(key 1): label 5 is out of range for num_classes=3" in problems
    assert "(key 2): cannot decode image" in problems
    assert f"(key 3): bad magic 0x21444142 at byte {off3}" in problems
    assert "(key 5): record at byte" in problems and "truncated" in problems
    assert rec_info_main([str(tmp_path), "--check"]) == 1
    assert "5 problems:" in capsys.readouterr().err
    assert rec_info_main([str(FIXTURES / "rec_insightface"), "--check"]) == 0
    assert "insightface layout, 30 images, num_classes=6, 6 classes" in capsys.readouterr().out
    assert rec_info_main([str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("layout", ["rec_insightface", "rec_im2rec"])
def test_shuffle_rec_drops_header_and_keeps_payloads(layout, tmp_path):
    n = shuffle_rec(FIXTURES / layout, tmp_path, seed=1)
    src = MXFaceDataset(FIXTURES / layout)
    out = MXFaceDataset(tmp_path, num_classes=src.num_classes)
    assert n == len(src) == len(out) and out.layout == "im2rec" and out.keys.tolist() == list(range(n))
    before = sorted((src.raw(i)[:2] for i in range(n)))
    after = [out.raw(i)[:2] for i in range(n)]
    assert sorted(after) == before and after != [src.raw(i)[:2] for i in range(n)]
    with IndexedRecordIO(tmp_path / "train.idx", tmp_path / "train.rec", "r") as r:
        assert unpack(r.read_idx(0))[1]  # the first record is an image, not an empty header


def test_unpack_rec_to_image_folder(tmp_path):
    assert unpack_rec(FIXTURES / "rec_insightface_vector_label", tmp_path) == 12
    src = MXFaceDataset(FIXTURES / "rec_insightface_vector_label")
    folder = ImageFolderDataset(tmp_path)
    assert folder.num_classes == src.num_classes == 4
    assert [folder.raw(i)[:2] for i in range(12)] == [src.raw(i)[:2] for i in range(12)]
