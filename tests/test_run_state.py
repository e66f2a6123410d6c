"""trainer.run_state and the common part trainer.checkpointing writes: the state, the LR a checkpoint records
and the curve a resume continues, the position on another world size, and what a changed config may do.

The runs that prove the same through train.py: tests/reliability/test_day_two.py (extended runs) and
tests/reliability/test_world_size_change.py (extended, then moved to 2 and 3 ranks)."""
from __future__ import annotations

import re
from dataclasses import asdict, fields

import pytest
import torch

from trainer.checkpointing import make_common, plan_start
from trainer.run_state import (
    FIXED_KEYS,
    Schedule,
    TrainState,
    check_continuation,
    continue_schedule,
    continued_lr,
    resume_position,
    step_lr,
    train_state_of,
)
from utils.checkpoint import save_checkpoint, step_dir
from utils.config import FINGERPRINT_LEGACY, load_config
from utils.lr_scheduler import lr_at

SCHEDULE = Schedule(base_lr=0.1, warmup_steps=0, total_steps=20, power=1.0)  # configs/debug_cpu, 20 steps
CONFIG = load_config("configs/debug_cpu", ["max_steps=20"]).to_dict()


def _common(state: TrainState, schedule: Schedule = SCHEDULE, config: dict = CONFIG) -> dict:
    model = torch.nn.Linear(2, 2)
    return make_common(state=state, schedule=schedule, backbone=model.state_dict(), backbone_optimizer={},
                       scaler={}, world_size=1, num_classes=4, fingerprint="f" * 16, config=config, data="synthetic")


# ------------------------------------------------------------------------------------------------ the LR

def test_continued_lr_goes_on_from_the_reached_lr_to_zero_at_the_new_end():
    assert continued_lr(10, 10, 0.05, 30) == 0.05
    assert continued_lr(20, 10, 0.05, 30) == pytest.approx(0.025)
    assert continued_lr(20, 10, 0.05, 30, power=2) == pytest.approx(0.0125)
    assert continued_lr(30, 10, 0.05, 30) == 0.0 and continued_lr(31, 10, 0.05, 30) == 0.0
    with pytest.raises(ValueError, match="before the step the schedule changed at"):
        continued_lr(9, 10, 0.05, 30)


def test_a_checkpoint_records_the_lr_of_its_step_and_of_the_step_before():
    common = _common(TrainState(step=10))
    assert common["lr"] == lr_at(10, 0.1, 0, 20) == pytest.approx(0.05)  # what step 10, the next one, uses
    assert common["last_lr"] == lr_at(9, 0.1, 0, 20)
    continued = TrainState(step=25, schedule_from_step=10, schedule_from_lr=0.05)  # on a continued curve
    common = _common(continued, Schedule(0.1, 0, 30, 1.0))
    assert common["lr"] == continued_lr(25, 10, 0.05, 30) and common["last_lr"] == continued_lr(24, 10, 0.05, 30)
    assert _common(TrainState(step=20))["lr"] == 0.0  # the curve ended: the next step would train at 0


def _extended(common: dict, state: TrainState, max_steps: int, **changes) -> tuple[TrainState, str]:
    config = {**CONFIG, "max_steps": max_steps, **changes}
    schedule = Schedule(config["lr"], 0, max_steps, config["lr_power"])
    return continue_schedule(state, common, config, schedule)


def test_an_extended_run_uses_the_saved_curve_s_lr_at_its_step_with_no_step_repeated():
    """The issue's defect: the LR of step 9 was stored, then used again for step 10."""
    state = TrainState(step=10)
    extended, rule = _extended(_common(state), state, 30)
    lrs = [step_lr(s, extended, Schedule(0.1, 0, 30, 1.0)) for s in range(10, 31)]
    assert lrs[0] == lr_at(10, 0.1, 0, 20)  # step 10: the saved curve's value for step 10
    assert lrs[0] != lr_at(9, 0.1, 0, 20) and all(a > b for a, b in zip(lrs, lrs[1:-1]))
    assert lrs[-1] == 0.0 and "goes on from 0.05 at step 10 and decays to 0 at step 30" in rule
    scaled, _ = _extended(_common(state), state, 30, lr=0.01)  # a new lr scales the curve
    assert step_lr(10, scaled, Schedule(0.01, 0, 30, 1.0)) == pytest.approx(0.005)


