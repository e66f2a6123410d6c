"""Continue an arcface_torch run here: its ``checkpoint_gpu_<rank>.pt`` files become one of our step checkpoints.

    python scripts/import_arcface.py ARCFACE_OUTPUT_DIR configs/NAME
    torchrun --nproc_per_node=N train.py configs/NAME        # continues at arcface_torch's step, on any N

ARCFACE_OUTPUT_DIR is the ``output`` folder of an arcface_torch ``train_v2.py`` run with ``save_all_states``:
one ``checkpoint_gpu_<rank>.pt`` per GPU, each ``{"epoch", "global_step", "state_dict_backbone",
"state_dict_softmax_fc", "state_optimizer", "state_lr_scheduler"}``. configs/NAME describes the run as it goes
on here (its ``network``, ``embedding_size``, ``num_classes``, ``optimizer`` and schedule keys must be the
arcface_torch run's: the same key names). The tool writes ``<output>/checkpoints/step_<S>/`` (S = arcface_torch's
``global_step``, in optimizer steps), ``model.pt`` and ``model.json``, with the project's own checkpoint writer,
as if a run of that config on the same number of ranks had saved it: ``train.py configs/NAME`` resumes it by
itself, on any number of ranks (the head is re-partitioned on load).

Converted: the backbone (rank 0's weights and batch-norm statistics, loaded strictly into the config's
network); every class centre, at the class id arcface_torch's ``PartialFC_V2`` gave it
(``class_start = C // W · r + min(r, C mod W)``, ``num_local = C // W + [r < C mod W]``); the optimizer state of
both (SGD momentum, AdamW moments and step count); the position (epoch; the step, which puts the LR schedule
at the same point). Not converted, because arcface_torch does not save them: the fp16 loss scale (starts
afresh), the random streams (seeded from the step, as after a change of world size), the data order inside an
epoch (arcface_torch saves at epoch ends only, so none is lost).

Checks, each a line that names the file or key: every rank's file present, each readable without running
code (``torch.load(weights_only=True)``) and of the same epoch and step; the shards following the
``class_start``/``num_local`` rule and adding up to the config's ``num_classes``; the centres' width equal to
``embedding_size``; the backbone loading strictly into the config's network; the optimizer the config's; the
config's LR, ``lr_power``, total and warm-up steps (from ``num_image``, ``batch_size`` and the number of
ranks), ``weight_decay`` and ``momentum`` those of arcface_torch's optimizer and scheduler (``--allow-changes``
continues with the config's values instead, each difference printed as a warning); an ``output`` that holds no
run yet (``--archive`` moves what it holds to ``<output>/archive_<time>/``, as the trainer's
``archive_checkpoints`` does).

Exit status: 0 written (one line: what, where, the next command); 1 bad data: a rank's file missing, unreadable,
unsafe or inconsistent with the others; 2 usage: bad options, a config that does not describe the arcface_torch
run, an ``output`` that already holds a run. Nothing is written unless every check passes.
"""
from __future__ import annotations

import argparse
import re
import sys
import threading
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402
from torch import nn  # noqa: E402

from backbones import get_model  # noqa: E402
from dataset import build_dataset  # noqa: E402
from losses import build_margin  # noqa: E402
from partial_fc import PartialFC, build_optimizers, class_partition, head_shard  # noqa: E402
from eval.model_card import MODEL_CARD, model_card, write_model_card  # noqa: E402
from utils.checkpoint import (TrainState, archive, list_checkpoints, make_common, save_checkpoint,  # noqa: E402
                              step_dir)
from utils.config import Config, check_paths, data_identity, derive, fingerprint, load_config  # noqa: E402
from utils.files import load_state_dict, load_tensors, load_weights, save_atomic  # noqa: E402
from utils.cli import print_error  # noqa: E402
from utils.lr_scheduler import lr_at  # noqa: E402
from utils.precision import LossScaler  # noqa: E402

TOOL = "import_arcface"
RANK_FILE = re.compile(r"^checkpoint_gpu_(\d+)\.pt$")
KEYS = ("epoch", "global_step", "state_dict_backbone", "state_dict_softmax_fc", "state_optimizer",
        "state_lr_scheduler")
WARNING = f"{TOOL}: warning: "


class BadData(ValueError):
    """The arcface_torch folder's files are missing, unreadable or inconsistent among themselves (exit 1)."""


# ------------------------------------------------------------------------------------------------ reading

def rank_files(folder: Path) -> list[Path]:
    """``checkpoint_gpu_0.pt`` … ``checkpoint_gpu_<W-1>.pt`` of ``folder``; ``BadData`` when one in the range is
    missing, ``ValueError`` when there is none."""
    if not folder.is_dir():
        raise ValueError(f"ARCFACE_OUTPUT_DIR {folder}: {'is a file, not a folder' if folder.exists() else 'not found'}")
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
    if not isinstance(backbone, dict) or not backbone or not all(isinstance(v, torch.Tensor) for v in backbone.values()):
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
        raise BadData(f"{first.path.parent}: {names} missing? ranks {_ranges(list(range(world)))} hold {shares} class centres, the "
                      f"first shares of a {more}-rank run of the config's num_classes = {cfg.num_classes} (if the run "
                      f"had {total} classes, set num_classes = {total})")
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
class Schedule:
    """arcface_torch's schedule, in its scheduler's steps (micro-batches), from ``state_lr_scheduler``."""

    kind: str
    base_lr: float
    warmup: int
    total: int
    power: float


