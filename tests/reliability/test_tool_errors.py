"""The data tools' mistakes as a user makes them: an output that cannot be written, a file where a folder goes,
a binary file where text goes, a number out of range. Each gives one line naming the path or the option and a
non-zero exit, never a traceback (each tool's ``main``, the code its command line runs)."""
from __future__ import annotations

import os

import pytest
import torch

from scripts import make_bin, make_rec, make_synthetic, shuffle_rec, unpack_rec
from tests.helpers import FIXTURES, UNWRITABLE
from utils.cli import print_error
from utils.files import load_tensors


def _one_line(capsys, tool: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{tool}: error: "), err
    assert "Traceback" not in err[0]
    return err[0]


def test_outputs_that_cannot_be_written_are_one_line(tmp_path, capsys):
    assert make_synthetic.main(["--out", UNWRITABLE, "--num-classes", "2", "--images-per-class", "2",
                                "--pairs", "2", "--workers", "1"]) == 2
    assert UNWRITABLE in _one_line(capsys, "make_synthetic")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    assert shuffle_rec.main([str(FIXTURES / "rec_insightface"), str(a_file)]) == 2
    assert str(a_file) in _one_line(capsys, "shuffle_rec")
    assert unpack_rec.main([str(FIXTURES / "rec_insightface"), str(a_file)]) == 2
    line = _one_line(capsys, "unpack_rec")
    assert str(a_file) in line and a_file.read_text() == "not a folder"


def test_binary_files_where_text_goes_are_named(tmp_path, capsys):
    binary = tmp_path / "pairs.txt"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    assert make_bin.main(["--pairs", str(binary), "--out", str(tmp_path / "x.bin")]) == 2
    assert f"{binary}: not a text file of pairs" in _one_line(capsys, "make_bin")
    assert make_rec.main(["--list", str(binary), "--out", str(tmp_path / "rec")]) == 2
    assert f"{binary}: not a text list" in _one_line(capsys, "make_rec")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "rec").exists()


def test_a_folder_where_a_file_goes_and_a_file_where_a_folder_goes_say_so(tmp_path, capsys):
    folder, a_file = tmp_path / "folder", tmp_path / "a_file.txt"
    folder.mkdir()
    a_file.write_text("folder/ folder/ 1\n")  # a pair of "images" that are a folder
    assert make_bin.main(["--pairs", str(folder), "--out", str(tmp_path / "x.bin")]) == 2
    assert _one_line(capsys, "make_bin") == f"make_bin: error: pairs file is a folder, not a file: {folder}"
    assert make_bin.main(["--pairs", str(a_file), "--out", str(tmp_path / "x.bin")]) == 2
    assert _one_line(capsys, "make_bin").endswith(f"{a_file}:1: image is a folder, not a file: {folder}")
    assert make_rec.main(["--list", str(folder), "--out", str(tmp_path / "rec")]) == 2
    assert _one_line(capsys, "make_rec") == f"make_rec: error: list file {folder} is a folder, not a file"
    assert make_rec.main(["--images", str(a_file), "--out", str(tmp_path / "rec")]) == 2
    assert _one_line(capsys, "make_rec") == f"make_rec: error: image folder {a_file} is a file, not a folder"
    from backbones import get_model
    from scripts import inference

    model = ["--network", "tiny", "--network-kwargs", '{"widths": [4, 8, 8, 16]}', "--embedding-size", "16"]
    torch.save(get_model("tiny", num_features=16, widths=[4, 8, 8, 16]).state_dict(), tmp_path / "model.pt")
    assert inference.main([*model, "--weights", str(tmp_path / "model.pt"), "--image", str(folder)]) == 2
    assert _one_line(capsys, "inference") == f"inference: error: {folder}: a folder, not a photo"  # read_photo's
    assert inference.main([*model, "--weights", str(folder), "--image", str(a_file)]) == 2
    assert _one_line(capsys, "inference") == (f"inference: error: {folder}: a folder without model.pt (what the "
                                              f"trainer writes); it is empty: pass the weights file itself")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file.txt", "folder", "model.pt"]  # nothing written


@pytest.mark.parametrize("tool, argv, message", [
    (make_synthetic, ["--out", "x", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (shuffle_rec, ["src", "dst", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (make_rec, ["--images", "x", "--out", "y", "--image-size", "0", "112"],
     "--image-size must be two sizes >= 1, got 0 112"),
])
def test_numbers_out_of_range_name_the_option(tmp_path, capsys, monkeypatch, tool, argv, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        tool.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing created


def test_a_file_that_is_not_a_torch_file_says_so_without_torch_s_advice(tmp_path):
    junk = tmp_path / "model.pt"
    junk.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ValueError) as caught:
        load_tensors(junk)
    message = str(caught.value)
    assert message.startswith(f"{junk}: refused:") and "or it is not a torch file" in message
    assert "Unsupported operand" in message
    assert "weights_only" not in message and "\n" not in message  # torch's advice would run the file's code
    hostile = tmp_path / "hostile.pt"
    torch.save({"weights": _RunsCommand()}, hostile)
    with pytest.raises(ValueError) as caught:
        load_tensors(hostile)
    message = str(caught.value)
    assert message.startswith(f"{hostile}: refused:") and "posix.system" in message and "weights_only" not in message


class _RunsCommand:
    def __reduce__(self):
        return os.system, ("true",)


def test_every_tool_reports_an_error_in_one_line(capsys):
    print_error("tool", ValueError("a.bin: first line\n  second   line\n"))
    assert capsys.readouterr().err == "tool: error: a.bin: first line second line\n"
    worker = ValueError("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
                        "last):\n  File \"x.py\", line 1, in f\nValueError: b.png: cannot decode image\n")
    print_error("tool", worker)  # the worker's own error, not its traceback
    assert capsys.readouterr().err == "tool: error: ValueError: b.png: cannot decode image\n"
    print_error("tool", KeyError())
    assert capsys.readouterr().err == "tool: error: KeyError\n"


def test_verify_names_a_folder_given_as_a_target_and_a_missing_one(tmp_path, capsys):
    from scripts import verify

    (tmp_path / "lfw.bin").mkdir()
    argv = ["--network", "tiny", "--network-kwargs", '{"widths": [4, 8, 8, 16]}', "--embedding-size", "16",
            "--random-init", "0", "--data-dir", str(tmp_path), "--device", "cpu"]
    assert verify.main([*argv, "--targets", "lfw"]) == 2
    assert _one_line(capsys, "verify") == (f"verify: error: verification file is a folder, not a file: "
                                           f"{tmp_path / 'lfw.bin'}")
    assert verify.main([*argv, "--targets", "cfp_fp,lfw"]) == 2
    assert _one_line(capsys, "verify") == (f"verify: error: verification file(s) not found: "
                                           f"{tmp_path / 'cfp_fp.bin'}; verification file is a folder, not a "
                                           f"file: {tmp_path / 'lfw.bin'}")
