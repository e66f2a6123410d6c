"""The run's state and what it means: where a run is, which LR a step uses, what a resume may change.

Pure functions over plain values, no files: ``TrainState`` (position, skipped-step counts, the schedule's
anchor), ``step_lr`` (the one place the LR of a step comes from), ``resume_position`` (the state on another
number of images per step), the continuation rules (``FIXED_KEYS``, ``SCHEDULE_KEYS``, ``check_continuation``,
``continue_schedule``) and the random streams' rule (``rng_seed``). ``trainer.checkpointing`` writes and reads
them; what users see of them is docs/checkpoints.md.

The LR a checkpoint records (``common["lr"]``) is the LR the step ``state.step`` uses, the next step to take,
on the saved run's curve; ``common["last_lr"]`` is the LR the last step taken (``state.step - 1``) used.
Checkpoints written before ``last_lr`` existed hold in ``lr`` what ``last_lr`` means now.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from utils.config_keys import FINGERPRINT_EXCLUDED, FINGERPRINT_LEGACY, FIXED_KEYS, SCHEDULE_KEYS
from utils.lr_scheduler import lr_at


@dataclass
class TrainState:
    """Where the run is; saved in every checkpoint as its own entry (``common["state"]``).

    ``step``: optimizer steps taken (skipped non-finite steps count: their batches were consumed). The data
    position is ``(epoch, step_in_epoch)``: the next batch to read is number ``step_in_epoch`` of ``epoch``.
    ``schedule_from_step`` and ``schedule_from_lr``: the anchor of a schedule a resume changed, the step and the
    LR the continued curve passes through (``continued_lr``); -1 while the run follows its configured curve.
    """

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    nonfinite_in_row: int = 0
    skipped_steps: int = 0
    schedule_from_step: int = -1
    schedule_from_lr: float = 0.0


def train_state_of(common: Mapping[str, Any]) -> TrainState:
    """The ``TrainState`` of a checkpoint's common part (checkpoints written before it was an entry of its own
    kept the position at the top level and the skipped-step count in the config)."""
    if "state" in common:
        return TrainState(**common["state"])
    return TrainState(step=common["step"], epoch=common["epoch"], step_in_epoch=common["step_in_epoch"],
                      skipped_steps=common["config"].get("skipped_steps", 0))


# ------------------------------------------------------------------------------------------------ the LR

@dataclass(frozen=True)
class Schedule:
    """A run's configured LR curve in optimizer steps: ``utils.lr_scheduler.lr_at``'s arguments."""

    base_lr: float
    warmup_steps: int
    total_steps: int
    power: float


def schedule_of(cfg: Mapping[str, Any], derived: Any) -> Schedule:
    """The ``Schedule`` of a config and its ``utils.config.Derived`` step counts."""
    return Schedule(float(cfg["lr"]), derived.warmup_steps, derived.total_steps, float(cfg["lr_power"]))


def continued_lr(step: int, from_step: int, from_lr: float, total_steps: int, power: float = 1.0) -> float:
    """Learning rate for optimizer step ``step >= from_step`` of a run whose schedule changed at ``from_step``,
    where its learning rate was ``from_lr``: ``from_lr * (1 - (step - from_step) / (total_steps - from_step)) **
    power``, 0.0 at or past ``total_steps``."""
    if step < from_step:
        raise ValueError(f"continued_lr(step={step}) before the step the schedule changed at ({from_step})")
    if step >= total_steps:
        return 0.0
    return from_lr * (1.0 - (step - from_step) / (total_steps - from_step)) ** power


def step_lr(step: int, state: TrainState, schedule: Schedule) -> float:
    """The LR of optimizer step ``step``: the configured curve, or, once a resume changed the schedule
    (``state.schedule_from_step >= 0``), the continued one from the state's anchor to 0 at the end."""
    if state.schedule_from_step >= 0:
        return continued_lr(step, state.schedule_from_step, state.schedule_from_lr, schedule.total_steps,
                            schedule.power)
    return lr_at(step, schedule.base_lr, schedule.warmup_steps, schedule.total_steps, power=schedule.power)