def their_schedule(state: Mapping[str, Any], path: Path) -> Schedule:
    """arcface_torch's ``PolynomialLRWarmup`` (``warmup_iters``, ``total_iters``, ``power``: its current trainer) or
    ``PolyScheduler`` (``warmup_steps``, ``max_steps``, power 2: its earlier one)."""
    try:
        if "total_iters" in state and "warmup_iters" in state:
            return Schedule("PolynomialLRWarmup", float(state["base_lrs"][0]), int(state["warmup_iters"]),
                            int(state["total_iters"]), float(state.get("power", 1.0)))
        if "max_steps" in state and "warmup_steps" in state:
            return Schedule("PolyScheduler", float(state["base_lr"]), int(state["warmup_steps"]),
                            int(state["max_steps"]), float(state.get("power", 2.0)))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise BadData(f"{path}: state_lr_scheduler lacks {exc}") from None
    raise BadData(f"{path}: state_lr_scheduler holds {sorted(state)}; expected arcface_torch's PolynomialLRWarmup "
                  f"(warmup_iters, total_iters) or PolyScheduler (warmup_steps, max_steps)")


def their_optimizer(group: Mapping[str, Any]) -> str:
    """``"adamw"`` or ``"sgd"``: the optimizer class ``train_v2.py`` built, told by its param group's keys."""
    return "adamw" if "betas" in group else "sgd"


def changes(cfg: Config, world: int, schedule: Schedule, group: Mapping[str, Any]) -> list[str]:
    """Every way the config's LR schedule and optimizer settings differ from the arcface_torch run's, each as
    ``key here (arcface_torch: value)``. The step counts are compared as ``train_v2.py`` computes them from the
    same keys (``num_image // (batch_size · ranks)`` scheduler steps per epoch)."""
    out = []
    if abs(cfg.lr - schedule.base_lr) > 1e-12 * max(abs(cfg.lr), 1.0):
        out.append(f"lr {cfg.lr:g} (arcface_torch: {schedule.base_lr:g})")
    if cfg.lr_power != schedule.power:
        out.append(f"lr_power {cfg.lr_power:g} (arcface_torch's {schedule.kind}: {schedule.power:g})")
    per_epoch = cfg.num_image // (cfg.batch_size * world)
    if cfg.max_steps > 0:
        total, how = cfg.max_steps * cfg.gradient_acc, f"max_steps {cfg.max_steps}"
    else:
        total = per_epoch * cfg.num_epoch
        how = f"num_image {cfg.num_image} // (batch_size {cfg.batch_size} x {world} ranks) x num_epoch {cfg.num_epoch}"
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
    return value.detach().to(torch.float32).reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(float(value))


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

def write_all_ranks(output: Path, step: int, world: int, common: dict[str, Any], heads: list[dict[str, Any]],
                    rngs: list[dict[str, torch.Tensor]], keep: int) -> Path:
    """``utils.checkpoint.save_checkpoint`` for every rank of a ``world``-rank run, in one process: one thread per
    rank, meeting at a thread barrier where the ranks of a run meet at the process group's. The files, the
    manifest and the atomic rename are the trainer's own."""
    barrier = threading.Barrier(world)
    errors: list[BaseException] = []  # in the order they happened: the first is the cause, the others follow it

    def save(rank: int) -> None:
        try:
            save_checkpoint(output, step, rank=rank, world_size=world, head=heads[rank],
                            common=common if rank == 0 else None, rng=rngs[rank], keep=keep, barrier=barrier.wait)
        except threading.BrokenBarrierError:  # another rank failed: its error is the one to report
            pass
        except BaseException as exc:  # handed to the main thread, which raises it
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=save, args=(r,), name=f"rank{r}") for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return step_dir(output, step)


