"""What the trainer saves and how a run resumes, over ``utils.checkpoint``'s format (atomic step folders, the
manifest, the common part, one head shard and RNG state per rank, ``model.pt`` + ``model.json``)."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from partial_fc import head_shard, load_head_rows, restore_head
from eval.model_card import MODEL_CARD, model_card, write_model_card
from utils.checkpoint import (TrainState, archive, check_continuation, checkpoint_root, clean_partial,
                              load_common, load_optimizer_state, load_rng, make_common, plan_start,
                              recover_replaced, resume_position, save_checkpoint, set_rng_state, train_state_of)
from utils.distributed import barrier
from utils.files import save_atomic


class Trainer(Protocol):
    """What ``save_training_state`` and ``restore_training_state`` use of the trainer's ``Job``."""

    cfg: Any
    derived: Any  # utils.config.Derived: warmup_steps, total_steps
    rank: int
    world_size: int
    backbone: torch.nn.Module
    opt_backbone: torch.optim.Optimizer
    head: Any  # partial_fc.PartialFC: weight (num_local, K·D), class_start, num_local
    opt_head: torch.optim.Optimizer
    scaler: Any  # utils.precision.LossScaler
    output: Path
    fingerprint: str
    data_identity: str


def save_run(job: Trainer, state: TrainState, logger: logging.Logger) -> None:
    """What the trainer saves (every rank calls it): with ``save_all_states`` a step checkpoint, then, on rank 0,
    ``model.pt`` (the plain backbone's state_dict in the official layout, loadable by arcface_torch) and
    ``model.json`` beside it (``model_card``); each written atomically."""
    if job.cfg.save_all_states:
        path = save_training_state(job, state)
        logger.info("checkpoint %s (step %d; next: epoch %d, step %d in epoch)", path, state.step, state.epoch,
                    state.step_in_epoch)
    if job.rank == 0:
        # CPU tensors: a plain torch.load of model.pt on a machine without the GPU it was trained on works too.
        save_atomic({k: v.detach().cpu() for k, v in job.backbone.state_dict().items()}, job.output / "model.pt")
        write_model_card(job.output / MODEL_CARD, model_card(job.cfg.network, job.cfg.network_kwargs,
                                                             job.cfg.embedding_size, fingerprint=job.fingerprint,
                                                             step=int(state.step)))


def resume(job: Trainer, steps_per_epoch: int, logger: logging.Logger) -> TrainState:
    """Decide where the run starts (``plan_start``, ``check_continuation``), clean partial saves and archive or
    refuse what the run does not continue (rank 0 changes the folder, after every rank has looked at it),
    restore the chosen checkpoint. The state to start from (step 0 when there is none)."""
    cfg, explicit = job.cfg, bool(job.cfg.resume)

    if job.rank == 0:
        recover_replaced(job.output)
    barrier()  # a checkpoint a stopped save moved aside is back under its name before anyone looks
    start, foreign = plan_start(job.output, cfg.resume, cfg.auto_resume,
                                lambda path: load_common(path, mmap=True)["fingerprint"] == job.fingerprint)
    if foreign and not cfg.archive_checkpoints:
        if start is None and cfg.auto_resume and not explicit:  # name what differs: load the newest one's config
            check_continuation(foreign[-1], load_common(foreign[-1], mmap=True), cfg.to_dict(), job.fingerprint,
                               job.data_identity, explicit=False)
        raise ValueError(f"{checkpoint_root(job.output)} holds checkpoints this run would not continue ("
                         f"{', '.join(p.name for p in foreign)}); it would delete or shadow them: use another "
                         f"`output`, resume=PATH of the one to continue, or archive_checkpoints=True to move them "
                         f"aside")
    warning = None
    if start is not None:
        warning = check_continuation(start, load_common(start, mmap=True), cfg.to_dict(), job.fingerprint,
                                     job.data_identity, explicit)
    barrier()  # every rank has looked at the folder before rank 0 changes it
    if job.rank == 0:
        clean_partial(job.output)
        if foreign:
            logger.warning("moved %s to %s (archive_checkpoints)", ", ".join(p.name for p in foreign),
                           archive(job.output, foreign))
    barrier()
    if start is None:
        return TrainState()
    state, saved_world = restore_training_state(job, start, steps_per_epoch)
    if warning:
        state, rule = continue_schedule(job, state, load_common(start, mmap=True))
        logger.warning("%s%s", warning, rule)
    if saved_world != job.world_size:
        logger.info("world size changed %d -> %d: head re-partitioned, random streams re-seeded", saved_world,
                    job.world_size)
    logger.info("resumed from %s at step %d (epoch %d, step %d in epoch)", start, state.step, state.epoch,
                state.step_in_epoch)
    return state


