"""An arcface_torch run continued here: its ``checkpoint_gpu_<rank>.pt`` files become one of our run checkpoints.

``import_run`` reads the output folder of an arcface_torch ``train_v2.py`` run saved with ``save_all_states`` (one
``checkpoint_gpu_<rank>.pt`` per GPU: ``{"epoch", "global_step", "state_dict_backbone", "state_dict_softmax_fc",
"state_optimizer", "state_lr_scheduler"}``), checks it against the config of the run as it goes on here, and
writes ``<output>/checkpoints/step_<S>/``, ``model.pt`` and ``model.json`` with the trainer's own writer
(``trainer.checkpointing.write_run``), every rank's part from this one process, as if a run of that config on the
same number of ranks had saved them; ``train.py`` resumes them on any number of ranks. What is converted, what is
checked, and each error's exit status: docs/migrating.md. ``scripts/import_arcface.py`` is its command.
"""
from __future__ import annotations

import re
import threading
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from backbones import get_model
from dataset import build_dataset, data_identity
from partial_fc import PartialFC, build_optimizers, class_partition, head_shard
from trainer.build import build_margin_of
from trainer.checkpointing import archive, seeded_rng, write_run
from trainer.run_state import TrainState, schedule_of, step_lr
from utils.checkpoint import list_checkpoints, step_dir
from utils.cli import BadData
from utils.config import Config, Derived, check_paths, derive, fingerprint, load_config
from utils.files import load_state_dict, load_tensors, load_weights
from utils.precision import LossScaler

RANK_FILE = re.compile(r"^checkpoint_gpu_(\d+)\.pt$")
KEYS = ("epoch", "global_step", "state_dict_backbone", "state_dict_softmax_fc", "state_optimizer",
        "state_lr_scheduler")


# ------------------------------------------------------------------------------------------------ reading

def rank_files(folder: Path) -> list[Path]:
    """``checkpoint_gpu_0.pt`` … ``checkpoint_gpu_<W-1>.pt`` of ``folder``; ``BadData`` when one in the range is
    missing, ``ValueError`` when there is none."""
    if not folder.is_dir():
        problem = "is a file, not a folder" if folder.exists() else "not found"
        raise ValueError(f"ARCFACE_OUTPUT_DIR {folder}: {problem}")
    ranks = sorted(int(m.group(1)) for p in folder.iterdir() if (m := RANK_FILE.match(p.name)) and p.is_file())
    if not ranks:
        hint = (f" (its model.pt alone is a backbone: start from it with init_backbone={folder / 'model.pt'})"
                if (folder / "model.pt").is_file() else "")
        raise ValueError(f"{folder} holds no checkpoint_gpu_<rank>.pt: arcface_torch writes them with "
                         f"save_all_states = True{hint}")
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
    if missing:
        raise BadData(f"{folder}: {', '.join(f'checkpoint_gpu_{r}.pt' for r in missing)} missing (found ranks "
                      f"{_ranges(ranks)}); every rank of the run saved its share of the class centres")
    return [folder / f"checkpoint_gpu_{r}.pt" for r in ranks]


def _ranges(ranks: list[int]) -> str:
    """``0-2, 5`` for ``[0, 1, 2, 5]``."""
    parts, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ", ".join(parts)


@dataclass
class RankCheckpoint:
    """What one ``checkpoint_gpu_<rank>.pt`` holds, checked for the layout ``train_v2.py`` writes."""

    path: Path
    epoch: int
    global_step: int
    weight: torch.Tensor  # (num_local, D): this rank's class centres
    backbone: dict[str, torch.Tensor]  # the plain module's state_dict (a DDP "module." prefix removed)
    optimizer: dict[str, Any]  # torch's state_dict of the one optimizer over backbone + head
    scheduler: dict[str, Any]