def rng_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank``'s random streams when a run continues at ``step`` without its own (another world
    size, a converted arcface_torch run): distinct per rank and per step."""
    return seed + 1_000_003 * step + rank


# ------------------------------------------------------------------------------------------------ position

def resume_position(state: TrainState, saved_per_step: int, per_step: int, saved_steps_per_epoch: int,
                    steps_per_epoch: int, max_steps: int) -> TrainState:
    """Where to continue, in the new run's optimizer steps. ``saved_per_step``/``per_step``: images per optimizer
    step (batch size x world size x accumulation) of the run that saved and of this one; ``saved_steps_per_epoch``/
    ``steps_per_epoch`` their steps per epoch. With other images per step, the epoch position keeps the samples
    consumed (rounded down: a few are seen again, none skipped), and an epoch-based run (``max_steps = 0``)
    recomputes its step and schedule anchor from it, so the LR continues at the same fraction of training; a
    step-based run keeps its step and anchor. Every other field is carried over.
    """
    if saved_per_step == per_step:
        return state

    def moved(epoch: int, step_in_epoch: int) -> tuple[int, int]:
        step_in_epoch = step_in_epoch * saved_per_step // per_step
        return (epoch + 1, 0) if step_in_epoch >= steps_per_epoch else (epoch, step_in_epoch)

    epoch, step_in_epoch = moved(state.epoch, state.step_in_epoch)
    if max_steps > 0:
        return replace(state, epoch=epoch, step_in_epoch=step_in_epoch)
    anchor = state.schedule_from_step
    if anchor >= 0:
        anchor_epoch, anchor_in_epoch = moved(*divmod(anchor, saved_steps_per_epoch))
        anchor = anchor_epoch * steps_per_epoch + anchor_in_epoch
    return replace(state, step=epoch * steps_per_epoch + step_in_epoch, epoch=epoch, step_in_epoch=step_in_epoch,
                   schedule_from_step=anchor)


# ------------------------------------------------------------------------------------------------ a changed config

def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` for every key that enters the fingerprint and differs (the
    ``rec`` path aside: the data's identity stands for it). A key added after ``saved`` was written counts with
    the value that trained as the code did then (``FINGERPRINT_LEGACY``)."""

    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    saved = {**FINGERPRINT_LEGACY, **saved}
    keys = sorted((set(saved) | set(current)) - FINGERPRINT_EXCLUDED - {"rec", "skipped_steps"})
    return {k: (saved.get(k), current.get(k)) for k in keys if plain(saved.get(k)) != plain(current.get(k))}


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """``"lr 0.1 → 0.01, max_steps 20 → 30"``."""
    return ", ".join(f"{k} {old!r} → {new!r}" for k, (old, new) in changes.items())


def check_continuation(ckpt_dir: Path, common: Mapping[str, Any], config: Mapping[str, Any], fingerprint: str,
                       data: str, explicit: bool) -> str | None:
    """Whether a run may continue ``ckpt_dir``: None when it was written by the same config (same fingerprint);
    a warning naming every changed key when the resume is explicit and the saved state serves the new values;
    else ``ValueError`` naming the keys and what to do. Schedule keys (``SCHEDULE_KEYS``) continue from the
    saved step with the new values."""
    if common["fingerprint"] == fingerprint:
        return None
    changes = config_changes(common["config"], config)
    if common.get("data", data) != data:
        changes["training data"] = (f"{common['config'].get('rec')} (as it was)", f"{config.get('rec')} (other images)")
    what = describe_changes(changes) or "an older release's fingerprint"
    if not explicit:
        raise ValueError(f"{ckpt_dir.parent} holds checkpoints of another config ({what}); continue them with "
                         f"--resume (a changed lr, max_steps, num_epoch or warmup_epoch applies from their step), "
                         f"use another `output`, or set archive_checkpoints=True to move them aside and start afresh")
    for key in changes:
        if key in FIXED_KEYS or key == "training data":
            reason = FIXED_KEYS.get(key, "the data position and the head's classes are the old data's")
            raise ValueError(f"resume from {ckpt_dir}: {key} {changes[key][0]!r} → {changes[key][1]!r} cannot "
                             f"continue ({reason}); to start from its weights, train into another `output` with "
                             f"init_backbone={ckpt_dir.parent.parent / 'model.pt'}")
    return f"resuming {ckpt_dir} with a changed config: {what}"


def continue_schedule(state: TrainState, common: Mapping[str, Any], config: Mapping[str, Any],
                      schedule: Schedule) -> tuple[TrainState, str]:
    """The state of a run resumed with a changed schedule key (``config`` and its ``schedule``), and the rule it
    follows, for the warning.

    Past the new warm-up, the LR does not restart the new curve at the resume step: it goes on from the LR the
    saved run had there (times new lr / old lr when ``lr`` changed), step ``state.step``'s, and decays to zero at
    the new end with the new power (``continued_lr``). Where the saved curve had ended (a finished run made
    longer), or the checkpoint predates ``last_lr``, it goes on from the last step's LR, one step earlier. The
    state records that anchor, so later resumes follow the same curve. Inside the new warm-up, the new schedule
    applies as it is."""
    saved = common["config"]
    if all(saved.get(key) == config[key] for key in SCHEDULE_KEYS) or state.step < schedule.warmup_steps:
        return state, ""
    if "last_lr" in common and float(common["lr"]) > 0:
        at, lr = state.step, float(common["lr"])
    else:
        at, lr = max(state.step - 1, 0), float(common.get("last_lr", common["lr"]))
    if saved.get("lr"):
        lr *= float(config["lr"]) / float(saved["lr"])
    state = replace(state, schedule_from_step=at, schedule_from_lr=lr)
    return state, (f"; the learning rate goes on from {lr:.6g} at step {at} and decays to 0 at step "
                   f"{schedule.total_steps} (lr_power {schedule.power:g}) instead of restarting the new schedule")
