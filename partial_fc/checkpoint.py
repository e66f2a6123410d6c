"""A head's shard in a checkpoint, and the rows of any other partition read back from the saved shards.

Each rank saves ``head_shard``: its weight rows and the head optimizer's row-wise state (every tensor with first
dimension ``num_local``). ``load_head_rows`` reads the rows of any class range from whichever saved shards overlap
it, so a checkpoint written by one world size resumes on any other; ``restore_head`` puts them into this rank's
weight and optimizer. The files themselves are ``utils.checkpoint``'s (``head_file``, the manifest).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from utils.checkpoint import head_file, read_manifest
from utils.files import load_tensors

__all__ = ["HEAD_KEYS", "head_shard", "load_head_rows", "restore_head"]

HEAD_KEYS = ("class_start", "num_local", "num_classes", "weight", "state")


def head_shard(weight: torch.Tensor, state: Mapping[str, torch.Tensor], class_start: int,
               num_classes: int) -> dict[str, Any]:
    """One rank's head: weight rows (num_local, K·D) for classes [class_start, class_start + num_local) and the
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


def _check_shard(shard: Any, path: Path) -> None:
    if not isinstance(shard, dict) or [k for k in HEAD_KEYS if k not in shard]:
        keys = sorted(shard) if isinstance(shard, dict) else type(shard).__name__
        raise ValueError(f"{path}: holds {keys}; expected a head shard with keys {list(HEAD_KEYS)}")
    n, weight = shard["num_local"], shard["weight"]
    if weight.dim() != 2 or weight.shape[0] != n:
        raise ValueError(f"{path}: weight has shape {tuple(weight.shape)}; expected ({n}, K·D): one row per class, "
                         f"its K centres side by side")
    for key, value in shard["state"].items():
        if value.dim() == 0 or value.shape[0] != n:
            raise ValueError(f"{path}: optimizer state {key!r} has shape {tuple(value.shape)}; expected first "
                             f"dimension num_local = {n}")


def load_head_rows(ckpt_dir: str | os.PathLike, class_start: int, num_local: int, *,
                   num_classes: int | None = None) -> dict[str, Any]:
    """Weight and optimizer-state rows for classes [class_start, class_start + num_local), from whichever saved
    shards overlap them: a checkpoint written by any world size can be loaded by any other.

    ``num_classes``: the current config's value, checked against the checkpoint's. Returns
    ``{"class_start", "num_local", "num_classes", "weight": (num_local, K·D), "state": {key: (num_local, ...)}}``.
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
        shard = load_tensors(path, mmap=True)  # memory-mapped: only the overlapping rows are read from disk
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
    weight = torch.cat([p[2]["weight"] for p in pieces]) if pieces else torch.empty(0, dim)  # (num_local, K·D)
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