def read_rank(path: Path) -> RankCheckpoint:
    """``path`` read with ``torch.load(weights_only=True)`` (memory-mapped when it is a zip file, as torch >= 1.6
    writes them: only what is used is read) and checked; ``BadData`` naming the file and key otherwise."""
    try:
        ckpt = load_tensors(path, mmap=zipfile.is_zipfile(path))
    except ValueError as exc:
        raise BadData(str(exc)) from None
    if not isinstance(ckpt, dict) or [k for k in KEYS if k not in ckpt]:
        held = sorted(map(str, ckpt)) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise BadData(f"{path}: holds {held}; expected arcface_torch's train_v2.py checkpoint with keys {list(KEYS)}")
    for key in ("epoch", "global_step"):
        if not isinstance(ckpt[key], int) or ckpt[key] < 0:
            raise BadData(f"{path}: {key} is {ckpt[key]!r}; expected an integer >= 0")
    fc = ckpt["state_dict_softmax_fc"]
    weight = fc.get("weight") if isinstance(fc, dict) else None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < 1:
        raise BadData(f"{path}: state_dict_softmax_fc holds {sorted(fc) if isinstance(fc, dict) else type(fc).__name__}"
                      f"; expected PartialFC_V2's {{'weight': (num_local, embedding_size)}}")
    backbone = ckpt["state_dict_backbone"]
    if not isinstance(backbone, dict) or not backbone \
            or not all(isinstance(v, torch.Tensor) for v in backbone.values()):
        raise BadData(f"{path}: state_dict_backbone is not a state_dict (a dict of tensors)")
    if all(k.startswith("module.") for k in backbone):  # saved from the DDP wrapper instead of its module
        backbone = {k[len("module."):]: v for k, v in backbone.items()}
    opt = ckpt["state_optimizer"]
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if not isinstance(groups, list) or len(groups) != 2 or len(groups[1].get("params", ())) != 1 \
            or not isinstance(opt.get("state"), dict):
        count = len(groups) if isinstance(groups, list) else "no"
        raise BadData(f"{path}: state_optimizer has {count} parameter groups; train_v2.py's optimizer has two: the "
                      f"backbone's parameters, then PartialFC_V2's weight")
    if not isinstance(ckpt["state_lr_scheduler"], dict):
        raise BadData(f"{path}: state_lr_scheduler is a {type(ckpt['state_lr_scheduler']).__name__}; expected a dict")
    return RankCheckpoint(path, ckpt["epoch"], ckpt["global_step"], weight, backbone, opt, ckpt["state_lr_scheduler"])


def check_shards(ranks: list[RankCheckpoint], cfg: Config, config: str) -> None:
    """Every rank's file from the same save; the shards in arcface_torch's partition (``PartialFC_V2``: the first
    ``C mod W`` ranks one class more, ranks in class order) of the config's ``num_classes``; one width, the
    config's ``embedding_size``."""
    first, world = ranks[0], len(ranks)
    for r in ranks[1:]:
        if (r.epoch, r.global_step) != (first.epoch, first.global_step):
            raise BadData(f"{r.path} is from epoch {r.epoch}, step {r.global_step}, {first.path.name} from epoch "
                          f"{first.epoch}, step {first.global_step}: the files are not of one save (left from "
                          f"another run?)")
    for r in ranks[1:]:
        if r.weight.shape[1] != first.weight.shape[1]:
            raise BadData(f"{r.path}: class centres of width {r.weight.shape[1]}, {first.path.name}'s have "
                          f"{first.weight.shape[1]}")
    sizes = [r.weight.shape[0] for r in ranks]
    total, shares = sum(sizes), "+".join(map(str, sizes))
    more = _missing_last_ranks(sizes, cfg.num_classes) if total != cfg.num_classes else None
    if more:
        names = f"checkpoint_gpu_{world}.pt" + (f" … checkpoint_gpu_{more - 1}.pt" if more > world + 1 else "")
        raise BadData(f"{first.path.parent}: {names} missing? ranks {_ranges(list(range(world)))} hold {shares} "
                      f"class centres, the first shares of a {more}-rank run of the config's num_classes = "
                      f"{cfg.num_classes} (if the run had {total} classes, set num_classes = {total})")
    if [class_partition(total, world, i)[1] for i in range(world)] != sizes:
        raise BadData(f"{first.path.parent}: the ranks hold {shares} = {total} class centres; arcface_torch's "
                      f"PartialFC_V2 splits {total} classes over {world} ranks as "
                      f"{'+'.join(str(class_partition(total, world, i)[1]) for i in range(world))}")
    if total != cfg.num_classes:
        raise ValueError(f"the arcface_torch run's {world} ranks hold {total} class centres ({shares}); {config} "
                         f"has num_classes = {cfg.num_classes}")
    if first.weight.shape[1] != cfg.embedding_size:
        raise ValueError(f"the arcface_torch run's class centres have width {first.weight.shape[1]}; {config} has "
                         f"embedding_size = {cfg.embedding_size}")


