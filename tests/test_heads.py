"""The head variants through the configuration, the checkpoints and train.py: AdaFace (`margin = "adaface"`),
sub-centres (`sub_centers`), arcface_torch's update of every row (`head_update = "all"`).

Their numerics against single-process references are in test_losses.py, test_partial_fc.py and
test_op_counts.py; here: the keys' rules and fingerprint, AdaFace's statistics in checkpoints, a 2-rank torchrun
run with all three, its resume (same losses and weights as the uninterrupted run) and its head re-partitioned
onto 3 ranks.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import (
    CONFIG,
    ROOT,
    copy_checkpoints_until,
    gather,
    load_model,
    logged_losses,
    max_difference,
    on_ranks,
    saved_head,
    tiny_job,
    train,
)
from trainer.build import build
from trainer.checkpointing import restore_training_state, save_run
from trainer.run_state import TrainState
from utils.checkpoint import load_common, step_dir
from utils.config import FINGERPRINT_EXCLUDED, fingerprint, load_config

NEW_KEYS = ("margin", "adaface_m", "adaface_h", "adaface_t_alpha", "sub_centers", "head_update")
# AdaFace with a quick EMA (its statistics move visibly in a few steps), 2 centres per class, every row updated.
RUN = ("margin=adaface", "margin_gradient=exact", "adaface_t_alpha=0.2", "sub_centers=2", "head_update=all",
       "max_steps=6", "save_every_steps=3", "keep_checkpoints=10", "frequent=1")
BUFFERS = ("margin_loss.batch_mean", "margin_loss.batch_std")


# ---------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("override, message", [
    ("margin=sphereface", "margin = 'sphereface' is not allowed; expected 'combined' (margin_list) or 'adaface'"),
    ("adaface_m=-0.1", "adaface_m = -0.1 is not allowed; expected a finite value >= 0"),
    ("adaface_h=nan", "adaface_h = nan is not allowed"),
    ("adaface_t_alpha=0", "adaface_t_alpha = 0.0 is not allowed; expected in (0, 1]"),
    ("sub_centers=0", "sub_centers = 0 is not allowed; expected >= 1"),
    ("head_update=dense", "head_update = 'dense' is not allowed; expected 'sampled'"),
])
def test_new_keys_refuse_bad_values(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(CONFIG, [override])


def test_adaface_with_interclass_filtering_is_refused():
    with pytest.raises(ValueError, match="margin = 'adaface' with interclass_filtering_threshold = 0.3; inter-class "
                                         "filtering belongs to the combined margin"):
        load_config(CONFIG, ["margin=adaface", "interclass_filtering_threshold=0.3"])


def test_new_keys_enter_the_fingerprint_and_old_checkpoints_still_match():
    cfg = load_config(CONFIG)
    old = {k: v for k, v in cfg.to_dict().items() if k not in NEW_KEYS}  # a config saved before the keys existed
    assert fingerprint(cfg) == fingerprint(old)
    assert not set(NEW_KEYS) & FINGERPRINT_EXCLUDED
    changes = ["margin=adaface", "adaface_m=0.3", "adaface_h=0.5", "adaface_t_alpha=0.1", "sub_centers=3",
               "head_update=all"]
    prints = {fingerprint(load_config(CONFIG, ["margin=adaface", change])) for change in changes[1:]}
    assert len(prints | {fingerprint(load_config(CONFIG, ["margin=adaface"]))}) == len(changes)
    assert all(fingerprint(load_config(CONFIG, [change])) != fingerprint(cfg) for change in changes)


def test_demo_adaface_config_is_the_demo_with_the_adaface_margin():
    demo, ada = load_config("configs/demo_cpu").to_dict(), load_config("configs/demo_cpu_adaface").to_dict()
    differ = {k for k in demo if demo[k] != ada[k]}
    assert differ == {"margin", "adaface_m", "margin_gradient", "margin_list", "output"}, differ  # margin_list: unused
    assert (ada["margin"], ada["adaface_m"], ada["margin_gradient"]) == ("adaface", 0.2, "exact")
    assert demo["margin_list"] == (1.0, 0.0, ada["adaface_m"])  # q = 0 is exactly the demo's CosFace


# ---------------------------------------------------------------------------------------- checkpoints
def _adaface_job(tmp_path: Path, margin: nn.Module):
    from partial_fc import PartialFC

    torch.manual_seed(0)
    job = tiny_job(0, 1, ["num_classes=12", "sample_rate=0.5"], nn.Linear(4, 8), PartialFC(margin, 8, 12, 0.5))
    job.output = tmp_path
    return job


def test_checkpoint_saves_and_restores_the_head_buffers(tmp_path):
    from losses import AdaFace, CosFace

    job = _adaface_job(tmp_path, AdaFace(s=8.0, t_alpha=0.5))
    job.head(job.backbone(torch.randn(6, 4)), torch.arange(6)).backward()  # the statistics move
    saved = {k: v.clone() for k, v in job.head.named_buffers()}
    path = save_run(job, TrainState(step=1), logging.getLogger("test"))
    assert {k: v.tolist() for k, v in load_common(path)["head_buffers"].items()} == {
        k: v.tolist() for k, v in saved.items()}
    assert saved["margin_loss.batch_mean"].item() != 20.0
    fresh = _adaface_job(tmp_path, AdaFace(s=8.0, t_alpha=0.5))
    restore_training_state(fresh, path, 10)
    assert all(torch.equal(v, saved[k]) for k, v in fresh.head.named_buffers())
    with pytest.raises(ValueError, match=r"holds head buffers \['margin_loss.batch_mean', 'margin_loss.batch_std'\], "
                                         r"this run's head has \[\]; was the margin changed\?"):
        restore_training_state(_adaface_job(tmp_path, CosFace(s=8.0)), path, 10)


# ---------------------------------------------------------------------------------------- train.py
@pytest.fixture(scope="module")
def adaface_run(tmp_path_factory) -> Path:
    """A 2-rank torchrun run of the debug config with AdaFace, 2 sub-centres and head_update = "all"."""
    output = tmp_path_factory.mktemp("heads") / "run"
    train(CONFIG, output, *RUN, nproc=2)
    return output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adaface_sub_centers_update_all_train_through_torchrun(adaface_run):
    from backbones import get_model

    losses = logged_losses(adaface_run)
    assert sorted(losses) == list(range(1, 7)) and all(0 < float(v) < 100 for v in losses.values()), losses
    ckpt = step_dir(adaface_run, 6)
    weight, state = saved_head(ckpt)
    assert weight.shape == (64, 2 * 32) and state["momentum_buffer"].shape == (64, 2 * 32)
    buffers = load_common(ckpt)["head_buffers"]
    assert sorted(buffers) == list(BUFFERS)
    assert buffers["margin_loss.batch_mean"].item() != 20.0 and buffers["margin_loss.batch_std"].item() != 100.0
    get_model("tiny", num_features=32, widths=(8, 16, 16, 32)).load_state_dict(load_model(adaface_run), strict=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adaface_run_resumes_with_the_same_losses_statistics_and_weights(adaface_run, tmp_path):
    output = copy_checkpoints_until(adaface_run, tmp_path / "resumed", step=3)
    proc = train(CONFIG, output, *RUN, "resume=true", nproc=2)
    assert "resumed from" in proc.stdout
    want, got = logged_losses(adaface_run), logged_losses(output)
    assert sorted(got) == [4, 5, 6] and {s: want[s] for s in got} == got, (got, want)
    assert max_difference(load_model(adaface_run), load_model(output)) <= 1e-6
    for name, value in load_common(step_dir(adaface_run, 6))["head_buffers"].items():
        assert torch.equal(load_common(step_dir(output, 6))["head_buffers"][name], value), name


def _restored_on_ranks(rank: int, world_size: int, ckpt: str, output: str):
    """Build the trainer with RUN on this world size, restore `ckpt`; the gathered head and every rank's buffers."""
    cfg = load_config(CONFIG, [*RUN, f"output={output}"])
    job = build(cfg, rank, world_size, torch.device("cpu"), logging.getLogger("test"))
    restore_training_state(job, Path(ckpt), job.derived.steps_per_epoch)
    weight = torch.cat(gather(job.head.weight.detach()))  # (C, K·D)
    state = {k: torch.cat(gather(v)) for k, v in sorted(job.opt_head.state[job.head.weight].items())}
    return weight, state, {k: v.clone() for k, v in job.head.named_buffers()}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sub_center_head_and_adaface_statistics_repartition_onto_three_ranks(adaface_run, tmp_path):
    ckpt = step_dir(adaface_run, 3)
    results = on_ranks(_restored_on_ranks, 3, str(ckpt), str(tmp_path))
    want_weight, want_state = saved_head(ckpt)
    want_buffers = load_common(ckpt)["head_buffers"]
    weight, state, _ = results[0]
    assert torch.equal(weight, want_weight)
    assert state.keys() == want_state.keys() and all(torch.equal(state[k], want_state[k]) for k in state)
    for _, _, buffers in results:  # every rank holds the saved statistics
        assert buffers.keys() == want_buffers.keys() and all(torch.equal(buffers[k], want_buffers[k]) for k in buffers)


def test_docs_document_the_head_keys():
    page = (ROOT / "docs" / "partial_fc.md").read_text()
    section = page[:page.index("## Precision")]
    for phrase in ('margin = "adaface"', "sub_centers", 'head_update = "all"', "configs/demo_cpu_adaface.py"):
        assert phrase in section, phrase
