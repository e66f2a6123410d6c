"""The run checkpoint: its one writer, and how a run starts from what its folder holds.

``write_run`` is the only code that writes a run's checkpoint, for the trainer (``save_run``) and the
arcface_torch import alike: the common part (``make_common``: backbone, its optimizer, loss scale, the
``TrainState``, the LR, world size, config and its fingerprint, the data's identity, the head's buffers), this
rank's head shard and random streams in a step folder of ``utils.checkpoint``, then ``model.pt`` and
``model.json`` (``eval.model_card``). ``resume`` decides where a run starts (``plan_start``,
``trainer.run_state.check_continuation``), tidies or archives the folder and restores the chosen checkpoint on
any world size (``restore_training_state``). docs/checkpoints.md is the user's side.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch

from dataset import legacy_data_identity
from eval.model_card import MODEL_CARD, model_card, write_model_card
from partial_fc import head_shard, load_head_rows, restore_head
from trainer.run_state import (
    Schedule,
    TrainState,
    check_continuation,
    continue_schedule,
    resume_position,
    rng_seed,
    schedule_of,
    step_lr,
    train_state_of,
)
from utils.checkpoint import (
    FORMAT_VERSION,
    checkpoint_root,
    clean_partial,
    find_latest,
    list_checkpoints,
    load_common,
    load_optimizer_state,
    load_rng,
    recover_replaced,
    save_checkpoint,
    set_rng_state,
    step_of,
)
from utils.config import fingerprint, redacted
from utils.distributed import barrier
from utils.files import fsync_dir, save_atomic

# What the trainer's common part holds (and a checkpoint must hold to be resumed).
COMMON_KEYS = ("format", "step", "lr", "backbone", "backbone_optimizer", "scaler", "world_size", "num_classes",
               "fingerprint", "config")


# ------------------------------------------------------------------------------------------------ writing

def make_common(*, state: TrainState, schedule: Schedule, backbone: Mapping[str, torch.Tensor],
                backbone_optimizer: Mapping[str, Any], scaler: Mapping[str, Any], world_size: int,
                num_classes: int, fingerprint: str, config: Mapping[str, Any], data: str,
                head_buffers: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The rank-0 part of a run checkpoint as an explicit dict.

    ``backbone``: the unwrapped module's state_dict (no DDP ``module.`` prefix). ``backbone_optimizer`` and
    ``scaler``: their ``state_dict()``. ``lr`` and ``last_lr``: the LR of step ``state.step`` and of the step
    before on ``schedule`` and the state's anchor (``trainer.run_state`` says why both). ``config``: saved
    without its secret keys (``redacted``). ``data``: ``utils.config.data_identity``, so that a resume can
    tell the data changed. ``head_buffers``: the head's ``named_buffers()``, the same on every rank (AdaFace's
    running statistics of the embedding norms).
    """
    return {
        "format": FORMAT_VERSION, "step": int(state.step), "state": asdict(state),
        "lr": step_lr(state.step, state, schedule),
        "last_lr": step_lr(state.step - 1, state, schedule) if state.step > 0 else 0.0,
        "backbone": {k: v.detach().cpu() for k, v in backbone.items()},
        "backbone_optimizer": dict(backbone_optimizer), "scaler": dict(scaler), "world_size": int(world_size),
        "num_classes": int(num_classes), "fingerprint": str(fingerprint), "config": redacted(config),
        "head_buffers": {k: v.detach().cpu() for k, v in (head_buffers or {}).items()}, "data": data,
    }