def _missing_last_ranks(sizes: list[int], num_classes: int) -> int | None:
    """The world size W' > len(sizes) whose first ranks' shares of ``num_classes`` are ``sizes`` (the files of the
    last ranks are missing), or None."""
    world = len(sizes)
    for candidate in range(world + 1, min(num_classes, world + 1024) + 1):
        if all(class_partition(num_classes, candidate, r)[1] == sizes[r] for r in range(world)):
            return candidate
    return None


# ------------------------------------------------------------------------------------------------ converting

@dataclass(frozen=True)
class TheirSchedule:
    """arcface_torch's schedule, in its scheduler's steps (micro-batches), from ``state_lr_scheduler``."""

    kind: str
    base_lr: float
    warmup: int
    total: int
    power: float


def their_schedule(state: Mapping[str, Any], path: Path) -> TheirSchedule:
    """arcface_torch's ``PolynomialLRWarmup`` (``warmup_iters``, ``total_iters``, ``power``: its current trainer) or
    ``PolyScheduler`` (``warmup_steps``, ``max_steps``, power 2: its earlier one)."""
    try:
        if "total_iters" in state and "warmup_iters" in state:
            return TheirSchedule("PolynomialLRWarmup", float(state["base_lrs"][0]), int(state["warmup_iters"]),
                            int(state["total_iters"]), float(state.get("power", 1.0)))
        if "max_steps" in state and "warmup_steps" in state:
            return TheirSchedule("PolyScheduler", float(state["base_lr"]), int(state["warmup_steps"]),
                            int(state["max_steps"]), float(state.get("power", 2.0)))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise BadData(f"{path}: state_lr_scheduler lacks {exc}") from None
    raise BadData(f"{path}: state_lr_scheduler holds {sorted(state)}; expected arcface_torch's PolynomialLRWarmup "
                  f"(warmup_iters, total_iters) or PolyScheduler (warmup_steps, max_steps)")


def their_optimizer(group: Mapping[str, Any]) -> str:
    """``"adamw"`` or ``"sgd"``: the optimizer class ``train_v2.py`` built, told by its param group's keys."""
    return "adamw" if "betas" in group else "sgd"


