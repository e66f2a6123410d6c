"""All checkpoint I/O: atomic per-step directories, one head shard per rank, re-partition on load.

Layout of one checkpoint (``step`` = optimizer steps done)::

    <output>/checkpoints/step_000001200/
        common.pt         rank 0: backbone, backbone optimizer, scaler, lr/step, data position, world_size,
                          num_classes, config fingerprint, config dict and the head's buffers (see ``make_common``)
        rng_rank<r>.pt    rank r: torch CPU RNG state (+ CUDA RNG state of the current device when in use)
        head_rank<r>.pt   rank r: class_start, num_local, num_classes, weight rows (num_local, K·D: a class's K
                          sub-centres side by side, K = 1 without them) and the head
                          optimizer's row-wise state tensors (each (num_local, ...)); see ``partial_fc.head_shard``
        manifest.json     written last: format, step, world_size and the size of every file above

Writing is crash-safe: every rank writes into ``step_X.tmp/`` (each file as ``<name>.tmp``, fsynced, then
renamed), all ranks meet at a barrier, rank 0 writes the manifest, renames the directory to ``step_X``, fsyncs
the parent and prunes old checkpoints. A checkpoint counts only when its directory has the final name and a
manifest whose files all exist with the listed sizes, so a crash at any point leaves the previous complete
checkpoint as the newest one. Saving a step that exists moves the old copy to ``step_X.old`` just before the
rename; a crash between the two renames leaves it there, and the next run (``recover_replaced``) renames it back. All ranks must see the same ``output`` folder (one machine, or a shared file
system across nodes).

Everything is stored as CPU tensors, numbers, strings, lists and dicts and read back with
``torch.load(weights_only=True)``: loading a checkpoint never runs code from it, and needs no GPU.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from utils.config import redacted
from utils.files import atomic_write, fsync_dir, load_tensors

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINT_SUBDIR = "checkpoints"
MANIFEST = "manifest.json"
COMMON_FILE = "common.pt"
_STEP_DIR = re.compile(r"^step_(\d{9})$")
COMMON_KEYS = ("format", "step", "lr", "backbone", "backbone_optimizer", "scaler", "world_size", "num_classes",
               "fingerprint", "config")


# ------------------------------------------------------------------------------------------------ paths

def checkpoint_root(output: str | os.PathLike) -> Path:
    """``<output>/checkpoints``."""
    return Path(output) / CHECKPOINT_SUBDIR


def step_dir(output: str | os.PathLike, step: int) -> Path:
    """``<output>/checkpoints/step_<9-digit step>``."""
    if not 0 <= step < 10 ** 9:
        raise ValueError(f"checkpoint step {step} is outside [0, 1e9)")
    return checkpoint_root(output) / f"step_{step:09d}"


def head_file(rank: int) -> str:
    return f"head_rank{rank}.pt"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


# ------------------------------------------------------------------------------------------------ contents

@dataclass
class TrainState:
    """Where the run is; saved in every checkpoint as its own entry (``common["state"]``).

    ``step``: optimizer steps taken (skipped non-finite steps count: their batches were consumed). The data
    position is ``(epoch, step_in_epoch)``: the next batch to read is number ``step_in_epoch`` of ``epoch``.
    ``schedule_from_step`` and ``schedule_from_lr``: where a resume changed the schedule, and the learning rate
    the run had there (``utils.lr_scheduler.continued_lr``); -1 while the run follows its configured curve.
    """

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    nonfinite_in_row: int = 0
    skipped_steps: int = 0
    schedule_from_step: int = -1
    schedule_from_lr: float = 0.0


def make_common(*, state: TrainState, lr: float, backbone: Mapping[str, torch.Tensor],
                backbone_optimizer: Mapping[str, Any], scaler: Mapping[str, Any], world_size: int,
                num_classes: int, fingerprint: str, config: Mapping[str, Any],
                head_buffers: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The rank-0 part of a checkpoint as an explicit dict.

    ``backbone``: the unwrapped module's state_dict (no DDP ``module.`` prefix). ``backbone_optimizer`` and
    ``scaler``: their ``state_dict()``. ``config``: the configuration, saved without its secret keys
    (``redacted``). ``head_buffers``: the head's
    ``named_buffers()``, state that is not a row of the weight and is the same on every rank (AdaFace's
    running statistics of the embedding norms); saved as ``common["head_buffers"]``.
    """
    return {
        "format": FORMAT_VERSION, "step": int(state.step), "state": asdict(state),
        "lr": float(lr), "backbone": {k: v.detach().cpu() for k, v in backbone.items()},
        "backbone_optimizer": dict(backbone_optimizer), "scaler": dict(scaler), "world_size": int(world_size),
        "num_classes": int(num_classes), "fingerprint": str(fingerprint), "config": redacted(config),
        "head_buffers": {k: v.detach().cpu() for k, v in (head_buffers or {}).items()},
    }