def seeded_rng(seed: int, step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s random streams seeded by ``rng_seed`` (CPU), as a checkpoint's ``rng_rank<r>.pt``."""
    return {"cpu": torch.Generator().manual_seed(rng_seed(seed, step, rank)).get_state()}


def write_run(output: Path, state: TrainState, *, rank: int, world_size: int, schedule: Schedule,
              config: Mapping[str, Any], keep: int, fingerprint: str, data: str, head: Mapping[str, Any] | None,
              backbone: Mapping[str, torch.Tensor] | None = None, backbone_optimizer: Mapping[str, Any] | None = None,
              scaler: Mapping[str, Any] | None = None, head_buffers: Mapping[str, torch.Tensor] | None = None,
              rng: Mapping[str, torch.Tensor] | None = None,
              barrier: Callable[[], None] | None = None) -> Path | None:
    """Write the run at ``state`` (every rank calls it); returns the step folder, or None without one.

    ``head``: this rank's ``partial_fc.head_shard``, or None for no step folder (``save_all_states = False``): only
    ``model.pt`` (the backbone's state_dict in the official layout, CPU tensors) and ``model.json``. ``backbone``,
    ``backbone_optimizer``, ``scaler`` (state_dicts) and ``head_buffers``: rank 0's, None elsewhere. ``rng``: this
    rank's random streams (default: this process's; ``seeded_rng`` for a converted run). ``barrier``: where the
    ranks meet. ``config`` gives ``num_classes`` and the network for ``model.json``; ``keep``: the complete step
    folders kept. Every file is written atomically.
    """
    path = None
    if head is not None:
        common = None
        if rank == 0:
            common = make_common(state=state, schedule=schedule, backbone=backbone,
                                 backbone_optimizer=backbone_optimizer, scaler=scaler, world_size=world_size,
                                 num_classes=config["num_classes"], fingerprint=fingerprint, config=config, data=data,
                                 head_buffers=head_buffers)
        path = save_checkpoint(output, state.step, rank=rank, world_size=world_size, head=head, common=common,
                               rng=rng, keep=keep, barrier=barrier)
    if rank == 0:
        save_atomic({k: v.detach().cpu() for k, v in backbone.items()}, Path(output) / "model.pt")
        write_model_card(Path(output) / MODEL_CARD, model_card(config["network"], config["network_kwargs"],
                                                               config["embedding_size"], fingerprint=fingerprint,
                                                               step=int(state.step)))
    return path


class Trainer(Protocol):
    """What ``save_run``, ``resume`` and ``restore_training_state`` use of the trainer's ``Job``."""

    cfg: Any
    derived: Any  # utils.config.Derived: warmup_steps, total_steps, steps_per_epoch
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


def save_run(job: Trainer, state: TrainState, logger: logging.Logger) -> Path | None:
    """``write_run`` with the trainer's parts (every rank calls it): a step folder when ``save_all_states``."""
    cfg, on_rank0 = job.cfg, job.rank == 0
    head = None
    if cfg.save_all_states:
        head = head_shard(job.head.weight, job.opt_head.state[job.head.weight], job.head.class_start,
                          cfg.num_classes)
    path = write_run(job.output, state, rank=job.rank, world_size=job.world_size,
                     schedule=schedule_of(cfg, job.derived), config=cfg.to_dict(), keep=cfg.keep_checkpoints,
                     fingerprint=job.fingerprint,
                     data=job.data_identity, head=head, backbone=job.backbone.state_dict() if on_rank0 else None,
                     backbone_optimizer=job.opt_backbone.state_dict() if on_rank0 else None,
                     scaler=job.scaler.state_dict() if on_rank0 else None,
                     head_buffers=dict(job.head.named_buffers()) if on_rank0 else None)
    if path is not None:
        logger.info("checkpoint %s (step %d; next: epoch %d, step %d in epoch)", path, state.step, state.epoch,
                    state.step_in_epoch)
    return path


# ------------------------------------------------------------------------------------------------ the folder

def checkpoint_due(step: int, epoch_end: bool, steps_per_epoch: int, total_steps: int, save_every_steps: int) -> bool:
    """Whether the run saves after optimizer step ``step``: at the last step, every ``save_every_steps`` steps, and
    at each epoch's end, unless epochs are shorter than ``save_every_steps`` (a small dataset's epochs of a few
    steps would write a checkpoint each)."""
    if step == total_steps or (save_every_steps and step % save_every_steps == 0):
        return True
    return epoch_end and not (save_every_steps and steps_per_epoch < save_every_steps)


def plan_start(output: str | os.PathLike, resume: bool | str, auto_resume: bool,
               same_run: Callable[[Path], bool]) -> tuple[Path | None, list[Path]]:
    """``(checkpoint to continue from or None, complete checkpoints this run must not leave in output)``.

    A folder belongs to one run: a run never deletes (by rotation) or shadows (by being older than the
    newest) checkpoints it does not continue. Those are: every checkpoint when the run starts afresh
    (``auto_resume = False``, or auto-resume finds another config's: ``same_run`` is False), those newer than
    ``resume = PATH`` (or all of them when PATH lies elsewhere). The caller refuses to start while they
    are there, unless asked to archive them. ``resume = True`` with nothing to resume is a ``ValueError``.
    """
    existing = list_checkpoints(output)
    if isinstance(resume, str):
        start = Path(resume)
        inside = start.resolve().parent == checkpoint_root(output).resolve()
        return start, [p for p in existing if not inside or step_of(p) > step_of(start.resolve())]
    latest = existing[-1] if existing else None
    if resume and latest is None:
        foreign = sorted(Path(output).glob("checkpoint_gpu_*.pt"))
        hint = (f"; {foreign[0].name} is arcface_torch's checkpoint: continue its run with python "
                f"scripts/import_arcface.py {output} CONFIG (docs/migrating.md), or start from its backbone with "
                f"init_backbone={foreign[0]} in another `output`") if foreign else ""
        raise ValueError(f"resume = True but {checkpoint_root(output)} holds no complete checkpoint{hint}; "
                         f"check `output`, or leave resume = False to start (auto_resume continues when there is one)")
    if latest is not None and (resume or (auto_resume and same_run(latest))):
        return latest, []
    return None, existing


def archive(output: str | os.PathLike, checkpoints: list[Path]) -> Path:
    """Move ``checkpoints`` (and ``model.pt``/``model.json``, which belong to them) to
    ``<output>/archive_<time>/`` (rank 0); returns that folder."""
    target = Path(output) / f"archive_{time.strftime('%Y%m%d-%H%M%S')}"
    target.mkdir(parents=True, exist_ok=False)
    for path in checkpoints + [Path(output) / n for n in ("model.pt", "model.json") if (Path(output) / n).exists()]:
        os.replace(path, target / path.name)
    fsync_dir(target)
    fsync_dir(Path(output))
    return target


# ------------------------------------------------------------------------------------------------ resuming

def resume(job: Trainer, steps_per_epoch: int, logger: logging.Logger) -> TrainState:
    """Decide where the run starts (``plan_start``, ``check_continuation``), clean partial saves and archive or
    refuse what the run does not continue (rank 0 changes the folder, after every rank has looked at it),
    restore the chosen checkpoint. The state to start from (step 0 when there is none)."""
    cfg, explicit = job.cfg, bool(job.cfg.resume)

    if job.rank == 0:
        recover_replaced(job.output)
    barrier()  # a checkpoint a stopped save moved aside is back under its name before anyone looks
    latest = find_latest(job.output)  # a fresh run does not list the data again for a rule it cannot meet
    legacy = legacy_data_identity(cfg.rec, job.data_identity) if latest is not None else None
    if legacy is not None and load_common(latest, mmap=True).get("data") == legacy:
        # Written before the one identity-folder rule: the folder's data as that release identified it.
        job.data_identity, job.fingerprint = legacy, fingerprint(cfg, legacy)
        logger.info("%s identifies the data as releases before the identity-folder rule did (every file under "
                    "rec); this run keeps that identity", latest)
    start, foreign = plan_start(job.output, cfg.resume, cfg.auto_resume,
                                lambda path: load_common(path, mmap=True)["fingerprint"] == job.fingerprint)
    if foreign and not cfg.archive_checkpoints:
        if start is None and cfg.auto_resume and not explicit:  # name what differs: load the newest one's config
            check_continuation(foreign[-1], load_common(foreign[-1], mmap=True, keys=COMMON_KEYS), cfg.to_dict(),
                               job.fingerprint, job.data_identity, explicit=False)
        raise ValueError(f"{checkpoint_root(job.output)} holds checkpoints this run would not continue ("
                         f"{', '.join(p.name for p in foreign)}); it would delete or shadow them: use another "
                         f"`output`, resume=PATH of the one to continue, or archive_checkpoints=True to move them "
                         f"aside")
    warning = None
    if start is not None:
        warning = check_continuation(start, load_common(start, mmap=True, keys=COMMON_KEYS), cfg.to_dict(),
                                     job.fingerprint, job.data_identity, explicit)
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
        state, rule = continue_schedule(state, load_common(start, mmap=True), cfg,
                                        schedule_of(cfg, job.derived))
        logger.warning("%s%s", warning, rule)
    if saved_world != job.world_size:
        logger.info("world size changed %d -> %d: head re-partitioned, random streams re-seeded", saved_world,
                    job.world_size)
    logger.info("resumed from %s at step %d (epoch %d, step %d in epoch)", start, state.step, state.epoch,
                state.step_in_epoch)
    return state


def restore_training_state(job: Trainer, ckpt_dir: Path, steps_per_epoch: int) -> tuple[TrainState, int]:
    """Restore what ``write_run`` wrote into ``job``; returns ``(state to continue from, the world size that
    wrote it)``. Head rows and their optimizer state are re-partitioned when the world size changed; the random
    streams are then re-seeded by ``rng_seed`` (the old per-rank streams cannot continue)."""
    common = load_common(ckpt_dir, keys=COMMON_KEYS)
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
        torch.manual_seed(rng_seed(job.cfg.seed, common["step"], job.rank))
    saved = common["config"]
    saved_per_step = saved["batch_size"] * saved_world * saved["gradient_acc"]
    per_step = job.cfg.batch_size * job.world_size * job.cfg.gradient_acc
    state = resume_position(train_state_of(common), saved_per_step, per_step, saved["num_image"] // saved_per_step,
                            steps_per_epoch, job.cfg.max_steps)
    return state, saved_world