SCHEDULE_KEYS = ("lr", "max_steps", "num_epoch", "warmup_epoch", "lr_power")


def continue_schedule(job: Trainer, state: TrainState, common: dict[str, Any]) -> tuple[TrainState, str]:
    """The state of a run resumed with a changed schedule key, and the rule it follows, for the warning.

    Past the new warm-up, the learning rate does not restart the new curve at the resume step: it goes on from
    the one the saved run had reached (times new lr / old lr when ``lr`` changed) and decays to zero at the new
    end with the new power (``utils.lr_scheduler.continued_lr``); the state records where, so later resumes
    follow the same curve. Inside the new warm-up, the new schedule applies as it is."""
    cfg, d = job.cfg, job.derived
    saved = common["config"]
    if all(saved.get(key) == cfg[key] for key in SCHEDULE_KEYS) or state.step < d.warmup_steps:
        return state, ""
    lr = float(common["lr"]) * cfg.lr / float(saved["lr"]) if saved.get("lr") else float(common["lr"])
    state = replace(state, schedule_from_step=state.step, schedule_from_lr=lr)
    return state, (f"; the learning rate goes on from {lr:.6g} at step {state.step} and decays to 0 at step "
                   f"{d.total_steps} (lr_power {cfg.lr_power:g}) instead of restarting the new schedule")


def save_training_state(job: Trainer, state: TrainState) -> Path:
    """Write checkpoint ``state.step`` (every rank calls it: rank 0 the common part, each rank its head shard)."""
    common = None
    if job.rank == 0:
        common = make_common(state=state, lr=job.opt_head.param_groups[0]["lr"],
                             backbone=job.backbone.state_dict(), backbone_optimizer=job.opt_backbone.state_dict(),
                             scaler=job.scaler.state_dict(), world_size=job.world_size,
                             num_classes=job.cfg.num_classes, fingerprint=job.fingerprint, config=job.cfg.to_dict(),
                             head_buffers=dict(job.head.named_buffers()))
        common["data"] = job.data_identity  # what the data held, so that a resume can tell it changed
    head = head_shard(job.head.weight, job.opt_head.state[job.head.weight], job.head.class_start,
                      job.cfg.num_classes)
    return save_checkpoint(job.output, state.step, rank=job.rank, world_size=job.world_size, head=head,
                           common=common, keep=job.cfg.keep_checkpoints)


def restore_training_state(job: Trainer, ckpt_dir: Path, steps_per_epoch: int) -> tuple[TrainState, int]:
    """Restore what ``save_training_state`` wrote into ``job``; returns ``(state to continue from, the world
    size that wrote it)``. Head rows and their optimizer state are re-partitioned when the world size changed;
    the random streams are then re-seeded deterministically (the old per-rank streams cannot continue)."""
    common = load_common(ckpt_dir)
    job.backbone.load_state_dict(common["backbone"])
    load_optimizer_state(job.opt_backbone, common["backbone_optimizer"])
    job.scaler.load_state_dict(common["scaler"])
    rows = load_head_rows(ckpt_dir, job.head.class_start, job.head.num_local, num_classes=job.cfg.num_classes)
    restore_head(job.head.weight, job.opt_head, rows)
    # The head's buffers are the same on every rank (rank 0 saved them); checkpoints from before they were
    # saved have none, and so does a head without buffers.
    saved_buffers, buffers = common.get("head_buffers", {}), dict(job.head.named_buffers())
    if set(saved_buffers) != set(buffers):
        raise ValueError(f"{ckpt_dir}: the checkpoint holds head buffers {sorted(saved_buffers)}, this run's head has "
                         f"{sorted(buffers)}; was the margin changed?")
    with torch.no_grad():
        for name, value in saved_buffers.items():
            buffers[name].copy_(value)
    saved_world = common["world_size"]
    rng = load_rng(ckpt_dir, job.rank)
    if saved_world == job.world_size and rng is not None:
        set_rng_state(rng)
    else:
        torch.manual_seed(job.cfg.seed + 1_000_003 * common["step"] + job.rank)
    saved = common["config"]
    saved_per_step = saved["batch_size"] * saved_world * saved["gradient_acc"]
    per_step = job.cfg.batch_size * job.world_size * job.cfg.gradient_acc
    return resume_position(train_state_of(common), saved_per_step, per_step, steps_per_epoch, job.cfg.max_steps), \
        saved_world
