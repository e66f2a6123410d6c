"""Day two through the train.py CLI, as a user types it: continue with a changed schedule, move the data,
start in a folder that holds another run, and every mistake as one line on stderr and in training.log.

Runs are configs/debug_cpu (synthetic data) or the same network on a small image folder; each takes seconds. One
rank runs train.py's main in this process (``tests.helpers.train_here``); a full disk, on one rank and two, stops
real processes.
"""
from __future__ import annotations

import errno
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    CONFIG,
    ROOT,
    faces,
    load_model,
    logged_lrs,
    subprocess_env,
    torchrun_command,
    train_here,
)
from utils.checkpoint import find_latest, list_checkpoints, step_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
RUN = ("max_steps=12", "save_every_steps=4", "keep_checkpoints=5", "frequent=1")


def one_error_line(proc: subprocess.CompletedProcess, output: Path) -> str:
    """The run's single error: exit 2, no traceback, exactly one line on stderr, the same line in training.log."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    log = (output / "training.log").read_text()
    assert lines[0].split(" ERROR ", 1)[-1] in log
    return lines[0]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """A finished 12-step run with checkpoints at 4, 8, 12."""
    output = tmp_path_factory.mktemp("day_two") / "run"
    train_here(CONFIG, output, *RUN)
    return output


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


# ------------------------------------------------------------------------------------------------ resume
def test_explicit_resume_continues_a_longer_schedule_with_a_lower_lr_and_another_power(first_run, tmp_path):
    output = copy_run(first_run, tmp_path / "run")
    proc = train_here(CONFIG, output, *RUN[1:], "max_steps=20", "lr=0.01", "lr_power=2", "--resume")
    warning = [line for line in proc.stdout.splitlines() if "with a changed config" in line]
    assert len(warning) == 1 and "lr 0.1 → 0.01" in warning[0] and "max_steps 12 → 20" in warning[0], proc.stdout
    assert "lr_power 1.0 → 2.0" in warning[0], warning
    lrs = logged_lrs(output)
    assert min(s for s in lrs if lrs[s][0] == 20) == 13 and max(lrs) == 20  # from the saved step to the new end
    # The finished curve's step 12 would train at 0: the LR goes on from the last step's (0.1 / 12 at step 11),
    # scaled by 0.01 / 0.1, and decays to 0 at step 20 with power 2, no step repeated; it does not restart the new
    # curve (0.01 (1 - 12/20)^2 would be 0.0016).
    assert float(lrs[12][1]) == pytest.approx(0.1 / 12, abs=1e-6)  # logged with 6 decimals
    assert "the learning rate goes on from 0.000833333 at step 11 and decays to 0 at step 20" in warning[0], warning
    assert float(lrs[13][1]) == pytest.approx(0.1 / 12 * 0.1 * (1 - 1 / 9) ** 2, abs=1e-6)  # logged with 6 decimals
    assert float(lrs[14][1]) == pytest.approx(0.1 / 12 * 0.1 * (1 - 2 / 9) ** 2, abs=1e-6)
    assert find_latest(output) == step_dir(output, 20)


def test_extending_a_run_continues_its_learning_rate(tmp_path):
    """`--resume` with max_steps 20 -> 30: the learning rate goes on from where it was and decays to 0 at the new
    end (it jumped back up: the new schedule from step 0); the resumed step trains at the saved curve's LR for that
    step (it repeated the step before's); a later resume without changes follows the same curve."""
    output = tmp_path / "run"
    sets = ("max_steps=20", "frequent=1", "save_every_steps=5", "keep_checkpoints=5")
    train_here(CONFIG, output, *sets)
    before = {step: float(lr) for step, (_, lr) in logged_lrs(output).items()}
    shutil.rmtree(step_dir(output, 20))
    shutil.rmtree(step_dir(output, 15))  # the job died after step 10: resume at 10 with 30 steps now
    proc = train_here(CONFIG, output, "max_steps=30", *sets[1:], "--resume")
    warning = [line for line in proc.stdout.splitlines() if "with a changed config" in line]
    assert len(warning) == 1 and "max_steps 20 → 30" in warning[0], proc.stdout
    assert f"goes on from {before[11]:.6g} at step 10 and decays to 0 at step 30" in warning[0], warning
    after = {step: float(lr) for step, (total, lr) in logged_lrs(output).items() if total == 30}
    # The line of step n reports the LR of 0-based step n - 1: step 10 trains at the 20-step curve's LR for step 10,
    # not again at step 9's, then on down to 0 at 30.
    assert after[11] == pytest.approx(before[11], abs=1e-6) and after[11] < before[10]
    assert all(after[s + 1] < after[s] for s in range(11, 30))
    assert after[30] == pytest.approx(before[11] / 20, abs=1e-6)
    shutil.rmtree(step_dir(output, 30))
    shutil.rmtree(step_dir(output, 25))  # resumed again at 20, same config: the same curve
    train_here(CONFIG, output, "max_steps=30", *sets[1:])
    again = {step: float(lr) for step, (total, lr) in logged_lrs(output).items() if total == 30}
    assert again[21] == pytest.approx(after[21], abs=1e-7) and again[30] == pytest.approx(after[30], abs=1e-7)


def test_explicit_resume_extends_an_epoch_schedule_and_its_warm_up(tmp_path):
    # 64 images of 8 per step: 8 steps per epoch; 2 epochs with 1 of warm-up, checkpoints at each epoch's end.
    epochs = ("max_steps=0", "num_image=64", "save_every_steps=0", "keep_checkpoints=5", "frequent=1")
    output = tmp_path / "run"
    train_here(CONFIG, output, *epochs, "num_epoch=2", "warmup_epoch=1")
    assert list_checkpoints(output) == [step_dir(output, 8), step_dir(output, 16)]
    shutil.rmtree(step_dir(output, 16))  # as if the job had died in its second epoch
    proc = train_here(CONFIG, output, *epochs, "num_epoch=4", "warmup_epoch=2", "--resume")
    warning = [line for line in proc.stdout.splitlines() if "with a changed config" in line]
    assert len(warning) == 1 and "num_epoch 2 → 4" in warning[0] and "warmup_epoch 1 → 2" in warning[0], proc.stdout
    lrs = logged_lrs(output)
    assert min(s for s in lrs if lrs[s][0] == 32) == 9 and max(lrs) == 32  # from the saved step to 4 epochs
    assert float(lrs[9][1]) == pytest.approx(0.1 * 8 / 16, abs=1e-7)  # step 8 is half-way through the new warm-up
    assert float(lrs[17][1]) == pytest.approx(0.1, abs=1e-7)  # the warm-up ends after 2 epochs
    assert float(lrs[25][1]) == pytest.approx(0.1 * (1 - 8 / 16), abs=1e-7)  # then the linear decay to step 32
    assert find_latest(output) == step_dir(output, 32)


def test_explicit_resume_refuses_what_cannot_continue(first_run, tmp_path):
    output = copy_run(first_run, tmp_path / "run")
    line = one_error_line(train_here(CONFIG, output, *RUN, "embedding_size=64", "--resume", check=False), output)
    assert "embedding_size 32 → 64 cannot continue" in line and "init_backbone=" in line and "model.pt" in line


def test_auto_resume_names_the_keys_that_differ(first_run, tmp_path):
    output = copy_run(first_run, tmp_path / "run")
    line = one_error_line(train_here(CONFIG, output, *RUN, "weight_decay=0.001", check=False), output)
    assert "holds checkpoints of another config (weight_decay 0.0005 → 0.001)" in line and "--resume" in line
    assert list_checkpoints(output) == [step_dir(output, s) for s in (4, 8, 12)]  # nothing deleted


def test_a_moved_dataset_resumes_by_itself(tmp_path):
    data = faces(tmp_path / "disk1" / "faces")
    sets = ("num_classes=8", "num_image=32", "batch_size=4", "max_steps=8", "save_every_steps=4", "frequent=1",
            "val_targets=")
    output = tmp_path / "run"
    train_here(CONFIG, output, f"rec={data}", *sets)
    shutil.rmtree(step_dir(output, 8))  # as if the job had died after step 4
    moved = shutil.move(str(data), tmp_path / "disk2")
    proc = train_here(CONFIG, output, f"rec={moved}", *sets)
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout, proc.stdout[-2000:]
    assert find_latest(output) == step_dir(output, 8)


# ------------------------------------------------------------------------------------------------ folder
def test_a_fresh_run_never_deletes_or_shadows_another_runs_checkpoints(first_run, tmp_path):
    """The sequence that lost work: auto_resume = False into a folder holding another run's checkpoints used
    to write new ones that the rotation then deleted (the old run's higher steps won)."""
    output = copy_run(first_run, tmp_path / "run")
    model_before = load_model(output)
    line = one_error_line(train_here(CONFIG, output, *RUN, "auto_resume=false", "max_steps=8", check=False), output)
    assert "would delete or shadow them" in line and "archive_checkpoints=True" in line and "resume=PATH" in line
    assert list_checkpoints(output) == [step_dir(output, s) for s in (4, 8, 12)]
    assert all(torch.equal(v, load_model(output)[k]) for k, v in model_before.items())  # model.pt untouched
    proc = train_here(CONFIG, output, *RUN, "auto_resume=false", "max_steps=8", "archive_checkpoints=true")
    archived = [p for p in output.iterdir() if p.name.startswith("archive_")]
    assert len(archived) == 1 and sorted(p.name for p in archived[0].iterdir()) == [
        "model.json", "model.pt", "step_000000004", "step_000000008", "step_000000012"], proc.stdout[-2000:]
    assert list_checkpoints(output) == [step_dir(output, s) for s in (4, 8)]  # the new run's, rotated alone


def test_resume_from_an_older_checkpoint_archives_or_refuses_the_newer_ones(first_run, tmp_path):
    output = copy_run(first_run, tmp_path / "run")
    line = one_error_line(train_here(CONFIG, output, *RUN, f"resume={step_dir(output, 4)}", check=False), output)
    assert "step_000000008, step_000000012" in line
    proc = train_here(CONFIG, output, *RUN, f"resume={step_dir(output, 4)}", "archive_checkpoints=true")
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    archived = [p for p in output.iterdir() if p.name.startswith("archive_")]
    assert sorted(p.name for p in archived[0].iterdir()) == ["model.json", "model.pt", "step_000000008",
                                                             "step_000000012"]
    assert [p.name for p in list_checkpoints(output)] == ["step_000000004", "step_000000008", "step_000000012"]


# ------------------------------------------------------------------------------------------------ one line
@pytest.fixture(scope="module")
def small_faces(tmp_path_factory) -> Path:
    return faces(tmp_path_factory.mktemp("faces") / "faces")


@pytest.mark.parametrize("setting,message", [
    ("num_classes=4", "has 8 identity folders (labels 0..7) but num_classes = 4: its labels would be out of range"),
    # configs/debug_cpu's num_classes = 64 kept for a folder of 8 identities: classes no image can teach.
    ("num_classes=64", "has 8 identity folders (labels 0..7) but num_classes = 64: the head would train 56 classes "
                       "that have no image; set num_classes = 8, or None to read it from the folder"),
    ("num_image=40", "num_image = 40 in the config, but the dataset"),
    ("network=r51", "unknown backbone 'r51' (did you mean 'r50'?)"),
])
def test_mistakes_found_while_building_are_one_line(small_faces, tmp_path, setting, message):
    output = tmp_path / "run"
    line = one_error_line(train_here(CONFIG, output, f"rec={small_faces}", "num_classes=8", "num_image=32",
                                "batch_size=4", "val_targets=", setting, check=False), output)
    assert message in line, line


def test_init_backbone_starts_from_our_model_pt_or_arcface_torch_s_checkpoint(first_run, tmp_path):
    """Fine-tuning: the backbone starts from ``model.pt``, or from arcface_torch's ``checkpoint_gpu_0.pt`` (its
    ``state_dict_backbone``); with an LR of 1e-12 one step leaves the weights where they started. A folder holding
    only arcface_torch's checkpoint cannot be resumed: the line says to start from it with init_backbone."""
    weights = load_model(first_run)
    arcface = tmp_path / "arcface_run" / "checkpoint_gpu_0.pt"
    arcface.parent.mkdir()
    torch.save({"epoch": 1, "global_step": 12, "state_dict_backbone": weights,
                "state_dict_softmax_fc": {"weight": torch.zeros(64, 32)},
                "state_optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
                "state_lr_scheduler": {"last_epoch": 12, "base_lrs": [0.1]}}, arcface)
    learned = [k for k in weights if "running" not in k and "num_batches" not in k]  # BN statistics move in any step
    for source, name in ((first_run / "model.pt", "ours"), (arcface, "arcface")):
        output = tmp_path / name
        train_here(CONFIG, output, f"init_backbone={source}", "max_steps=1", "lr=1e-12", "frequent=1")
        started = load_model(output)
        assert max(float((started[k] - weights[k]).abs().max()) for k in learned) < 1e-6, name
    line = one_error_line(train_here(CONFIG, arcface.parent, "resume=true", check=False), arcface.parent)
    assert "checkpoint_gpu_0.pt is arcface_torch's checkpoint" in line and f"init_backbone={arcface}" in line


def test_a_bad_init_backbone_file_is_one_line(tmp_path):
    weights = tmp_path / "model.pt"
    torch.save({"conv1.weight": torch.zeros(3)}, weights)
    output = tmp_path / "run"
    line = one_error_line(train_here(CONFIG, output, f"init_backbone={weights}", check=False), output)
    assert f"{weights} does not match network tiny" in line


def test_num_classes_and_num_image_come_from_the_dataset(small_faces, tmp_path):
    proc = train_here(CONFIG, tmp_path / "run", f"rec={small_faces}", "num_classes=none", "num_image=none",
                 "batch_size=4", "max_steps=2", "val_targets=")
    assert f"data {small_faces}: num_classes = 8 (from the dataset), num_image = 32 (from the dataset)" in proc.stdout
    proc = train_here(CONFIG, tmp_path / "again", f"rec={small_faces}", "num_classes=8", "num_image=none",
                 "batch_size=4", "max_steps=2", "val_targets=")
    assert f"data {small_faces}: num_classes = 8 (the config's), num_image = 32 (from the dataset)" in proc.stdout


FULL_DISK = """\
import errno, os, sys
sys.path.insert(0, {root!r})
_open = open
def full(path, *args, **kwargs):
    if "step_000000008.tmp" in os.fspath(path) and "w" in (args[0] if args else kwargs.get("mode", "r")):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
    return _open(path, *args, **kwargs)
import builtins
builtins.open = full
import train
sys.exit(train.main())
"""


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, nproc):
    output = tmp_path / "run"
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK.format(root=str(ROOT)))
    args = [str(script), CONFIG, "--set", f"output={output}", *RUN]
    cmd = [sys.executable, *args] if nproc == 1 else [*torchrun_command(nproc), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=200)
    text = proc.stdout + proc.stderr
    # torchrun prints its own failure summary; no traceback of ours.
    assert proc.returncode != 0 and 'train.py", line' not in text and 'full_disk.py", line' not in text, text[-3000:]
    hits = [line for line in text.splitlines() if "checkpoint step 8 was not written" in line]
    assert len(hits) == 1, text[-3000:]  # once, also with two ranks
    assert errno.errorcode[errno.ENOSPC] in hits[0] or "No space left on device" in hits[0]
    assert re.search(r"it needs about \d+ MB and \d+ MB are free in ", hits[0]), hits[0]  # README: how much it needs
    assert f"the previous checkpoint {step_dir(output, 4)} is intact" in hits[0]
    assert find_latest(output) == step_dir(output, 4) and not list((output / "checkpoints").glob("*.tmp"))
    if nproc == 1:
        one_error_line(proc, output)
