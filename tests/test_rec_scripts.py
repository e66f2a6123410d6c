"""scripts/make_rec.py, rec_info.py, shuffle_rec.py, unpack_rec.py."""
from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from dataset import ImageFolderDataset, MXFaceDataset
from dataset.inspection import rec_info
from dataset.rec_copy import shuffle_rec, unpack_rec
from dataset.rec_from_images import list_image_folder, make_rec
from dataset.recordio import IndexedRecordIO, IRHeader, pack, unpack
from scripts.make_rec import main as make_rec_main
from scripts.rec_info import main as rec_info_main
from scripts.shuffle_rec import main as shuffle_rec_main
from scripts.unpack_rec import main as unpack_rec_main
from tests.helpers import FIXTURES, ROOT


def _image(seed: int, size=(112, 112), fmt="JPEG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size[0], size[1], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.process
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



def _rec_files(folder):
    return {name: (folder / name).read_bytes() for name in ("train.rec", "train.idx", "property")}


def test_make_rec_reads_im2rec_lists_with_float_labels_and_root(tmp_path, capsys):
    """arcface_torch's recipe: ``python -m mxnet.tools.im2rec --list --recursive train <root>`` writes
    ``index<TAB>label<TAB>path`` lines, labels as ``%f``, paths relative to <root>, not to the list."""
    faces = tmp_path / "faces"
    names = [f"{who}/{i}.jpg" for who in ("amy", "bob", "cat") for i in range(2)]
    for seed, name in enumerate(names):
        (faces / name).parent.mkdir(parents=True, exist_ok=True)
        (faces / name).write_bytes(_image(seed))
    labels = {name: "amy bob cat".split().index(name.split("/")[0]) for name in names}
    (faces / "two.lst").write_text("".join(f"{name}\t{labels[name]}\n" for name in names))
    assert make_rec_main(["--list", str(faces / "two.lst"), "--out", str(tmp_path / "two")]) == 0
    (tmp_path / "lists").mkdir()
    shuffled = [names[i] for i in (3, 0, 5, 1, 4, 2)]  # im2rec shuffles; the written order is by label, path
    (tmp_path / "lists" / "train.lst").write_text(
        "".join(f"{index}\t{labels[name]:f}\t{name}\n" for index, name in enumerate(shuffled)))
    assert make_rec_main(["--list", str(tmp_path / "lists" / "train.lst"), "--root", str(faces),
                          "--out", str(tmp_path / "im2rec")]) == 0
    assert "wrote 6 images of 3 classes" in capsys.readouterr().out
    assert _rec_files(tmp_path / "im2rec") == _rec_files(tmp_path / "two")
    # Without --root the paths are relative to the list's folder, as for path<TAB>label lists.
    shutil.copy(tmp_path / "lists" / "train.lst", faces / "train.lst")
    assert make_rec_main(["--list", str(faces / "train.lst"), "--out", str(tmp_path / "beside")]) == 0
    assert _rec_files(tmp_path / "beside") == _rec_files(tmp_path / "two")


@pytest.mark.parametrize("lines, message", [
    ("0\t0.000000\ta.jpg\n1\t1.500000\ta.jpg\n", "line 2 is '1\\t1.500000\\ta.jpg'; expected"),
    ("0\t-1.000000\ta.jpg\n", "line 1 is '0\\t-1.000000\\ta.jpg'; expected"),
    ("0\t0.000000\ta.jpg\na.jpg\t1\n", "line 2 is a 'path<TAB>label' line but line 1 is an im2rec "
                                          "'index<TAB>label<TAB>path' line; use one format per file"),
], ids=["fraction", "negative", "mixed"])
def test_make_rec_bad_im2rec_line_is_one_line(tmp_path, capsys, lines, message):
    (tmp_path / "a.jpg").write_bytes(_image(0))
    (tmp_path / "l.lst").write_text(lines)
    assert make_rec_main(["--list", str(tmp_path / "l.lst"), "--out", str(tmp_path / "rec")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"make_rec: error: {tmp_path / 'l.lst'}: {message}"), err
    if "expected" in message:
        assert err[0].endswith("expected 'path<TAB>label' or im2rec's 'index<TAB>label<TAB>path' lines with a "
                               "label that is an integer >= 0 (im2rec's 12.000000 is 12)"), err
    assert not (tmp_path / "rec").exists()


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
    assert "1 index offsets are past the end" in problems and "(9, 10000000)" in problems
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
    before = sorted(src.raw(i)[:2] for i in range(n))
    after = [out.raw(i)[:2] for i in range(n)]
    assert sorted(after) == before and after != [src.raw(i)[:2] for i in range(n)]
    with IndexedRecordIO(tmp_path / "train.idx", tmp_path / "train.rec", "r") as r:
        assert unpack(r.read_idx(0))[1]  # the first record is an image, not an empty header



def test_shuffle_rec_without_dst_writes_a_sibling_folder(tmp_path, capsys, monkeypatch):
    """arcface_torch's ``python scripts/shuffle_rec.py ms1m-retinaface-t1`` writes ``shuffled_ms1m-retinaface-t1``."""
    src = tmp_path / "data" / "ms1m-retinaface-t1"
    shutil.copytree(FIXTURES / "rec_insightface", src)
    assert shuffle_rec_main([str(src), str(tmp_path / "explicit"), "--seed", "3"]) == 0
    assert shuffle_rec_main([f"{src}/", "--seed", "3"]) == 0  # the trailing slash of tab completion
    default = tmp_path / "data" / "shuffled_ms1m-retinaface-t1"
    assert f"to {default}" in capsys.readouterr().out.splitlines()[-1]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [src.name, default.name]
    assert _rec_files(default) == _rec_files(tmp_path / "explicit")
    shutil.rmtree(default)
    monkeypatch.chdir(src)  # "." names the folder it stands for
    assert shuffle_rec_main([".", "--seed", "3"]) == 0 and _rec_files(default) == _rec_files(tmp_path / "explicit")
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in (FIXTURES / "rec_insightface").iterdir())
    capsys.readouterr()
    # A mistyped src is one line and leaves no empty shuffled_ folder behind.
    assert shuffle_rec_main([str(tmp_path / "data" / "typo")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "data" / "shuffled_typo").exists()


def test_unpack_rec_to_image_folder(tmp_path):
    assert unpack_rec(FIXTURES / "rec_insightface_vector_label", tmp_path) == 12
    src = MXFaceDataset(FIXTURES / "rec_insightface_vector_label")
    folder = ImageFolderDataset(tmp_path)
    assert folder.num_classes == src.num_classes == 4
    assert [folder.raw(i)[:2] for i in range(12)] == [src.raw(i)[:2] for i in range(12)]


@pytest.mark.parametrize("copy", [shuffle_rec, unpack_rec])
def test_a_copy_that_fails_half_way_leaves_the_output_as_it_was(tmp_path, copy, capsys):
    """shuffle_rec and unpack_rec write in stages (utils.files.staged): a record that cannot be read half way leaves
    no new output folder, and an existing one with its old files, without a staging folder either way."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "rec_insightface", src)
    with open(src / "train.rec", "r+b") as f:  # the last records cut off: read_idx fails past the middle
        f.truncate(f.seek(0, os.SEEK_END) // 2)
    with pytest.raises(ValueError, match="train.rec"):
        copy(src, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    old = tmp_path / "old"
    (old / "000000").mkdir(parents=True)
    (old / "000000" / "mine.jpg").write_bytes(b"kept")
    (old / "train.rec").write_bytes(b"kept")
    with pytest.raises(ValueError, match="train.rec"):
        copy(src, old)
    assert sorted(str(p.relative_to(old)) for p in old.rglob("*")) == ["000000", "000000/mine.jpg", "train.rec"]
    main = shuffle_rec_main if copy is shuffle_rec else unpack_rec_main
    assert main([str(src), str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.rec" in err[0] and not (tmp_path / "new").exists()


def test_unpack_rec_into_an_existing_folder_replaces_its_label_folders_whole(tmp_path):
    (tmp_path / "000001").mkdir()
    (tmp_path / "000001" / "stale.jpg").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("mine")
    assert unpack_rec(FIXTURES / "rec_insightface_vector_label", tmp_path) == 12
    assert not (tmp_path / "000001" / "stale.jpg").exists() and (tmp_path / "notes.txt").read_text() == "mine"
    assert ImageFolderDataset(tmp_path).num_classes == 4


def test_make_bin_reads_the_pairs_and_decodes_each_image_once(tmp_path, monkeypatch):
    from dataset import verification_set
    from dataset.verification_set import read_images, read_pairs

    (tmp_path / "imgs").mkdir()
    for i in range(3):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(_image(i))
    (tmp_path / "imgs" / "cut.jpg").write_bytes(_image(9)[:1500])
    elsewhere = tmp_path / "imgs" / "2.jpg"
    (tmp_path / "pairs.txt").write_text(f"# comment\n\n0.jpg 1.jpg 1\n1.jpg {elsewhere} 0\n0.jpg cut.jpg 0\n")
    pairs = read_pairs(tmp_path / "pairs.txt", tmp_path / "imgs")
    assert pairs == [(tmp_path / "imgs" / "0.jpg", tmp_path / "imgs" / "1.jpg", True),
                     (tmp_path / "imgs" / "1.jpg", elsewhere, False), (tmp_path / "imgs" / "0.jpg",
                                                                      tmp_path / "imgs" / "cut.jpg", False)]
    decoded = []
    real = verification_set.decode
    monkeypatch.setattr(verification_set, "decode", lambda data, where: decoded.append(where) or real(data, where))
    data, bad = read_images([p for a, b, _ in pairs for p in (a, b)])
    assert len(data) == len(decoded) == 4 and len(bad) == 1 and bad[0].startswith(str(tmp_path / "imgs" / "cut.jpg"))
    with pytest.raises(ValueError, match=r"pairs file not found: .*missing\.txt"):
        read_pairs(tmp_path / "missing.txt", tmp_path)
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no pairs"):
        read_pairs(tmp_path / "empty.txt", tmp_path)


# --- make_rec on messy folders ------------------------------------------------------------------------

def _messy_folder(root):
    """Identities: amy (2 good, 1 truncated), bob (empty), cat (only bad files), dan (1 good, 1 re-encoded,
    a link to nowhere)."""
    for name in ("amy", "bob", "cat", "dan"):
        (root / name).mkdir(parents=True)
    (root / "amy" / "0.jpg").write_bytes(_image(0))
    (root / "amy" / "1.jpg").write_bytes(_image(1))
    (root / "amy" / "2.jpg").write_bytes(_image(2)[:2000])              # truncated JPEG
    (root / "cat" / "0.jpg").write_bytes(b"")                          # empty file
    (root / "cat" / "1.png").write_bytes(b"not an image at all")       # not an image
    (root / "dan" / "0.jpg").write_bytes(_image(3))
    (root / "dan" / "1.png").write_bytes(_image(4, size=(64, 80), fmt="PNG"))  # wrong size: re-encoded
    (root / "dan" / "2.jpg").symlink_to(root / "gone.jpg")            # cannot be read
    return {"truncated": root / "amy" / "2.jpg", "empty": root / "cat" / "0.jpg",
            "garbage": root / "cat" / "1.png", "dangling": root / "dan" / "2.jpg"}


def _leftovers(root):
    """Anything a failed or finished make_rec should not have left: temporaries and staging folders."""
    return sorted(str(p) for p in root.rglob("*") if p.name.endswith(".tmp"))


def test_make_rec_skips_bad_files_and_identities_without_images(tmp_path, capsys):
    bad = _messy_folder(tmp_path / "faces")
    assert make_rec_main(["--images", str(tmp_path / "faces"), "--out", str(tmp_path / "rec")]) == 0
    out, err = capsys.readouterr()
    assert "wrote 4 images of 2 classes" in out and "1 re-encoded" in out and "4 bad files skipped" in out
    lines = err.splitlines()
    for reason, needle in (("truncated", "cannot decode image"), ("empty", "empty file (0 bytes)"),
                           ("garbage", "not an image in a known format"), ("dangling", "cannot read: No such file")):
        hits = [line for line in lines if f"make_rec: skipped {bad[reason]}: {needle}" in line]
        assert len(hits) == 1, (reason, err)
    assert any(f"identity folder {tmp_path / 'faces' / 'bob'} left out (no JPEG/PNG files)" in line for line in lines)
    assert any(f"identity folder {tmp_path / 'faces' / 'cat'} left out (all 2 images are bad)" in line
               for line in lines)
    ds = MXFaceDataset(tmp_path / "rec")
    # amy and dan are classes 0 and 1: the left-out folders take no class id.
    assert ds.num_classes == 2 and [ds.raw(i)[1] for i in range(len(ds))] == [0, 0, 1, 1]
    assert ds.raw(0)[0] == _image(0) and ds.raw(2)[0] == _image(3)
    assert rec_info_main([str(tmp_path / "rec"), "--check"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == ["property", "train.idx", "train.rec"]
    report = make_rec(list_image_folder(tmp_path / "faces"), tmp_path / "rec2")
    assert report.dropped_folders == [tmp_path / "faces" / "bob", tmp_path / "faces" / "cat"]
    assert (report.images, report.classes, report.reencoded, len(report.bad)) == (4, 2, 1, 4)


def test_make_rec_no_skip_bad_lists_every_bad_file_and_writes_nothing(tmp_path, capsys):
    bad = _messy_folder(tmp_path / "faces")
    assert make_rec_main(["--images", str(tmp_path / "faces"), "--out", str(tmp_path / "new"), "--no-skip-bad"]) == 1
    err = capsys.readouterr().err
    assert all(f"make_rec: bad image {path}: " in err for path in bad.values()), err
    assert err.strip().splitlines()[-1] == ("make_rec: error: 4 of 8 images cannot be read or decoded (listed "
                                            "above); nothing written (--skip-bad leaves them out)")
    assert not (tmp_path / "new").exists()  # not even the folder
    # A rec already in --out stays as it was.
    (tmp_path / "good" / "a").mkdir(parents=True)
    (tmp_path / "good" / "a" / "0.jpg").write_bytes(_image(7))
    assert make_rec_main(["--images", str(tmp_path / "good"), "--out", str(tmp_path / "rec")]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "rec").iterdir()}
    assert make_rec_main(["--images", str(tmp_path / "faces"), "--out", str(tmp_path / "rec"), "--no-skip-bad"]) == 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "rec").iterdir()} == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("header", [False, True], ids=["no-records", "header-only"])
def test_a_rec_without_images_is_a_problem_not_a_pass(tmp_path, capsys, header):
    with IndexedRecordIO(tmp_path / "train.idx", tmp_path / "train.rec", "w") as w:
        if header:  # insightface layout: images at keys [1, 1), no identity ranges
            w.write_idx(0, pack(IRHeader(2, [1.0, 1.0], 0, 0), b""))
    message = (f"{tmp_path / 'train.rec'}: no image records ({tmp_path / 'train.idx'} lists {int(header)} keys); "
               f"a dataset needs at least one image")
    for argv in ([str(tmp_path), "--check"], [str(tmp_path)]):
        assert rec_info_main(argv) == 1
        assert capsys.readouterr().err.splitlines() == ["1 problem:", f"  {message}"]
    with pytest.raises(ValueError) as exc:
        MXFaceDataset(tmp_path)  # what the trainer opens: the same one line
    assert str(exc.value) == message


def test_make_rec_list_keeps_labels_and_warns_about_classes_without_images(tmp_path, capsys):
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(_image(i))
    (tmp_path / "bad.jpg").write_bytes(_image(9)[:1500])  # truncated
    # label 1 has only a bad image, label 3 none; --num-classes 5 adds class 4
    (tmp_path / "l.lst").write_text("0.jpg\t0\nbad.jpg\t1\n1.jpg\t2\n2.jpg\t2\n")
    assert make_rec_main(["--list", str(tmp_path / "l.lst"), "--out", str(tmp_path / "rec"),
                          "--num-classes", "5"]) == 0
    err = capsys.readouterr().err
    assert f"make_rec: skipped {tmp_path / 'bad.jpg'}: cannot decode image" in err
    assert "make_rec: warning: 3 of 5 classes have no images: 1, 3, 4" in err
    ds = MXFaceDataset(tmp_path / "rec")
    assert ds.num_classes == 5 and [ds.raw(i)[1] for i in range(len(ds))] == [0, 2, 2]
    assert rec_info_main([str(tmp_path / "rec"), "--check"]) == 0  # a warning, not a problem
    assert "warning: 3 of 5 classes have no images: 1, 3, 4" in capsys.readouterr().err
    assert rec_info(tmp_path / "rec", check=True)["empty_classes"] == [1, 3, 4]


@pytest.mark.parametrize("argv, code, message", [
    (["--images", "{tmp}/nowhere"], 2, "make_rec: error: image folder {tmp}/nowhere does not exist"),
    (["--list", "{tmp}/nowhere.lst"], 2, "make_rec: error: list file {tmp}/nowhere.lst does not exist"),
    (["--list", "{tmp}/l.lst", "--num-classes", "2"], 2,
     "make_rec: error: --num-classes 2 is below the 3 classes of the input (labels 0..2)"),
    (["--list", "{tmp}/bad.lst"], 1,
     "make_rec: error: none of the 1 images can be read or decoded (listed above); nothing written"),
])
def test_make_rec_errors_are_one_line(tmp_path, capsys, argv, code, message):
    (tmp_path / "a.jpg").write_bytes(_image(0))
    (tmp_path / "b.jpg").write_bytes(b"")
    (tmp_path / "l.lst").write_text("a.jpg\t2\n")
    (tmp_path / "bad.lst").write_text("b.jpg\t0\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert make_rec_main([*argv, "--out", str(tmp_path / "rec")]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == message.format(tmp=tmp_path), err
    assert not (tmp_path / "rec").exists()


@pytest.mark.process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_make_rec_stopped_while_writing_leaves_no_temporary_files(tmp_path, sig):
    """A real process, stopped by SIGTERM or Ctrl-C in the middle of writing: a FIFO among the images lets
    the test feed it once (the check pass) and then hold the write pass on it."""
    faces = tmp_path / "faces"
    (faces / "a").mkdir(parents=True)
    for i in range(3):
        (faces / "a" / f"{i}.jpg").write_bytes(_image(i))
    (faces / "b").mkdir()
    (faces / "b" / "z.jpg").write_bytes(_image(5))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "a").mkdir()
    (tmp_path / "old" / "a" / "0.jpg").write_bytes(_image(9))
    assert make_rec_main(["--images", str(tmp_path / "old"), "--out", str(tmp_path / "rec")]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "rec").iterdir()}
    fifo = faces / "b" / "zz.jpg"  # sorted last: the writer blocks on it after writing the others
    os.mkfifo(fifo)
    # A job started with `&` by a non-interactive shell (a CI script, `make test &`) inherits SIGINT ignored,
    # and so would the tool: give it the default disposition, as a terminal's process has.
    proc = subprocess.Popen([sys.executable, "scripts/make_rec.py", "--images", str(faces), "--out",
                             str(tmp_path / "rec")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        with open(fifo, "wb") as f:  # the check pass reads it once
            f.write(_image(6))
        deadline = time.monotonic() + 40
        while not list((tmp_path / "rec").glob(".*/train.rec.tmp")):  # utils.files.staged's folder
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and err.splitlines()[-1] == "make_rec: interrupted; nothing written"
    assert _leftovers(tmp_path) == []
    assert {p.name: p.read_bytes() for p in (tmp_path / "rec").iterdir()} == before


def test_rec_info_exit_status_separates_bad_data_from_usage(tmp_path, capsys):
    (tmp_path / "train.idx").write_text("garbage\n")
    (tmp_path / "train.rec").write_bytes(b"")
    assert rec_info_main([str(tmp_path)]) == 1  # there, but not a rec
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rec_info: error: {tmp_path / 'train.idx'}: line 1 is b'garbage'; expected 'key<TAB>offset' with two "
        f"integers"]
    assert rec_info_main([str(tmp_path / "missing")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_rec_info_names_a_folder_where_the_index_or_the_rec_should_be(tmp_path, capsys):
    (tmp_path / "train.rec").mkdir()
    (tmp_path / "train.idx").mkdir()
    assert rec_info_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rec_info: error: {tmp_path}: train.rec is a folder, not a file; train.idx is a folder, not a file; an "
        f"MXNet RecordIO dataset folder holds train.rec, train.idx and (insightface layout) property"]
    (tmp_path / "train.rec").rmdir()
    assert rec_info_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rec_info: error: {tmp_path}: missing train.rec; train.idx is a folder, not a file; an MXNet RecordIO "
        f"dataset folder holds train.rec, train.idx and (insightface layout) property"]


@pytest.mark.process
@pytest.mark.timeout(120)
def test_rec_info_checks_an_image_folder_and_lists_every_bad_file(tmp_path):
    """`scripts/rec_info.py FOLDER --check` on a folder per identity: every image read and decoded on 2 worker
    processes; a truncated JPEG, random bytes and a wrong size are each listed with the reason (exit 1); an
    identity with one image and a file training ignores are warnings."""
    folder = tmp_path / "faces"
    for person, count in (("alice", 3), ("bob", 2), ("carol", 1)):
        (folder / person).mkdir(parents=True)
        for i in range(count):
            (folder / person / f"{i}.jpg").write_bytes(_image(10 * len(person) + i))
    good = _image(99)
    (folder / "bob" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (folder / "bob" / "noise.jpg").write_bytes(np.random.default_rng(1).bytes(3000))
    (folder / "alice" / "big.png").write_bytes(_image(5, size=(120, 100), fmt="PNG"))
    (folder / "alice" / "notes.txt").write_text("not an image")
    cmd = [sys.executable, "scripts/rec_info.py", str(folder), "--check", "--workers", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"{folder}: image folder, 9 images, 3 identities"
    err = proc.stderr
    assert "warning: 1 of 3 identities have fewer than 2 images: carol (1)" in err
    assert "warning: 1 files are not .jpg/.jpeg/.png images and training ignores them: alice/notes.txt" in err
    assert "3 problems:" in err
    for name, reason in (("bob/truncated.jpg", "cannot decode image"), ("bob/noise.jpg", "cannot decode image"),
                         ("alice/big.png", "112")):
        line = next((line for line in err.splitlines() if f"{folder / name}" in line), None)
        assert line is not None and reason in line, (name, err)
    assert f"scripts/make_rec.py --images {folder} --out DIR, which skips them" in err
    for name in ("bob/truncated.jpg", "bob/noise.jpg", "alice/big.png"):
        (folder / name).unlink()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "check passed: every image reads, decodes and is 112x112" in proc.stdout
