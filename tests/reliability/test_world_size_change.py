"""Every test of resuming on another world size, with the real trainer.

The gathered head (weights and optimizer state) equals the saved one after 2 -> 1, 2 -> 3 and 3 -> 2; training
continues to the end from early and late in an epoch (2 -> 3, past the 3-rank epoch's length) and from a
3-rank run's checkpoints on 2 ranks; an epoch-based schedule continues at the same fraction of training
(2 -> 1, 1 -> 2, 3 -> 2) against uninterrupted runs on the new world size.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    CONFIG,
    REFERENCE,
    copy_checkpoints_until,
    gathered_head_after_resume,
    logged_losses,
    logged_lrs,
    on_ranks,
    saved_head,
    train,
    train_here,
)
from utils.checkpoint import find_latest, step_dir


def run(world: int, output: Path, *sets: str):
    """train.py on ``world`` ranks: torchrun's, or one in this process (``train_here``)."""
    return train_here(CONFIG, output, *sets) if world == 1 else train(CONFIG, output, *sets, nproc=world)


@pytest.fixture(scope="module")
def three_rank_run(reference_run, tmp_path_factory) -> Path:
    """The 2-rank reference's checkpoint at step 15 (epoch 0, 15 of 16 steps done) continued on 3 ranks."""
    output = copy_checkpoints_until(reference_run, tmp_path_factory.mktemp("three") / "run", step=15)
    proc = train(CONFIG, output, *REFERENCE, nproc=3)
    assert "world size changed 2 -> 3" in proc.stdout, proc.stdout[-3000:]
    return output


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 3])
def test_two_rank_head_resumes_on_another_world_size(reference_run, tmp_path, world_size):
    ckpt = step_dir(reference_run, 10)
    step, weight, state = on_ranks(gathered_head_after_resume, world_size, CONFIG, REFERENCE, str(ckpt),
                                             str(tmp_path))[0]
    want_weight, want_state = saved_head(ckpt)
    assert step == 10
    assert torch.equal(weight, want_weight)
    assert state.keys() == want_state.keys() and all(torch.equal(state[k], want_state[k]) for k in state)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_to_three_continues_from_early_in_an_epoch(reference_run, tmp_path):
    output = copy_checkpoints_until(reference_run, tmp_path / "three", step=5)
    proc = train(CONFIG, output, *REFERENCE, nproc=3)
    assert "world size changed 2 -> 3" in proc.stdout, proc.stdout[-3000:]
    losses = logged_losses(output)
    assert min(losses) == 6 and max(losses) == 40 and all(float(v) == float(v) for v in losses.values())
    assert sorted(p.name for p in step_dir(output, 40).glob("head_rank*.pt")) == [
        "head_rank0.pt", "head_rank1.pt", "head_rank2.pt"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_to_three_continues_from_late_in_an_epoch(three_rank_run):
    losses = logged_losses(three_rank_run)
    assert min(losses) == 16 and max(losses) == 40, sorted(losses)
    assert all(float(v) == float(v) and float(v) < float("inf") for v in losses.values()), losses
    last = find_latest(three_rank_run)
    assert last == step_dir(three_rank_run, 40)
    assert sorted(p.name for p in last.glob("head_rank*.pt")) == ["head_rank0.pt", "head_rank1.pt", "head_rank2.pt"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_three_to_two_gives_the_saved_head(three_rank_run, tmp_path):
    ckpt = step_dir(three_rank_run, 30)
    step, weight, state = on_ranks(gathered_head_after_resume, 2, CONFIG, REFERENCE, str(ckpt), str(tmp_path),
                                              timeout=150)[0]
    want_weight, want_state = saved_head(ckpt)
    assert step == 30
    assert torch.equal(weight, want_weight)
    assert state.keys() == want_state.keys() and all(torch.equal(state[k], want_state[k]) for k in state)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_to_two_continues_to_the_end(three_rank_run, tmp_path):
    output = copy_checkpoints_until(three_rank_run, tmp_path / "two", step=30)
    proc = train(CONFIG, output, *REFERENCE, nproc=2)
    assert "world size changed 3 -> 2" in proc.stdout and "at step 30" in proc.stdout, proc.stdout[-3000:]
    losses = logged_losses(output)
    assert min(losses) == 31 and max(losses) == 40, sorted(losses)
    assert all(float(v) == float(v) and float(v) < float("inf") for v in losses.values()), losses
    assert sorted(p.name for p in step_dir(output, 40).glob("head_rank*.pt")) == ["head_rank0.pt", "head_rank1.pt"]


# ------------------------------------------------------------------------------------ epoch-based schedules
# max_steps = 0: the schedule counts epochs. 96 images of 8 per rank: 12 steps per epoch on 1 rank, 6 on 2,
# 4 on 3; two epochs; a checkpoint every step.
EPOCHS = ("max_steps=0", "num_epoch=2", "num_image=96", "save_every_steps=1", "keep_checkpoints=30", "frequent=1")


@pytest.fixture(scope="module")
def epoch_runs(tmp_path_factory) -> dict[int, Path]:
    """Uninterrupted epoch-based runs on 1, 2 and 3 ranks."""
    runs = {}
    for world in (1, 2, 3):
        runs[world] = tmp_path_factory.mktemp(f"epochs{world}") / "run"
        run(world, runs[world], *EPOCHS)
    return runs


def test_resume_position_keeps_the_fraction_of_training():
    """The issue's example: 10 of 20 epochs done on 8 ranks, resumed on 4: the same epoch position and LR,
    and 10 epochs left (the old arithmetic gave LR 0.056 instead of 0.025 and 15 epochs)."""
    from trainer.run_state import TrainState, resume_position
    from utils.lr_scheduler import lr_at

    def position(step, epoch, in_epoch, saved, world, spe, max_steps=0):
        s = resume_position(TrainState(step, epoch, in_epoch), saved, world, spe * world // saved, spe, max_steps)
        return s.step, s.epoch, s.step_in_epoch

    spe8, spe4 = 1000, 2000  # steps per epoch of one dataset on 8 and 4 ranks
    step, epoch, in_epoch = position(10 * spe8, 10, 0, 8, 4, spe4)
    assert (step, epoch, in_epoch) == (10 * spe4, 10, 0)
    assert lr_at(step, 0.1, 0, 20 * spe4, power=2) == lr_at(10 * spe8, 0.1, 0, 20 * spe8, power=2)
    assert position(300, 0, 300, 8, 3, 2666) == (800, 0, 800)  # mid-epoch, samples kept
    assert position(1999, 0, 999, 2, 1, 2000) == (1998, 0, 1998)
    assert position(5, 0, 5, 3, 2, 7) == (7, 1, 0)  # rounded past the end: next epoch
    assert position(70, 0, 70, 2, 4, 500, max_steps=100) == (70, 0, 35)  # step-based: the step stays
    assert position(70, 3, 20, 2, 2, 500) == (70, 3, 20)  # same world: unchanged


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("saved_world,stop_step,world", [(2, 4, 1), (1, 14, 2), (3, 3, 2)])
def test_epoch_schedule_continues_on_another_world_size(epoch_runs, tmp_path, saved_world, stop_step, world):
    """Stopped after ``stop_step`` steps on ``saved_world`` ranks, resumed on ``world``: every later step has
    the LR an uninterrupted ``world``-rank run has at that step, and the run ends after the two epochs."""
    output = copy_checkpoints_until(epoch_runs[saved_world], tmp_path / "resumed", step=stop_step)
    proc = run(world, output, *EPOCHS)
    assert f"world size changed {saved_world} -> {world}" in proc.stdout, proc.stdout[-3000:]
    want, got = logged_lrs(epoch_runs[world]), logged_lrs(output)
    total = max(want)
    assert max(got) == total and all(t == total for t, _ in got.values()), (sorted(got), total)
    first = min(got)
    assert sorted(got) == list(range(first, total + 1)), sorted(got)
    assert {s: got[s] for s in got} == {s: want[s] for s in got}, (got, want)
    # Resumed where the samples consumed put it: the same fraction of the two epochs.
    assert abs((first - 1) / total - stop_step / max(logged_lrs(epoch_runs[saved_world]))) <= 1 / total


# ------------------------------------------------------------------------------------ extended, then moved
# Issue 45: a run made longer with --resume, then continued on another number of ranks, went back to the
# configured curve (20 -> 30 steps: step 21 at 0.0333 instead of 0.0275); its continued schedule must carry over.
EXTENDED = ("save_every_steps=5", "keep_checkpoints=10", "frequent=1")


@pytest.fixture(scope="module")
def extended_run(tmp_path_factory) -> Path:
    """20 steps on 1 rank, resumed at step 10 with max_steps = 30 and trained to the end: the single-process
    curve of an extended run."""
    output = tmp_path_factory.mktemp("extended") / "run"
    train_here(CONFIG, output, "max_steps=20", *EXTENDED)
    for step in (15, 20):
        shutil.rmtree(step_dir(output, step))
    proc = train_here(CONFIG, output, "max_steps=30", *EXTENDED, "--resume")
    assert "goes on from" in proc.stdout, proc.stdout[-3000:]
    return output


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_an_extended_run_moved_to_more_ranks_keeps_its_continued_schedule(extended_run, tmp_path, world):
    output = copy_checkpoints_until(extended_run, tmp_path / "moved", step=20)
    proc = train(CONFIG, output, "max_steps=30", *EXTENDED, nproc=world)
    assert f"world size changed 1 -> {world}" in proc.stdout and "at step 20" in proc.stdout, proc.stdout[-3000:]
    single, moved = logged_lrs(extended_run), logged_lrs(output)
    assert sorted(moved) == list(range(21, 31)), sorted(moved)
    assert {s: moved[s] for s in moved} == {s: single[s] for s in moved}, (moved, single)
    assert float(moved[21][1]) < float(single[20][1])  # continuous: on down from step 20's, not back up


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_extended_epoch_run_moved_to_two_ranks_follows_the_curve_at_the_same_fraction(tmp_path):
    """Epochs of 96 images: 12 steps on 1 rank, 6 on 2. Two epochs, made four at step 12 (the continued curve
    anchored there), then moved to 2 ranks at step 24: the step and the anchor are recounted (12, 6), and each
    2-rank step k has the LR of 1-rank step 2k."""
    epochs = ("max_steps=0", "num_image=96", "save_every_steps=0", "keep_checkpoints=10", "frequent=1")
    single = tmp_path / "single"
    train_here(CONFIG, single, *epochs, "num_epoch=2")
    shutil.rmtree(step_dir(single, 24))
    train_here(CONFIG, single, *epochs, "num_epoch=4", "--resume")
    output = copy_checkpoints_until(single, tmp_path / "moved", step=24)
    proc = train(CONFIG, output, *epochs, "num_epoch=4", nproc=2)
    assert "world size changed 1 -> 2" in proc.stdout and "at step 12" in proc.stdout, proc.stdout[-3000:]
    one, two = logged_lrs(single), logged_lrs(output)
    assert sorted(two) == list(range(13, 25)), sorted(two)
    # The line of step k reports the LR of 0-based step k - 1: 2-rank step k - 1 is 1-rank step 2k - 2.
    assert {k: two[k][1] for k in two} == {k: one[2 * k - 1][1] for k in two}, (two, one)
