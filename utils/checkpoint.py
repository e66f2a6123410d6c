"""A generic atomic step store: per-step folders of files, a manifest, pruning, crash recovery and loading.

Layout of one checkpoint (``step`` = optimizer steps done)::

    <output>/checkpoints/step_000001200/
        common.pt         rank 0's part: a dict of the caller's (the trainer's run state: trainer/checkpointing.py);
                          its ``step`` and ``world_size`` are the manifest's
        rng_rank<r>.pt    rank r: torch RNG states (``rng_state``)
        head_rank<r>.pt   rank r: its shard of the class centres (``partial_fc.head_shard``)
        manifest.json     written last: format, step, world_size and the size of every file above

``save_checkpoint`` writes into ``step_X.tmp/`` on every rank; rank 0 writes the manifest and renames the folder.
A checkpoint counts only under its final name with a complete manifest, so a crash leaves the previous one the
newest (``recover_replaced`` puts back a re-saved step's ``step_X.old``). Everything is read back with
``torch.load(weights_only=True)``. The guarantees users rely on: docs/checkpoints.md#reliability.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from utils.files import atomic_write, fsync_dir, load_tensors

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINT_SUBDIR = "checkpoints"
MANIFEST = "manifest.json"
COMMON_FILE = "common.pt"
_STEP_DIR = re.compile(r"^step_(\d{9})$")
STORE_KEYS = ("step", "world_size")  # what the store itself reads of a common part


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

    ``head``: this rank's ``partial_fc.head_shard(...)``; ``common``: the rank-0 part, a dict with at least
    ``STORE_KEYS`` (the trainer's: ``trainer.checkpointing.make_common``), required on rank 0 only;
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
        raise ValueError("save_checkpoint: rank 0 must pass common (the checkpoint's rank-0 part)")
    missing = [k for k in STORE_KEYS if k not in common]
    if missing:
        raise ValueError(f"save_checkpoint: common is missing keys {missing}")
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


def step_of(ckpt_dir: str | os.PathLike) -> int:
    """The step of a checkpoint folder ``.../step_<9 digits>``."""
    return int(Path(ckpt_dir).name[len("step_"):])


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

def load_common(ckpt_dir: str | os.PathLike, mmap: bool = False,
                keys: tuple[str, ...] = STORE_KEYS) -> dict[str, Any]:
    """``common.pt`` of a checkpoint, checked for ``keys`` (``mmap``: read tensors only when used)."""
    path = Path(ckpt_dir) / COMMON_FILE
    if not path.is_file():
        raise ValueError(f"{path}: missing; expected the rank-0 part of a checkpoint")
    common = load_tensors(path, mmap=mmap)
    if not isinstance(common, dict) or [k for k in keys if k not in common]:
        held = sorted(common) if isinstance(common, dict) else type(common).__name__
        raise ValueError(f"{path}: holds {held}; expected keys {list(keys)}")
    return common


def load_rng(ckpt_dir: str | os.PathLike, rank: int) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s RNG state, or None when the checkpoint had fewer ranks (world size changed)."""
    path = Path(ckpt_dir) / rng_file(rank)
    return load_tensors(path) if path.is_file() else None


_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")  # how torch runs an update, not state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, keeping this build's choice of how the update runs.

    torch restores every saved param-group value, including ``foreach``, ``fused``, ``capturable`` and
    ``differentiable``, which say how the update is computed, not what it computes: a checkpoint that left
    ``foreach`` unset would switch an optimizer built with ``foreach=True`` back to torch's per-tensor loop on a
    CPU. Those keys keep the optimizer's own defaults; every other value (LR, momentum, betas, weight decay, the
    state) comes from the checkpoint.
    """
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for key in _IMPLEMENTATION_KEYS:
            if key in optimizer.defaults and key in group:
                group[key] = optimizer.defaults[key]