def on_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (at any depth of dicts, lists and tuples) detached and on the CPU: a
    checkpoint written on a GPU opens on a machine without one (inspection, conversion, the export tools); the
    loaders put each tensor back on the run's device."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(on_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(v) for v in obj)
    return obj


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch RNG states (CPU, and the current CUDA device's when CUDA is in use)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------------------------------------ saving

def _default_barrier() -> None:
    from utils.distributed import barrier  # imported late: the checkpoint format does not depend on it

    barrier()


def save_checkpoint(output: str | os.PathLike, step: int, *, rank: int, world_size: int,
                    head: Mapping[str, Any], common: Mapping[str, Any] | None = None,
                    rng: Mapping[str, torch.Tensor] | None = None, keep: int = 2,
                    barrier: Callable[[], None] | None = None) -> Path:
    """Write checkpoint ``step``; every rank calls it. Returns the final directory.

    ``head``: this rank's ``partial_fc.head_shard(...)``; ``common``: ``make_common(...)``, required on rank 0 only;
    ``rng``: defaults to this process's ``rng_state()``; ``keep``: complete checkpoints kept after pruning;
    ``barrier``: called where all ranks must meet (default ``utils.distributed.barrier``; a no-op without a
    process group). Saving an existing step replaces it.
    """
    barrier = barrier or _default_barrier
    root = checkpoint_root(output)
    final = step_dir(output, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        _check_common(common, step, world_size)
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash while saving this same step
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()  # the empty .tmp directory exists before anyone writes into it

    files = {head_file(rank): dict(head), rng_file(rank): dict(rng if rng is not None else rng_state())}
    if rank == 0:
        files[COMMON_FILE] = dict(common)
    error: OSError | None = None
    try:
        for name, payload in files.items():
            atomic_write(tmp / name, lambda f, payload=payload: torch.save(on_cpu(payload), f))
    except OSError as exc:  # a full disk, a quota, a permission: every rank learns of it below
        error = exc
    barrier()  # every rank's files are durable in .tmp, or failed
    _agree_written(root, tmp, step, rank, error, sum(_tensor_bytes(p) for p in files.values()))

    if rank == 0:
        names = [COMMON_FILE] + [head_file(r) for r in range(world_size)] + [rng_file(r) for r in range(world_size)]
        missing = [n for n in names if not (tmp / n).is_file()]
        if missing:
            raise ValueError(f"{tmp}: files {missing} were not written; does every rank see this folder?")
        manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size,
                    "files": {n: (tmp / n).stat().st_size for n in names}}
        atomic_write(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        old = final.with_name(final.name + ".old")
        if final.exists():  # re-saving a step: move the old copy aside so the name is never half-written
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(root)
        if old.exists():
            shutil.rmtree(old)
        prune(output, keep)
        logger.info("saved checkpoint %s", final)
    barrier()  # nobody reads or starts the next save before rank 0 has renamed and pruned
    return final


class CheckpointWriteError(ValueError):
    """A checkpoint could not be written (e.g. a full disk); the previous one is intact."""


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _agree_written(root: Path, tmp: Path, step: int, rank: int, error: OSError | None, planned: int) -> None:
    """Every rank learns whether every rank wrote its files; if one did not, the partial directory is removed
    and every rank raises the same ``CheckpointWriteError`` (rank 0's names the space needed and free)."""
    from utils.distributed import all_gather_sizes, collective_device  # late: the format does not depend on them

    codes = all_gather_sizes([(error.errno or 1) if error else 0, planned], collective_device())
    failed = [r for r, (code, _) in enumerate(codes) if code]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    code = codes[failed[0]][0]
    needed, free = sum(n for _, n in codes), shutil.disk_usage(root).free
    previous = find_latest(root.parent)
    detail = f" ({error.filename}: {error.strerror})" if error is not None and error.filename else ""
    raise CheckpointWriteError(
        f"checkpoint step {step} was not written: {os.strerror(code)} on rank {', '.join(map(str, failed))}"
        f"{detail}; it needs about {needed / 2**20:.0f} MB and {free / 2**20:.0f} MB are free in {root}; "
        f"{'the previous checkpoint ' + str(previous) + ' is intact' if previous else 'no earlier checkpoint exists'}")


def _check_common(common: Mapping[str, Any] | None, step: int, world_size: int) -> None:
    if common is None:
        raise ValueError("save_checkpoint: rank 0 must pass common=make_common(...)")
    missing = [k for k in COMMON_KEYS if k not in common]
    if missing:
        raise ValueError(f"save_checkpoint: common is missing keys {missing}; build it with make_common(...)")
    if common["step"] != step or common["world_size"] != world_size:
        raise ValueError(f"save_checkpoint(step={step}, world_size={world_size}) but common says step="
                         f"{common['step']}, world_size={common['world_size']}")


# ------------------------------------------------------------------------------------------------ finding

def read_manifest(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a checkpoint directory; ``ValueError`` naming the file when absent or unreadable."""
    path = Path(ckpt_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a complete checkpoint (manifest missing or unreadable: {exc})") from exc
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {manifest.get('format')!r}; this code reads {FORMAT_VERSION}")
    return manifest


def is_complete(ckpt_dir: str | os.PathLike) -> bool:
    """True when the manifest is readable and every listed file exists with its listed size."""
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = read_manifest(ckpt_dir)
    except ValueError:
        return False
    for name, size in manifest["files"].items():
        path = ckpt_dir / name
        if not path.is_file() or path.stat().st_size != size:
            logger.warning("checkpoint %s is incomplete: %s is missing or has the wrong size", ckpt_dir, name)
            return False
    return True


def _step_dirs(output: str | os.PathLike) -> list[tuple[int, Path]]:
    root = checkpoint_root(output)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def list_checkpoints(output: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``output``, oldest first."""
    return [p for _, p in _step_dirs(output) if is_complete(p)]


def find_latest(output: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``output`` (ignores ``*.tmp`` and partial directories), or None."""
    for _, path in reversed(_step_dirs(output)):
        if is_complete(path):
            return path
    return None


def prune(output: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (rank 0). Returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep = {keep}; expected >= 1")
    doomed = list_checkpoints(output)[:-keep]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def recover_replaced(output: str | os.PathLike) -> list[Path]:
    """Rename back each complete ``step_X.old`` whose ``step_X`` is missing or incomplete: a save of an existing
    step stopped between moving the old copy aside and renaming the new one in (rank 0, before anyone looks for
    checkpoints). Returns the checkpoints restored."""
    root = checkpoint_root(output)
    if not root.is_dir():
        return []
    restored = []
    for old in sorted(root.glob("step_*.old")):
        final = old.with_name(old.name[:-len(".old")])
        if _STEP_DIR.match(final.name) and old.is_dir() and is_complete(old) and not is_complete(final):
            if final.exists():
                shutil.rmtree(final)
            os.replace(old, final)
            restored.append(final)
    if restored:
        fsync_dir(root)
        logger.info("restored checkpoints a stopped save had moved aside: %s", ", ".join(p.name for p in restored))
    return restored


def clean_partial(output: str | os.PathLike) -> list[Path]:
    """Remove leftovers of interrupted saves (rank 0, before training starts): ``*.tmp``/``*.old`` entries and
    ``step_*`` directories that are not complete, after ``recover_replaced`` has renamed back the ``.old`` copies
    that are the only complete one of their step. Other files are left alone. Returns what was removed.
    """
    root = checkpoint_root(output)
    if not root.is_dir():
        return []
    recover_replaced(output)
    removed = []
    for path in sorted(root.iterdir()):
        partial_step = path.is_dir() and _STEP_DIR.match(path.name) and not is_complete(path)
        if path.name.endswith((".tmp", ".old")) or partial_step:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
    if removed:
        logger.info("removed partial checkpoints: %s", ", ".join(p.name for p in removed))
    return removed


# ------------------------------------------------------------------------------------------------ loading

def load_common(ckpt_dir: str | os.PathLike, mmap: bool = False) -> dict[str, Any]:
    """``common.pt`` of a checkpoint, checked for the expected keys (``mmap``: read tensors only when used)."""
    path = Path(ckpt_dir) / COMMON_FILE
    if not path.is_file():
        raise ValueError(f"{path}: missing; expected the rank-0 part of a checkpoint")
    common = load_tensors(path, mmap=mmap)
    if not isinstance(common, dict) or [k for k in COMMON_KEYS if k not in common]:
        keys = sorted(common) if isinstance(common, dict) else type(common).__name__
        raise ValueError(f"{path}: holds {keys}; expected keys {list(COMMON_KEYS)}")
    return common


def load_rng(ckpt_dir: str | os.PathLike, rank: int) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s RNG state, or None when the checkpoint had fewer ranks (world size changed)."""
    path = Path(ckpt_dir) / rng_file(rank)
    return load_tensors(path) if path.is_file() else None


def train_state_of(common: Mapping[str, Any]) -> TrainState:
    """The ``TrainState`` of a checkpoint's common part (checkpoints written before it was an entry of its own
    kept the position at the top level and the skipped-step count in the config)."""
    if "state" in common:
        return TrainState(**common["state"])
    return TrainState(step=common["step"], epoch=common["epoch"], step_in_epoch=common["step_in_epoch"],
                      skipped_steps=common["config"].get("skipped_steps", 0))


def resume_position(state: TrainState, saved_per_step: int, per_step: int, steps_per_epoch: int,
                    max_steps: int) -> TrainState:
    """Where to continue, in units of the new run's optimizer steps; ``saved_per_step``/``per_step``: images per
    optimizer step (batch size x world size x accumulation) of the run that saved and of this one.

    With the same images per step nothing changes. Otherwise (another world size, say) the position in the
    epoch keeps the samples consumed (rounded down, so a few are seen again rather than skipped), and for an
    epoch-based run (``max_steps = 0``) the step counter is recomputed from the epoch position, so the LR
    schedule continues at the same fraction of training and the run still ends after the configured
    epochs. A step-based run (``max_steps > 0``) keeps its step.
    """
    if saved_per_step == per_step:
        return state
    epoch, step_in_epoch = state.epoch, state.step_in_epoch * saved_per_step // per_step
    if step_in_epoch >= steps_per_epoch:
        epoch, step_in_epoch = epoch + 1, 0
    step = epoch * steps_per_epoch + step_in_epoch if max_steps == 0 else state.step
    return TrainState(step=step, epoch=epoch, step_in_epoch=step_in_epoch, skipped_steps=state.skipped_steps)


# Keys whose saved state cannot serve another value: an explicit resume that changes one is refused.
FIXED_KEYS: dict[str, str] = {
    "network": "the saved weights are that network's",
    "network_kwargs": "the saved weights have that network's shapes",
    "embedding_size": "the saved weights and class centres have that width",
    "num_classes": "the head holds one saved row per class",
    "optimizer": "the saved optimizer state is that optimizer's",
    "sub_centers": "the head holds that many saved centres per class",
    "margin": "the head's saved state is that margin's: AdaFace keeps running norm statistics",
}


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` for every key that enters the fingerprint and differs (the
    ``rec`` path aside: the data's identity stands for it). A key added after ``saved`` was written counts with
    the value that trained as the code did then (``FINGERPRINT_LEGACY``)."""
    from utils.config import FINGERPRINT_EXCLUDED, FINGERPRINT_LEGACY

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
    else ``ValueError`` naming the keys and what to do. Schedule keys (``lr``, ``max_steps``, ``num_epoch``,
    ``warmup_epoch``, ``lr_power``, ...) continue from the saved step with the new values."""
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


def _step_of(path: Path) -> int:
    return int(path.name[len("step_"):])


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
        return start, [p for p in existing if not inside or _step_of(p) > _step_of(start.resolve())]
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
    import time

    target = Path(output) / f"archive_{time.strftime('%Y%m%d-%H%M%S')}"
    target.mkdir(parents=True, exist_ok=False)
    for path in checkpoints + [Path(output) / n for n in ("model.pt", "model.json") if (Path(output) / n).exists()]:
        os.replace(path, target / path.name)
    fsync_dir(target)
    fsync_dir(Path(output))
    return target


_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")  # how torch runs an update, not state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, keeping this build's choice of how the update runs.

    torch restores every saved param-group value, including ``foreach``, ``fused``, ``capturable`` and
    ``differentiable``, which say how the update is computed, not what it computes. A checkpoint of a release
    that left ``foreach`` unset would switch the optimizer built with ``foreach=True`` back to torch's
    per-tensor loop on a CPU (the same values, about twice the time); so those keys keep the optimizer's own
    defaults. Every other value (LR, momentum, betas, weight decay, and the state) comes from the checkpoint.
    """
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for key in _IMPLEMENTATION_KEYS:
            if key in optimizer.defaults and key in group:
                group[key] = optimizer.defaults[key]