def changes(cfg: Config, derived: Derived, schedule: TheirSchedule, group: Mapping[str, Any]) -> list[str]:
    """Every way the config's LR schedule and optimizer settings differ from the arcface_torch run's, each as
    ``key here (arcface_torch: value)``. The step counts are compared in arcface_torch's scheduler steps, one per
    micro-batch (``train_v2.py`` steps its scheduler on every batch, ``num_image // (batch_size · ranks)`` per
    epoch): ours (``derived``, in optimizer steps) times ``gradient_acc``."""
    out, acc, world = [], cfg.gradient_acc, derived.world_size
    if abs(cfg.lr - schedule.base_lr) > 1e-12 * max(abs(cfg.lr), 1.0):
        out.append(f"lr {cfg.lr:g} (arcface_torch: {schedule.base_lr:g})")
    if cfg.lr_power != schedule.power:
        out.append(f"lr_power {cfg.lr_power:g} (arcface_torch's {schedule.kind}: {schedule.power:g})")
    per_epoch, total = derived.steps_per_epoch * acc, derived.total_steps * acc
    if cfg.max_steps > 0:
        how = f"max_steps {cfg.max_steps}" + (f" x gradient_acc {acc}" if acc > 1 else "")
    elif acc == 1:
        how = f"num_image {cfg.num_image} // (batch_size {cfg.batch_size} x {world} ranks) x num_epoch {cfg.num_epoch}"
    else:
        how = (f"num_image {cfg.num_image} // (batch_size {cfg.batch_size} x {world} ranks x gradient_acc {acc}) x "
               f"num_epoch {cfg.num_epoch} optimizer steps x gradient_acc {acc}")
    if total != schedule.total:
        out.append(f"total steps {total} = {how} (arcface_torch: {schedule.total})")
    warmup = per_epoch * cfg.warmup_epoch
    if warmup != max(schedule.warmup, 0):  # a recipe's warmup_epoch = -1 trains without warm-up (configs/base.py)
        out.append(f"warm-up steps {warmup} = warmup_epoch {cfg.warmup_epoch} x {per_epoch} (arcface_torch: "
                   f"{schedule.warmup})")
    if cfg.weight_decay != group.get("weight_decay"):
        out.append(f"weight_decay {cfg.weight_decay:g} (arcface_torch: {group.get('weight_decay')})")
    momentum = group["betas"][0] if "betas" in group else group.get("momentum")
    if cfg.momentum != momentum:
        out.append(f"momentum {cfg.momentum:g} (arcface_torch: {momentum})")
    if cfg.get("backbone_lr_scale", 1.0) != 1.0:
        out.append(f"backbone_lr_scale {cfg.backbone_lr_scale:g} (arcface_torch: 1, one LR for both)")
    return out


def _as_tensor_step(value: Any) -> torch.Tensor:
    """AdamW's step count as torch >= 1.12 keeps it (a float32 scalar tensor); older torch saved a number."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float32).reshape(())
    return torch.tensor(float(value))


def backbone_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, rank0: RankCheckpoint) -> dict[str, Any]:
    """Our backbone optimizer's ``state_dict()`` holding arcface_torch's state of the same parameters.

    ``train_v2.py``'s optimizer numbers the backbone's parameters in ``backbone.parameters()`` order, the order of
    the module's ``state_dict`` without its buffers; each is matched to ours by name."""
    ours = dict(model.named_parameters())
    names = [k for k in rank0.backbone if k in ours]  # arcface_torch's parameter order
    ids = rank0.optimizer["param_groups"][0]["params"]
    if len(ids) != len(names):
        raise BadData(f"{rank0.path}: the optimizer's first group holds {len(ids)} parameters, the backbone has "
                      f"{len(names)}")
    state = rank0.optimizer["state"]
    for index, name in zip(ids, names):
        saved = state.get(index)
        if not saved:  # never stepped (a parameter without gradient, e.g. the frozen `features.weight`)
            continue
        param = ours[name]
        converted = {}
        for key, value in saved.items():
            if key == "step":
                converted[key] = _as_tensor_step(value)
            elif isinstance(value, torch.Tensor):
                if value.shape != param.shape:
                    raise BadData(f"{rank0.path}: optimizer state {key!r} of {name} has shape {tuple(value.shape)}, "
                                  f"the parameter {tuple(param.shape)}")
                converted[key] = value.detach().to(torch.float32).clone()
        opt.state[param] = converted
    return opt.state_dict()


# Our head optimizer's row-wise state from torch's state of arcface_torch's head weight (dense: every row took
# every step): a key its optimizer never wrote (no step yet) stays at our optimizer's zeros.
HEAD_STATE = {
    "sgd": {"momentum_buffer": lambda saved, n: saved.get("momentum_buffer")},
    "adamw": {"exp_avg": lambda saved, n: saved.get("exp_avg"),
              "exp_avg_sq": lambda saved, n: saved.get("exp_avg_sq"),
              "step": lambda saved, n: _as_tensor_step(saved["step"]).expand(n).clone() if "step" in saved else None},
}


