"""What every tool shares (utils.cli: errors, exit codes, Ctrl-C and SIGTERM, progress lines) and the staged
writer of their output folders (utils.files.staged)."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from utils.cli import (
    EXIT_BAD_DATA,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    BadData,
    Progress,
    UsageError,
    quiet_interrupt,
    run_tool,
)
from utils.files import staged


class OtherBad(Exception):
    pass


def _raise(exc: BaseException):
    def work():
        raise exc
    return work


@pytest.mark.parametrize("exc, code", [(BadData("a.rec: record 3 is truncated"), EXIT_BAD_DATA),
                                       (OtherBad("a.bin: not a pickle"), EXIT_BAD_DATA),
                                       (UsageError("--pairs must be >= 2"), EXIT_USAGE),
                                       (ValueError("config: no key lr2"), EXIT_USAGE),
                                       (FileNotFoundError(2, "No such file or directory", "x.rec"), EXIT_USAGE)])
def test_each_kind_of_error_is_one_line_and_its_exit_code(exc, code, capsys):
    assert run_tool("tool", _raise(exc), bad_data=(OtherBad,)) == code
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tool: error: ") and "Traceback" not in err[0], err


def test_the_work_sets_the_code_and_prints_its_own_output(capsys):
    assert run_tool("tool", lambda: print("done")) == 0
    assert run_tool("tool", lambda: 1) == 1
    assert capsys.readouterr().out == "done\n"


def test_ctrl_c_and_sigterm_unwind_and_say_so(capsys):
    unwound = []

    def work():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):  # the handler runs between two bytecodes of this thread
                pass
            raise AssertionError("SIGTERM did not stop the work")
        finally:
            unwound.append(True)

    before = signal.getsignal(signal.SIGTERM)
    assert run_tool("tool", work, on_interrupt="; nothing written") == EXIT_TERMINATED
    assert unwound == [True] and signal.getsignal(signal.SIGTERM) is before
    assert capsys.readouterr().err == "tool: interrupted; nothing written\n"
    assert run_tool("tool", _raise(KeyboardInterrupt()), on_interrupt=lambda: "; 3 of 9 saved") == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "tool: interrupted; 3 of 9 saved\n"


@pytest.mark.process
def test_ctrl_c_while_a_tool_imports_is_one_line_and_the_module_loads_no_library(capsys):
    """A tool imports utils.cli first and the rest inside ``quiet_interrupt``: utils.cli itself must load nothing
    heavy (torch takes seconds), and Ctrl-C inside the block is one line and exit 130."""
    with pytest.raises(SystemExit) as stop:
        with quiet_interrupt("tool"):
            raise KeyboardInterrupt()
    assert stop.value.code == EXIT_INTERRUPTED and capsys.readouterr().err == "tool: interrupted\n"
    loaded = subprocess.run([sys.executable, "-c", "import sys, utils.cli; print(sorted({'torch', 'numpy', 'tqdm'} "
                             "& set(sys.modules)))"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "[]", loaded.stderr


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_a_line_every_half_minute_when_the_output_is_not_a_terminal():
    lines: list[str] = []
    clock = _Clock()
    progress = Progress(1000, "photos", lines.append, initial=100, stream=io.StringIO(), clock=clock)
    for _ in range(31):
        clock.now += 2.0  # 10 photos every 2 s: 5 photos/s
        progress.update(10)
    progress.close()
    assert lines == ["250 of 1000 photos, 5.0 photos/s, 0:02:30 left", "400 of 1000 photos, 5.0 photos/s, 0:02:00 left",
                     "410 of 1000 photos, 5.0 photos/s, 0:01:58 left"]  # the last at the end
    # A run shorter than the interval writes nothing.
    quiet: list[str] = []
    short = Progress(10, "photos", quiet.append, stream=io.StringIO(), clock=_Clock())
    short.update(10)
    short.close()
    assert quiet == []


def test_a_new_folder_appears_whole_with_the_permissions_mkdir_gives(tmp_path):
    target = tmp_path / "out" / "rec"
    with staged(target) as folder:
        assert not target.exists() and folder.parent == target.parent
        (folder / "train.rec").write_bytes(b"rec")
        (folder / "sub").mkdir()
    assert sorted(p.name for p in target.iterdir()) == ["sub", "train.rec"]
    assert target.stat().st_mode & 0o777 == 0o777 & ~_umask()
    assert [p.name for p in target.parent.iterdir()] == ["rec"]


def test_into_an_existing_folder_entries_are_replaced_and_the_last_ones_move_last(tmp_path, monkeypatch):
    target = tmp_path / "out"
    target.mkdir()
    (target / "train.rec").write_bytes(b"old")
    (target / "keep.txt").write_text("mine")
    (target / "images").mkdir()
    (target / "images" / "old.jpg").write_bytes(b"x")
    moved = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moved.append(os.path.basename(b)), real(a, b)))
    with staged(target, last=("a_stamp.json",)) as folder:
        for name in ("a_stamp.json", "train.rec", "z.idx"):
            (folder / name).write_bytes(name.encode())
        (folder / "images").mkdir()
        (folder / "images" / "new.jpg").write_bytes(b"y")
    assert moved == ["images", "train.rec", "z.idx", "a_stamp.json"]
    assert (target / "train.rec").read_bytes() == b"train.rec" and (target / "keep.txt").read_text() == "mine"
    assert [p.name for p in (target / "images").iterdir()] == ["new.jpg"]
    assert sorted(p.name for p in target.iterdir()) == ["a_stamp.json", "images", "keep.txt", "train.rec", "z.idx"]


@pytest.mark.parametrize("exists", [False, True])
def test_whatever_stops_the_block_leaves_no_staging_folder_and_the_target_as_it_was(tmp_path, exists):
    target = tmp_path / "out"
    if exists:
        target.mkdir()
        (target / "train.rec").write_bytes(b"old")
    for exc in (ValueError("bad"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with staged(target) as folder:
                (folder / "train.rec").write_bytes(b"new")
                raise exc
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if exists else [])
    if exists:
        assert [p.name for p in target.iterdir()] == ["train.rec"] and (target / "train.rec").read_bytes() == b"old"


def test_a_target_that_cannot_be_written_is_named_not_its_staging_folder():
    with pytest.raises(OSError) as caught:
        with staged("/proc/no-such-folder"):
            pass
    assert "cannot write /proc/no-such-folder:" in str(caught.value) and ".tmp" not in str(caught.value)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