def test_a_finished_run_made_longer_goes_on_from_its_last_step_s_lr():
    state = TrainState(step=20)
    extended, rule = _extended(_common(state), state, 30)
    last = lr_at(19, 0.1, 0, 20)
    assert (extended.schedule_from_step, extended.schedule_from_lr) == (19, last)
    assert 0 < step_lr(20, extended, Schedule(0.1, 0, 30, 1.0)) < last  # no step repeated, not 0
    assert f"goes on from {last:.6g} at step 19" in rule


def test_a_checkpoint_written_before_last_lr_holds_the_step_before_s_lr():
    """Such a checkpoint's ``lr`` was the last step's: the continued curve passes through it one step earlier."""
    state = TrainState(step=10)
    old = {k: v for k, v in _common(state).items() if k != "last_lr"}
    old["lr"] = lr_at(9, 0.1, 0, 20)
    extended, _ = _extended(old, state, 30)
    assert (extended.schedule_from_step, extended.schedule_from_lr) == (9, lr_at(9, 0.1, 0, 20))
    assert step_lr(10, extended, Schedule(0.1, 0, 30, 1.0)) < lr_at(9, 0.1, 0, 20)


def test_an_unchanged_schedule_or_a_step_inside_the_new_warm_up_keeps_the_state():
    state = TrainState(step=10)
    assert continue_schedule(state, _common(state), CONFIG, SCHEDULE) == (state, "")
    config = {**CONFIG, "max_steps": 30, "warmup_epoch": 1}
    assert continue_schedule(state, _common(state), config, Schedule(0.1, 12, 30, 1.0)) == (state, "")


# ------------------------------------------------------------------------------------------------ position

def test_resume_position_carries_every_field_of_the_state():
    """Issue 45: a resume on another world size rebuilt the state from the position alone, dropping the
    continued schedule's anchor (the LR jumped back to the configured curve) and the count of non-finite steps."""
    state = TrainState(step=20, epoch=1, step_in_epoch=4, nonfinite_in_row=2, skipped_steps=3,
                       schedule_from_step=10, schedule_from_lr=0.05)
    for max_steps, saved_spe in ((30, 16), (0, 16)):  # step-based and epoch-based
        moved = resume_position(state, 8, 16, saved_spe, 8, max_steps)
        kept = {f.name for f in fields(TrainState)} - {"step", "epoch", "step_in_epoch", "schedule_from_step"}
        assert {k: asdict(moved)[k] for k in kept} == {k: asdict(state)[k] for k in kept}, moved
    assert resume_position(state, 8, 16, 16, 8, 30).schedule_from_step == 10  # step-based: steps unchanged


def test_an_epoch_based_anchor_moves_with_the_step():
    """96 images: 12 steps per epoch on 1 rank of 8, 6 on 2, 4 on 3. A curve anchored at step 14 of the 1-rank run
    (epoch 1, step 2) is anchored at step 7 on 2 ranks and at 4 + 2 * 8 // 24 = 4 on 3: the same fraction of
    training, so the LR at the resume step is the single-process curve's there."""
    state = TrainState(step=18, epoch=1, step_in_epoch=6, schedule_from_step=14, schedule_from_lr=0.05)
    two = resume_position(state, 8, 16, 12, 6, 0)
    assert (two.step, two.epoch, two.step_in_epoch, two.schedule_from_step) == (9, 1, 3, 7)
    assert continued_lr(two.step, two.schedule_from_step, 0.05, 12) == continued_lr(18, 14, 0.05, 24)
    three = resume_position(state, 8, 24, 12, 4, 0)
    assert (three.step, three.schedule_from_step) == (6, 4)


def test_state_of_a_checkpoint_written_before_the_state_entry():
    """Checkpoints of the previous layout kept the position at the top level and the skip count in the
    config; they still resume."""
    old = {"step": 30, "epoch": 1, "step_in_epoch": 14, "config": {"skipped_steps": 2}}
    assert train_state_of(old) == TrainState(step=30, epoch=1, step_in_epoch=14, skipped_steps=2)
    assert train_state_of(_common(TrainState(step=12, epoch=1, step_in_epoch=3))) == TrainState(12, 1, 3)


