"""Non-finite loss: a NaN step changes nothing (weights, buffers, both optimizers' state); N in a row stop the
job with NonFiniteLossError and the newest checkpoint holds the last good weights."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import train
from trainer.run_state import TrainState
from utils.checkpoint import find_latest, load_common, step_dir


def snapshot(job) -> dict[str, torch.Tensor]:
    """Every number a skipped step must leave alone, cloned."""
    out = {f"model.{k}": v.detach().clone() for k, v in job.backbone.state_dict().items()}
    out["head.weight"] = job.head.weight.detach().clone()
    for name, opt in (("opt_backbone", job.opt_backbone), ("opt_head", job.opt_head)):
        for i, state in enumerate(opt.state.values()):
            for k, v in state.items():
                out[f"{name}.{i}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


@pytest.mark.timeout(120)
def test_a_nan_step_is_skipped_without_touching_anything(tmp_path):
    from train import optimizer_step
    from trainer.build import build
    from utils.config import load_config

    cfg = load_config("configs/debug_cpu", [f"output={tmp_path}", "max_nonfinite_steps=3"])
    job = build(cfg, 0, 1, torch.device("cpu"), logging.getLogger("test"))
    state = TrainState()
    job.loader.set_epoch(0)
    batches = iter(job.loader)
    images, labels = next(batches)  # (8, 3, 112, 112), (8,)
    assert torch.isfinite(optimizer_step(job, state, [(images, labels)]))
    state.step += 1  # momentum buffers now exist: there is optimizer state to protect
    before = snapshot(job)
    nan_images = torch.full_like(images, float("nan"))
    loss = optimizer_step(job, state, [(nan_images, labels)])
    after = snapshot(job)
    assert loss is None and state.nonfinite_in_row == 1 and state.skipped_steps == 1
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [], f"a skipped step changed {changed}"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_non_finite_steps_in_a_row_stop_the_job_and_keep_the_last_good_weights(tmp_path):
    # lr=1e30: the first update is finite but leaves weights so large that every later loss is NaN.
    output = tmp_path / "out"
    proc = train("configs/debug_cpu", output, "lr=1e30", "save_every_steps=1", "keep_checkpoints=10",
                 "max_nonfinite_steps=2", "frequent=1", check=False, timeout=140)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    stop = "ERROR the loss or the gradients were not finite for 2 optimizer steps in a row"
    assert stop in proc.stderr and stop in (output / "training.log").read_text(), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "step 1: non-finite loss, backbone gradients, head gradients (loss nan); update of backbone and head " \
           "skipped (1 in a row, stop at 2)" in proc.stdout, proc.stdout[-3000:]
    assert find_latest(output) == step_dir(output, 2)
    good, latest = load_common(step_dir(output, 1))["backbone"], load_common(step_dir(output, 2))["backbone"]
    assert all(torch.isfinite(v).all() for v in latest.values() if v.is_floating_point())
    changed = [k for k in good if not torch.equal(good[k], latest[k])]
    assert changed == [], f"the skipped step 2 changed {changed}"
