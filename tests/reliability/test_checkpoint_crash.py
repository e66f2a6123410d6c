"""A process SIGKILLed between writing a checkpoint and renaming it into place: the previous checkpoint stays
the newest complete one, the next run removes the partial directory and resumes from it. A save of an existing
step stopped between its two renames: the next run renames the old copy back and resumes from it."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers import CONFIG, REFERENCE, ROOT, load_model, max_difference, subprocess_env, torchrun_command, train
from utils.checkpoint import MANIFEST, find_latest, is_complete, step_dir

# Runs train.main() in a process whose os.replace SIGKILLs the process instead of renaming
# checkpoints/step_000000010.tmp: every file and the manifest are written and fsynced, the rename is not.
CRASH_AT_RENAME = """\
import os, signal, sys
sys.path.insert(0, {root!r})
_replace = os.replace
def replace(src, dst):
    if os.path.basename(os.fspath(src)) == "step_000000010.tmp":
        os.kill(os.getpid(), signal.SIGKILL)
    return _replace(src, dst)
os.replace = replace
import train
sys.exit(train.main())
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_between_write_and_rename_keeps_previous_checkpoint_and_resume_uses_it(reference_run, tmp_path):
    output = tmp_path / "crashed"
    script = tmp_path / "crash_at_rename.py"
    script.write_text(CRASH_AT_RENAME.format(root=str(ROOT)))
    cmd = [*torchrun_command(2), str(script), CONFIG, "--set", f"output={output}", *REFERENCE]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "Signals.SIGKILL" in proc.stdout + proc.stderr or "-9" in proc.stdout + proc.stderr, proc.stderr[-3000:]

    partial = step_dir(output, 10).with_name("step_000000010.tmp")
    assert (partial / MANIFEST).is_file(), f"not killed between write and rename: {sorted(partial.parent.iterdir())}"
    assert not step_dir(output, 10).exists()
    assert find_latest(output) == step_dir(output, 5) and is_complete(step_dir(output, 5))

    done = train(CONFIG, output, *REFERENCE, nproc=2)
    assert "removed partial checkpoints: step_000000010.tmp" in done.stdout
    assert f"resumed from {step_dir(output, 5)} at step 5" in done.stdout
    assert not partial.exists() and find_latest(output) == step_dir(output, 40)
    assert max_difference(load_model(reference_run), load_model(output)) <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_resave_stopped_between_its_renames_is_resumed_from_the_old_copy(reference_run, tmp_path):
    output = tmp_path / "run"
    shutil.copytree(reference_run, output)
    last = step_dir(output, 40)
    # Saving step 40 again stopped after moving the complete copy aside, before renaming the new one in.
    os.replace(last, last.with_name(last.name + ".old"))
    partial = last.with_name(last.name + ".tmp")
    partial.mkdir()
    (partial / "head_rank0.pt").write_bytes(b"partial")

    done = train(CONFIG, output, *REFERENCE, nproc=2)
    assert "restored checkpoints a stopped save had moved aside: step_000000040" in done.stdout, done.stdout[-3000:]
    assert f"resumed from {last} at step 40" in done.stdout, done.stdout[-3000:]
    assert not partial.exists() and not last.with_name(last.name + ".old").exists()
    assert find_latest(output) == last and is_complete(last)
    assert max_difference(load_model(reference_run), load_model(output)) <= 1e-6