def import_run(source: Path, config: str, overrides: list[str], archive_old: bool, allow_changes: bool) -> str:
    """Check everything, then write the checkpoint; returns the summary line (warnings go to stderr)."""
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
    schedule = their_schedule(rank0.scheduler, rank0.path)
    derived = derive(cfg, world)
    step = rank0.global_step // cfg.gradient_acc  # arcface_torch counts micro-batches, we optimizer steps
    ours_lr = lr_at(step, cfg.lr, derived.warmup_steps, derived.total_steps, power=cfg.lr_power)
    theirs_lr = float(group["lr"])  # what its next update would have used
    differences = changes(cfg, world, schedule, group)
    if differences and not allow_changes:
        raise ValueError(f"{config} does not continue the arcface_torch run: {'; '.join(differences)}; make the "
                         f"config match (the same keys as arcface_torch's), or pass --allow-changes to continue "
                         f"with the config's values")
    for line in differences:
        print(f"{WARNING}the run continues with the config's {line}", file=sys.stderr)

    model = get_model(cfg.network, num_features=cfg.embedding_size, **dict(cfg.network_kwargs))
    load_weights(model, rank0.path, network=cfg.network)  # strict; arcface_torch's keys, as init_backbone reads them
    model_pt = source / "model.pt"
    if model_pt.is_file():
        saved = load_state_dict(model_pt)
        if saved.keys() != model.state_dict().keys() or any(not torch.equal(v, saved[k])
                                                             for k, v in model.state_dict().items()):
            print(f"{WARNING}{model_pt} is not the backbone of {rank0.path.name} (written after it?); the "
                  f"checkpoint's backbone is imported, with the class centres and optimizer state saved with it",
                  file=sys.stderr)
    existing, to_archive = held_runs(cfg, source, archive_old)

    # Our optimizers, built as the trainer builds them, give the state's layout: the backbone's is filled in by
    # parameter name; the head's (a meta tensor: no memory) gives the row-wise keys, shapes and dtypes.
    template_weight = nn.Parameter(torch.empty(1, cfg.embedding_size, device="meta"))
    opt_backbone, opt_head = build_optimizers(cfg.optimizer, model.parameters(), SimpleNamespace(weight=template_weight),
                                              cfg.lr, cfg.momentum, cfg.weight_decay)
    backbone_state = backbone_optimizer_state(model, opt_backbone, rank0)
    template = opt_head.state[template_weight]
    heads = []
    for i, rank in enumerate(ranks):
        class_start, _ = class_partition(cfg.num_classes, world, i)
        heads.append(head_shard(rank.weight, head_state(rank, template, cfg.optimizer), class_start, cfg.num_classes))
    margin = build_margin(cfg.margin, scale=cfg.margin_scale, gradient=cfg.margin_gradient, margin_list=cfg.margin_list,
                          interclass_filtering_threshold=cfg.interclass_filtering_threshold, adaface_m=cfg.adaface_m,
                          adaface_h=cfg.adaface_h, adaface_t_alpha=cfg.adaface_t_alpha)
    head = PartialFC(margin, cfg.embedding_size, 1, seed=cfg.seed)  # its buffers' names: none for ArcFace

    data = data_identity(cfg.rec)
    state = TrainState(step=step, epoch=rank0.epoch, step_in_epoch=0)  # arcface_torch saves at epoch ends
    common = make_common(state=state, lr=theirs_lr, backbone=model.state_dict(), backbone_optimizer=backbone_state,
                         scaler=LossScaler(enabled=cfg.fp16).state_dict(), world_size=world,
                         num_classes=cfg.num_classes, fingerprint=fingerprint(cfg, data), config=cfg.to_dict(),
                         head_buffers=dict(head.named_buffers()))
    common["data"] = data
    # Random streams as the trainer seeds them when a run continues on another number of ranks.
    rngs = [{"cpu": torch.Generator().manual_seed(cfg.seed + 1_000_003 * step + r).get_state()} for r in range(world)]

    output = Path(cfg.output)
    if to_archive:
        print(f"{WARNING}moved {', '.join(p.name for p in existing) or 'model.pt'} to "
              f"{archive(output, existing)}", file=sys.stderr)
    output.mkdir(parents=True, exist_ok=True)
    path = write_all_ranks(output, step, world, common, heads, rngs, cfg.keep_checkpoints)
    save_atomic(model.state_dict(), output / "model.pt")
    write_model_card(output / MODEL_CARD, model_card(cfg.network, cfg.network_kwargs, cfg.embedding_size,
                                                     fingerprint=common["fingerprint"], step=step))

    resume = "" if cfg.auto_resume and not cfg.resume else " --resume"
    sets = f" --set {' '.join(overrides)}" if overrides else ""
    return (f"imported {source} ({world} ranks, epoch {rank0.epoch}, step {rank0.global_step}) to {path}: "
            f"{cfg.network} backbone, {cfg.num_classes} class centres of width {cfg.embedding_size} with their "
            f"{cfg.optimizer} state; next LR {ours_lr:.6g} (arcface_torch's: {theirs_lr:.6g}); continue with: "
            f"torchrun --nproc_per_node=N train.py {config}{sets}{resume}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, metavar="ARCFACE_OUTPUT_DIR",
                        help="arcface_torch's output folder, holding checkpoint_gpu_<rank>.pt")
    parser.add_argument("config", help="configs/NAME (or a .py config file) of the run as it continues here")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys as train.py does (give train.py the same ones)")
    parser.add_argument("--archive", action="store_true",
                        help="move the checkpoints and model.pt already in `output` to output/archive_<time>/")
    parser.add_argument("--allow-changes", action="store_true",
                        help="continue with the config's lr, schedule, weight_decay and momentum where they differ "
                             "from the arcface_torch run's (each difference is printed)")
    args = parser.parse_args(argv)
    try:
        summary = import_run(args.source, args.config, args.overrides, args.archive, args.allow_changes)
    except BadData as exc:
        print_error(TOOL, exc)
        return 1
    except (ValueError, OSError) as exc:  # OSError: a config or an output that cannot be read or written
        print_error(TOOL, exc)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
