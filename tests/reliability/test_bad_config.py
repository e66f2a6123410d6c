"""Config and argument mistakes through ``train.py``'s command line: a non-zero exit and one line naming the key,
the value and what is allowed; no traceback. One rank runs ``train.main`` in this process (``train_here``); the
torchrun cases start the real processes. tests/test_config.py tests the rules on ``load_config``."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers import ROOT, subprocess_env, torchrun_command, train_here, two_nodes

CASES = {
    "unknown_key": ("sample_rat=0.5", r"sample_rat.*'sample_rate'"),
    "wrong_type": ("batch_size=many", r"batch_size.*'many'"),
    "sample_rate_zero": ("sample_rate=0", r"sample_rate.*0.*\(0, 1\]"),
    "sample_rate_above_one": ("sample_rate=1.5", r"sample_rate.*1.5.*\(0, 1\]"),
    "batch_size_zero": ("batch_size=0", r"batch_size.*0.*>= 1"),
    "missing_dataset": ("rec=/nonexistent/faces", r"rec = '/nonexistent/faces': no such folder"),
}


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_cli_rejects_with_one_line(tmp_path, case):
    setting, message = CASES[case]
    proc = train_here("configs/debug_cpu", tmp_path / "out", setting, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    hits = [line for line in error_lines(out) if re.search(message, line)]
    assert len(hits) == 1, f"{message!r} in {out!r}"
    assert len(error_lines(proc.stderr)) == 1 and re.search(message, proc.stderr), proc.stderr  # that line, on stderr


def _failed_torchrun(tmp_path, setting: str) -> str:
    """stdout + stderr of the debug config on 2 torchrun ranks with ``setting``, which must make it fail."""
    cmd = [*torchrun_command(2), "train.py", "configs/debug_cpu", "--set", f"output={tmp_path / 'out'}", setting]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=110)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_more_ranks_than_classes_under_torchrun(tmp_path):
    out = _failed_torchrun(tmp_path, "num_classes=1")
    assert re.search(r"num_classes = 1 is smaller than world_size = 2.*at most 1 ranks", out), out[-3000:]
    # torchrun prints its own failure summary; the workers print no traceback of train.py.
    assert 'train.py", line' not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_config_mistake_under_torchrun_is_said_once_and_not_logged(tmp_path):
    """Found before the run has a folder: the node's first rank says it on stderr; no training.log is made."""
    out = _failed_torchrun(tmp_path, "sample_rat=0.5")
    hits = [line for line in error_lines(out) if re.search(r"^train.py: .*sample_rat.*'sample_rate'", line)]
    assert len(hits) == 1, out[-3000:]
    assert 'train.py", line' not in out, out[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_dataset_missing_on_one_node_stops_every_node_with_its_line(tmp_path):
    """Nodes may each read their own copy of the data: node 1's is missing. That node names its path on its own
    output, the other names the rank (the rendezvous decides which node holds rank 0; rank 0's line is also in
    training.log), and neither waits in a collective for the other."""
    output = tmp_path / "out"
    (code0, out0), (code1, out1) = two_nodes("configs/debug_cpu", output, ("max_steps=4",),
                                             ("max_steps=4", "rec=/nonexistent/faces"), timeout=120)
    assert code0 != 0 and code1 != 0, out0[-3000:] + out1[-3000:]
    missing = [line for line in error_lines(out1) if "rec = '/nonexistent/faces': no such folder" in line]
    assert len(missing) == 1, out1[-3000:]
    other = [line for line in error_lines(out0) if re.search(r"rank 1 cannot use the paths .*same dataset path", line)]
    rank0 = [line for line in error_lines(out0) if re.search(r"rank 0 cannot use the paths", line)]
    assert (len(other), len(rank0)) in ((1, 0), (0, 1)), out0[-3000:]
    assert ("no such folder" if rank0 else "cannot use the paths") in (output / "training.log").read_text()
    for out in (out0, out1):
        assert 'train.py", line' not in out, out[-3000:]