def head_state(rank: RankCheckpoint, template: Mapping[str, torch.Tensor], optimizer: str) -> dict[str, torch.Tensor]:
    """This rank's head optimizer state in our layout (``template``: our head optimizer's initial state for one row,
    which gives the keys, the shapes after the first dimension and the dtypes)."""
    group_ids = rank.optimizer["param_groups"][1]["params"]
    saved = rank.optimizer["state"].get(group_ids[0]) or {}
    n = rank.weight.shape[0]
    assert set(template) == set(HEAD_STATE[optimizer]), (
        f"our {optimizer} head optimizer keeps {sorted(template)}; the converter knows {sorted(HEAD_STATE[optimizer])}")
    out = {}
    for key, like in template.items():
        value = HEAD_STATE[optimizer][key](saved, n)
        shape = (n, *like.shape[1:])
        if value is None:
            value = torch.zeros(shape, dtype=like.dtype)
        elif tuple(value.shape) != shape:
            raise BadData(f"{rank.path}: the head's optimizer state {key!r} has shape {tuple(value.shape)}; expected "
                          f"{shape}")
        out[key] = value.to(like.dtype)
    return out


def filled(cfg: Config) -> Config:
    """The config as the trainer completes it (``dataset.build_data``): ``num_classes`` and ``num_image`` from the
    dataset when left None. The fingerprint a resume compares is taken from this one."""
    if cfg.num_classes is not None and cfg.num_image is not None:
        return cfg
    data = build_dataset(cfg.rec, num_classes=cfg.num_classes, seed=cfg.seed, num_images=cfg.num_image)
    return cfg.updated(num_classes=data.num_classes, num_image=len(data))


def held_runs(cfg: Config, source: Path, archive_old: bool) -> tuple[list[Path], bool]:
    """``(checkpoints, whether anything is to be archived)`` of what ``output`` holds of another run: its
    checkpoints, and a ``model.pt`` that is not this arcface_torch folder's own. Refused unless ``archive_old``."""
    output = Path(cfg.output)
    existing = list_checkpoints(output)
    other_model = (output / "model.pt").exists() and output.resolve() != source.resolve()
    if (existing or other_model) and not archive_old:
        what = ", ".join(p.name for p in existing) if existing else "model.pt"
        raise ValueError(f"output {output} already holds a run ({what}); use another `output`, or --archive to move "
                         f"it to {output}/archive_<time>/")
    return existing, bool(existing) or other_model


# ------------------------------------------------------------------------------------------------ writing

