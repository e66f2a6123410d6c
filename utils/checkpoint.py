"""All checkpoint I/O: atomic per-step directories, one head shard per rank, re-partition on load.

Layout of one checkpoint (``step`` = optimizer steps done)::

    <output>/checkpoints/step_000001200/
        common.pt         rank 0: backbone, backbone optimizer, scaler, lr/step, data position, world_size,
                          num_classes, config fingerprint and config dict (see ``make_common``)
        rng_rank<r>.pt    rank r: torch CPU RNG state (+ CUDA RNG state of the current device when in use)
        head_rank<r>.pt   rank r: class_start, num_local, num_classes, weight rows (num_local, D) and the head
                          optimizer's row-wise state tensors (each (num_local, ...)); see ``head_shard``
        manifest.json     written last: format, step, world_size and the size of every file above

Writing is crash-safe: every rank writes into ``step_X.tmp/`` (each file as ``<name>.tmp``, fsynced, then
renamed), all ranks meet at a barrier, rank 0 writes the manifest, renames the directory to ``step_X``, fsyncs
the parent and prunes old checkpoints. A checkpoint counts only when its directory has the final name and a
manifest whose files all exist with the listed sizes, so a crash at any point leaves the previous complete
checkpoint as the newest one. All ranks must see the same ``output`` folder (one machine, or a shared file
system across nodes).

Everything is stored as tensors, numbers, strings, lists and dicts and read back with
``torch.load(weights_only=True)``: loading a checkpoint never runs code from it.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINT_SUBDIR = "checkpoints"
MANIFEST = "manifest.json"
COMMON_FILE = "common.pt"
_STEP_DIR = re.compile(r"^step_(\d{9})$")
COMMON_KEYS = ("format", "step", "epoch", "step_in_epoch", "lr", "backbone", "backbone_optimizer", "scaler",
               "world_size", "num_classes", "fingerprint", "config")
HEAD_KEYS = ("class_start", "num_local", "num_classes", "weight", "state")


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


# ------------------------------------------------------------------------------------------------ low-level I/O

def _fsync_dir(path: Path) -> None:
    """Make a rename or file creation inside ``path`` durable (the directory entry itself is flushed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable[[Any], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    written = False
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        written = True
    finally:
        if not written:  # a failed write leaves neither a half file nor its .tmp; `path` keeps its old content
            tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def save_atomic(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` through ``<path>.tmp`` + fsync + rename: readers see old or new, never half.

    Use for single files such as ``<output>/model.pt`` (the backbone-only state_dict). Creates the parent folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, lambda f: torch.save(obj, f))


def load_file(path: str | os.PathLike, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU; refuses files holding anything but plain data.

    Raises ``ValueError`` naming the file when it is not a tensors-only checkpoint (e.g. a pickle that would
    import or call code) or cannot be read.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{path}: refused: the file holds objects other than tensors, numbers, strings, lists "
                         f"and dicts, and loading it could run code ({str(exc).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise ValueError(f"{path}: cannot be read as a checkpoint file ({exc})") from exc


# ------------------------------------------------------------------------------------------------ contents

def make_common(*, step: int, epoch: int, step_in_epoch: int, lr: float, backbone: Mapping[str, torch.Tensor],
                backbone_optimizer: Mapping[str, Any], scaler: Mapping[str, Any], world_size: int,
                num_classes: int, fingerprint: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The rank-0 part of a checkpoint as an explicit dict.

    ``backbone``: the unwrapped module's state_dict (no DDP ``module.`` prefix). ``backbone_optimizer`` and
    ``scaler``: their ``state_dict()``. ``epoch``/``step_in_epoch``: where the data loader resumes (the next
    batch to read is number ``step_in_epoch`` of epoch ``epoch``). ``config``: ``Config.to_dict()``.
    """
    return {
        "format": FORMAT_VERSION, "step": int(step), "epoch": int(epoch), "step_in_epoch": int(step_in_epoch),
        "lr": float(lr), "backbone": {k: v.detach().cpu() for k, v in backbone.items()},
        "backbone_optimizer": dict(backbone_optimizer), "scaler": dict(scaler), "world_size": int(world_size),
        "num_classes": int(num_classes), "fingerprint": str(fingerprint), "config": dict(config),
    }


def head_shard(weight: torch.Tensor, state: Mapping[str, torch.Tensor], class_start: int,
               num_classes: int) -> dict[str, Any]:
    """One rank's head: weight rows (num_local, D) for classes [class_start, class_start + num_local) and the
    head optimizer's state for them (``optimizer.state[weight]``: every tensor row-wise, first dim num_local).
    """
    num_local = weight.shape[0]
    rows: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != num_local:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"head optimizer state {key!r} is {shape}; expected a tensor with first dimension "
                             f"num_local = {num_local} (row-wise state can be re-partitioned to other world sizes)")
        rows[key] = value.detach().cpu()
    if not 0 <= class_start <= class_start + num_local <= num_classes:
        raise ValueError(f"head rows [{class_start}, {class_start + num_local}) are outside [0, {num_classes})")
    return {"class_start": int(class_start), "num_local": int(num_local), "num_classes": int(num_classes),
            "weight": weight.detach().cpu(), "state": rows}


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

    ``head``: this rank's ``head_shard(...)``; ``common``: ``make_common(...)``, required on rank 0 only;
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

    _write_atomic(tmp / head_file(rank), lambda f: torch.save(dict(head), f))
    _write_atomic(tmp / rng_file(rank), lambda f: torch.save(dict(rng if rng is not None else rng_state()), f))
    if rank == 0:
        _write_atomic(tmp / COMMON_FILE, lambda f: torch.save(dict(common), f))
    barrier()  # every rank's files are durable in .tmp

    if rank == 0:
        names = [COMMON_FILE] + [head_file(r) for r in range(world_size)] + [rng_file(r) for r in range(world_size)]
        missing = [n for n in names if not (tmp / n).is_file()]
        if missing:
            raise ValueError(f"{tmp}: files {missing} were not written; does every rank see this folder?")
        manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size,
                    "files": {n: (tmp / n).stat().st_size for n in names}}
        _write_atomic(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        old = final.with_name(final.name + ".old")
        if final.exists():  # re-saving a step: move the old copy aside so the name is never half-written
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        if old.exists():
            shutil.rmtree(old)
        prune(output, keep)
        logger.info("saved checkpoint %s", final)
    barrier()  # nobody reads or starts the next save before rank 0 has renamed and pruned
    return final


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


def clean_partial(output: str | os.PathLike) -> list[Path]:
    """Remove leftovers of interrupted saves (rank 0, before training starts): ``*.tmp``/``*.old`` entries and
    ``step_*`` directories that are not complete. Other files are left alone. Returns what was removed.
    """
    root = checkpoint_root(output)
    if not root.is_dir():
        return []
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

def load_common(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """``common.pt`` of a checkpoint, checked for the expected keys."""
    path = Path(ckpt_dir) / COMMON_FILE
    if not path.is_file():
        raise ValueError(f"{path}: missing; expected the rank-0 part of a checkpoint")
    common = load_file(path)
    if not isinstance(common, dict) or [k for k in COMMON_KEYS if k not in common]:
        keys = sorted(common) if isinstance(common, dict) else type(common).__name__
        raise ValueError(f"{path}: holds {keys}; expected keys {list(COMMON_KEYS)}")
    return common


def load_rng(ckpt_dir: str | os.PathLike, rank: int) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s RNG state, or None when the checkpoint had fewer ranks (world size changed)."""
    path = Path(ckpt_dir) / rng_file(rank)
    return load_file(path) if path.is_file() else None


def _check_shard(shard: Any, path: Path) -> None:
    if not isinstance(shard, dict) or [k for k in HEAD_KEYS if k not in shard]:
        keys = sorted(shard) if isinstance(shard, dict) else type(shard).__name__
        raise ValueError(f"{path}: holds {keys}; expected a head shard with keys {list(HEAD_KEYS)}")
    n, weight = shard["num_local"], shard["weight"]
    if weight.dim() != 2 or weight.shape[0] != n:
        raise ValueError(f"{path}: weight has shape {tuple(weight.shape)}; expected ({n}, embedding_size)")
    for key, value in shard["state"].items():
        if value.dim() == 0 or value.shape[0] != n:
            raise ValueError(f"{path}: optimizer state {key!r} has shape {tuple(value.shape)}; expected first "
                             f"dimension num_local = {n}")


def load_head_rows(ckpt_dir: str | os.PathLike, class_start: int, num_local: int, *,
                   num_classes: int | None = None) -> dict[str, Any]:
    """Weight and optimizer-state rows for classes [class_start, class_start + num_local), from whichever saved
    shards overlap them: a checkpoint written by any world size can be loaded by any other.

    ``num_classes``: the current config's value, checked against the checkpoint's. Returns
    ``{"class_start", "num_local", "num_classes", "weight": (num_local, D), "state": {key: (num_local, ...)}}``.
    Raises ``ValueError`` naming the file when a shard is missing, shapes disagree or num_classes differs.
    """
    ckpt_dir = Path(ckpt_dir)
    saved_world = read_manifest(ckpt_dir)["world_size"]
    end = class_start + num_local
    pieces: list[tuple[int, int, dict[str, Any]]] = []  # (lo, hi, {"weight": rows, "state": {...}})
    saved_classes: int | None = None
    dim: int | None = None
    state_keys: set[str] | None = None
    for r in range(saved_world):
        path = ckpt_dir / head_file(r)
        if not path.is_file():
            raise ValueError(f"{path}: missing head shard of rank {r} (the checkpoint was written by "
                             f"{saved_world} ranks)")
        shard = load_file(path, mmap=True)  # memory-mapped: only the overlapping rows are read from disk
        _check_shard(shard, path)
        if num_classes is not None and shard["num_classes"] != num_classes:
            raise ValueError(f"{path}: checkpoint was trained with num_classes = {shard['num_classes']}, the config "
                             f"has num_classes = {num_classes}")
        if saved_classes is not None and shard["num_classes"] != saved_classes:
            raise ValueError(f"{path}: num_classes = {shard['num_classes']} but other shards say {saved_classes}")
        saved_classes = shard["num_classes"]
        if dim is not None and shard["weight"].shape[1] != dim:
            raise ValueError(f"{path}: embedding size {shard['weight'].shape[1]} but other shards have {dim}")
        dim = shard["weight"].shape[1]
        if state_keys is not None and set(shard["state"]) != state_keys:
            raise ValueError(f"{path}: optimizer state keys {sorted(shard['state'])}, other shards have "
                             f"{sorted(state_keys)}")
        state_keys = set(shard["state"])
        s0 = shard["class_start"]
        lo, hi = max(s0, class_start), min(s0 + shard["num_local"], end)
        if lo < hi:
            pieces.append((lo, hi, {"weight": shard["weight"][lo - s0:hi - s0].clone(),
                                    "state": {k: v[lo - s0:hi - s0].clone() for k, v in shard["state"].items()}}))
    assert saved_classes is not None and dim is not None and state_keys is not None, f"{ckpt_dir}: world_size 0"
    if not 0 <= class_start <= end <= saved_classes:
        raise ValueError(f"rows [{class_start}, {end}) are outside the checkpoint's [0, {saved_classes}) classes "
                         f"({ckpt_dir})")
    pieces.sort(key=lambda p: p[0])
    cursor = class_start
    for lo, hi, _ in pieces:
        if lo != cursor:
            raise ValueError(f"{ckpt_dir}: no head shard holds classes [{cursor}, {lo})")
        cursor = hi
    if cursor != end:
        raise ValueError(f"{ckpt_dir}: no head shard holds classes [{cursor}, {end})")
    weight = torch.cat([p[2]["weight"] for p in pieces]) if pieces else torch.empty(0, dim)  # (num_local, D)
    state = {k: torch.cat([p[2]["state"][k] for p in pieces]) for k in sorted(state_keys)} if pieces else {}
    return {"class_start": class_start, "num_local": num_local, "num_classes": saved_classes,
            "weight": weight, "state": state}


def restore_head(weight: torch.nn.Parameter, optimizer: torch.optim.Optimizer, rows: Mapping[str, Any]) -> None:
    """Copy ``load_head_rows`` output into this rank's head weight and its optimizer state (on weight's device)."""
    if tuple(rows["weight"].shape) != tuple(weight.shape):
        raise ValueError(f"head rows have shape {tuple(rows['weight'].shape)}, this rank's head weight has "
                         f"{tuple(weight.shape)}; was the embedding size changed?")
    with torch.no_grad():
        weight.copy_(rows["weight"].to(device=weight.device, dtype=weight.dtype))
    optimizer.state[weight] = {k: v.to(weight.device) for k, v in rows["state"].items()}