# ------------------------------------------------------------------------------------------------ the folder

def test_where_a_run_starts_and_what_it_must_not_leave(tmp_path):
    mine = lambda path: True  # noqa: E731 (same_run)
    assert plan_start(tmp_path, False, True, mine) == (None, [])  # auto-resume with nothing: start at step 0
    with pytest.raises(ValueError, match="resume = True but .* holds no complete checkpoint"):
        plan_start(tmp_path, True, True, mine)
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step, rank=0, world_size=1, head={}, common={"step": step, "world_size": 1},
                        barrier=lambda: None, keep=5)
    s5, s10, s15 = (step_dir(tmp_path, s) for s in (5, 10, 15))
    assert plan_start(tmp_path, False, True, mine) == (s15, [])  # the same run: continue the newest
    assert plan_start(tmp_path, False, True, lambda p: False) == (None, [s5, s10, s15])  # another config's
    assert plan_start(tmp_path, False, False, mine) == (None, [s5, s10, s15])  # auto_resume = False: afresh
    assert plan_start(tmp_path, True, False, lambda p: False) == (s15, [])  # explicit: continue it anyway
    assert plan_start(tmp_path, str(s10), True, mine) == (s10, [s15])  # step 15 would shadow the new run
    elsewhere = tmp_path / "other" / "checkpoints" / "step_000000003"
    assert plan_start(tmp_path, str(elsewhere), True, mine) == (elsewhere, [s5, s10, s15])


# ------------------------------------------------------------------------------------------------ a changed config

def _continuation(tmp_path, changes: dict, data: str = "same data") -> str | None:
    saved = load_config("configs/debug_cpu").to_dict()
    common = {"fingerprint": "a" * 16, "config": saved, "data": "same data"}
    return check_continuation(tmp_path / "checkpoints" / "step_000000004", common, {**saved, **changes}, "b" * 16,
                              data, explicit=True)


@pytest.mark.parametrize("key, value", [("network", "r18"), ("network_kwargs", {"widths": [4, 4, 4, 4]}),
                                        ("embedding_size", 64), ("num_classes", 99), ("optimizer", "adamw"),
                                        ("sub_centers", 2), ("margin", "adaface")])
def test_an_explicit_resume_refuses_what_the_saved_state_cannot_serve(tmp_path, key, value):
    reason = re.escape(FIXED_KEYS[key])
    with pytest.raises(ValueError, match=rf"{key} .* → .* cannot continue \({reason}\); .*init_backbone="):
        _continuation(tmp_path, {key: value})


def test_keys_added_since_a_checkpoint_was_written_count_at_their_old_value(tmp_path):
    # A config saved before margin, sub_centers, lr_power... existed trained with their legacy values: resuming
    # it with those values changes no key (no refusal); another value is a change like any other.
    current = {**load_config("configs/debug_cpu").to_dict(), "lr_power": 2.0}
    old = {k: v for k, v in current.items() if k not in FINGERPRINT_LEGACY}
    common = {"fingerprint": "a" * 16, "config": old, "data": "same data"}
    ckpt = tmp_path / "checkpoints" / "step_000000004"
    warning = check_continuation(ckpt, common, current, "b" * 16, "same data", explicit=True)
    assert warning.endswith("with a changed config: an older release's fingerprint"), warning  # no key named
    with pytest.raises(ValueError, match=r"margin 'combined' → 'adaface' cannot continue"):
        check_continuation(ckpt, common, {**current, "margin": "adaface"}, "b" * 16, "same data", explicit=True)


def test_an_explicit_resume_refuses_other_training_data_and_names_schedule_changes(tmp_path):
    with pytest.raises(ValueError, match=r"training data .* cannot continue \(the data position and the head's"):
        _continuation(tmp_path, {}, data="other data")
    warning = _continuation(tmp_path, {"lr": 0.01, "max_steps": 30, "batch_size": 16})
    assert warning is not None and "lr 0.1 → 0.01" in warning and "max_steps" in warning and "batch_size" in warning