def write_all_ranks(world: int, write: Callable[..., Any]) -> None:
    """``write(rank, barrier)`` for every rank of a ``world``-rank run, in one process: one thread per rank, meeting
    at a thread barrier where the ranks of a run meet at the process group's."""
    barrier = threading.Barrier(world)
    errors: list[BaseException] = []  # in the order they happened: the first is the cause, the others follow it

    def run(rank: int) -> None:
        try:
            write(rank, barrier.wait)
        except threading.BrokenBarrierError:  # another rank failed: its error is the one to report
            pass
        except BaseException as exc:  # handed to the main thread, which raises it
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def import_run(source: Path, config: str, overrides: list[str], archive_old: bool, allow_changes: bool,
               warn: Callable[[str], None]) -> str:
    """Check everything, then write the checkpoint; returns the summary line. ``warn``: says one warning."""
    cfg = load_config(config, overrides)
    check_paths(cfg)
    cfg = filled(cfg)
    if cfg.margin != "combined" or cfg.sub_centers != 1:
        raise ValueError(f"{config} has margin = {cfg.margin!r}, sub_centers = {cfg.sub_centers}; arcface_torch's "
                         f"PartialFC_V2 trains a combined margin with one centre per class: use margin = "
                         f"'combined', sub_centers = 1")
    paths = rank_files(source)
    world = len(paths)
    ranks = [read_rank(p) for p in paths]
    check_shards(ranks, cfg, config)
    rank0 = ranks[0]
    group = rank0.optimizer["param_groups"][0]
    if their_optimizer(group) != cfg.optimizer:
        raise ValueError(f"{config} has optimizer = {cfg.optimizer!r}; the arcface_torch run trained with "
                         f"{their_optimizer(group)!r}, whose state is what the checkpoint holds")
    if rank0.global_step % cfg.gradient_acc:
        raise ValueError(f"{config} has gradient_acc = {cfg.gradient_acc}, but the arcface_torch run saved after "
                         f"{rank0.global_step} micro-batches, inside an accumulation whose gradient the checkpoint "
                         f"does not hold; set gradient_acc to the run's")
    schedule = their_schedule(rank0.scheduler, rank0.path)
    derived = derive(cfg, world)
    differences = changes(cfg, derived, schedule, group)
    if differences and not allow_changes:
        raise ValueError(f"{config} does not continue the arcface_torch run: {'; '.join(differences)}; make the "
                         f"config match (the same keys as arcface_torch's), or pass --allow-changes to continue "
                         f"with the config's values")
    for line in differences:
        warn(f"the run continues with the config's {line}")

    model = get_model(cfg.network, num_features=cfg.embedding_size, **dict(cfg.network_kwargs))
    load_weights(model, rank0.path, network=cfg.network)  # strict; arcface_torch's keys, as init_backbone reads them
    model_pt = source / "model.pt"
    if model_pt.is_file():
        saved = load_state_dict(model_pt)
        if saved.keys() != model.state_dict().keys() or any(not torch.equal(v, saved[k])
                                                             for k, v in model.state_dict().items()):
            warn(f"{model_pt} is not the backbone of {rank0.path.name} (written after it?); the checkpoint's "
                 f"backbone is imported, with the class centres and optimizer state saved with it")
    existing, to_archive = held_runs(cfg, source, archive_old)

    # Our optimizers, built as the trainer builds them, give the state's layout: the backbone's is filled in by
    # parameter name; the head's (a meta tensor: no memory) gives the row-wise keys, shapes and dtypes.
    template_weight = nn.Parameter(torch.empty(1, cfg.embedding_size, device="meta"))
    opt_backbone, opt_head = build_optimizers(cfg.optimizer, model.parameters(),
                                              SimpleNamespace(weight=template_weight), cfg.lr, cfg.momentum,
                                              cfg.weight_decay)
    backbone_state = backbone_optimizer_state(model, opt_backbone, rank0)
    template = opt_head.state[template_weight]
    heads = []
    for i, rank in enumerate(ranks):
        class_start, _ = class_partition(cfg.num_classes, world, i)
        heads.append(head_shard(rank.weight, head_state(rank, template, cfg.optimizer), class_start, cfg.num_classes))
    head = PartialFC(build_margin_of(cfg), cfg.embedding_size, 1, seed=cfg.seed)  # its buffers' names: none for ArcFace

    # arcface_torch counts micro-batches, we optimizer steps; it saves at epoch ends.
    state = TrainState(step=rank0.global_step // cfg.gradient_acc, epoch=rank0.epoch, step_in_epoch=0)
    ours = schedule_of(cfg, derived)
    data = data_identity(cfg.rec)
    output = Path(cfg.output)
    if to_archive:
        warn(f"moved {', '.join(p.name for p in existing) or 'model.pt'} to {archive(output, existing)}")
    output.mkdir(parents=True, exist_ok=True)
    facts = dict(schedule=ours, config=cfg.to_dict(), keep=cfg.keep_checkpoints, fingerprint=fingerprint(cfg, data),
                 data=data, backbone=model.state_dict(), backbone_optimizer=backbone_state,
                 scaler=LossScaler(enabled=cfg.fp16).state_dict(), head_buffers=dict(head.named_buffers()))
    write_all_ranks(world, lambda r, barrier: write_run(output, state, rank=r, world_size=world, head=heads[r],
                                                        rng=seeded_rng(cfg.seed, state.step, r), barrier=barrier,
                                                        **facts))

    resume = "" if cfg.auto_resume and not cfg.resume else " --resume"
    sets = f" --set {' '.join(overrides)}" if overrides else ""
    return (f"imported {source} ({world} ranks, epoch {rank0.epoch}, step {rank0.global_step}) to "
            f"{step_dir(output, state.step)}: {cfg.network} backbone, {cfg.num_classes} class centres of width "
            f"{cfg.embedding_size} with their {cfg.optimizer} state; next LR {step_lr(state.step, state, ours):.6g} "
            f"(arcface_torch's: {float(group['lr']):.6g}); continue with: torchrun --nproc_per_node=N train.py "
            f"{config}{sets}{resume}")
