"""Resume on another world size with the real trainer: 2 -> 3 and 3 -> 2 ranks. The gathered head (weights and
optimizer state) equals the saved one and training continues to the end.

tests/test_train.py covers 2 -> 1 and 2 -> 3 for the head and a 2 -> 3 continuation from early in an epoch;
here the 2 -> 3 continuation starts late in an epoch (past the 3-rank epoch's length) and the 3-rank run's
checkpoints are resumed on 2 ranks.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _dist import run_distributed
from _launch import copy_checkpoints_until, gathered_head_after_resume, logged_losses, saved_head, train
from _reliability import CONFIG, REFERENCE
from utils.checkpoint import find_latest, step_dir


@pytest.fixture(scope="module")
def three_rank_run(reference_run, tmp_path_factory) -> Path:
    """The 2-rank reference's checkpoint at step 15 (epoch 0, 15 of 16 steps done) continued on 3 ranks."""
    output = copy_checkpoints_until(reference_run, tmp_path_factory.mktemp("three") / "run", step=15)
    proc = train(CONFIG, output, *REFERENCE, nproc=3)
    assert "world size changed 2 -> 3" in proc.stdout, proc.stdout[-3000:]
    return output


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
    step, weight, state = run_distributed(gathered_head_after_resume, 2, CONFIG, REFERENCE, str(ckpt), str(tmp_path),
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
