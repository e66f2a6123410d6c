"""Files: the one atomic write and the one safe ``torch.load`` of the project.

``atomic_write`` writes through ``<name>.tmp``, fsyncs, renames and fsyncs the folder: a reader sees the old
file or the new one, never half of one, and a failed write leaves neither a partial file nor its ``.tmp``.
``staged`` writes the files of a folder where no reader sees them half-written. ``load_tensors`` reads with
``torch.load(weights_only=True)``: a file holding anything but tensors, numbers, strings, lists and dicts is
refused instead of run. ``load_state_dict`` / ``load_weights`` read
backbone weights (ours or the official insightface files) with one clear error on a mismatch.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

__all__ = ["atomic_write", "fsync_dir", "load_state_dict", "load_tensors", "load_weights", "path_problem",
           "save_atomic", "staged", "unopenable_files"]

NOT_FOUND = "not found"  # path_problem's word for a path with nothing there


def path_problem(path: str | os.PathLike, folder: bool = False) -> str | None:
    """Why ``path`` cannot be opened as a file (``folder``: as a folder), in words that follow a noun in an
    error message ("not found", "is a folder, not a file", "is a file, not a folder"); None when it can."""
    path = Path(path)
    if folder:
        return None if path.is_dir() else "is a file, not a folder" if path.exists() else NOT_FOUND
    return None if path.is_file() else "is a folder, not a file" if path.is_dir() else NOT_FOUND


def unopenable_files(paths: Iterable[Path]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Of ``paths`` that should be files: those not found, and the others that cannot be opened as files, each
    with its ``path_problem`` ("is a folder, not a file"), both in the order given; two empty lists when all can."""
    problems = [(path, path_problem(path)) for path in paths]
    return ([path for path, why in problems if why == NOT_FOUND],
            [(path, why) for path, why in problems if why not in (None, NOT_FOUND)])


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or file creation inside ``path`` durable (the directory entry itself is flushed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """``write(f)`` into ``<path>.tmp`` (binary), fsync, rename to ``path``, fsync the folder.

    On any failure ``path`` keeps its old content and no ``.tmp`` is left; the error propagates.
    """
    path = Path(path)
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
        if not written:
            tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


@contextmanager
def staged(target: str | os.PathLike, last: Sequence[str] = ()) -> Iterator[Path]:
    """Yield an empty staging folder; when the block ends without an error, what was written into it becomes
    ``target``'s, and whatever ends the block (an error, Ctrl-C, SIGTERM as ``utils.cli.Terminated``) the staging
    folder is gone.

    A ``target`` that does not exist yet appears whole, by one rename of the staging folder (made beside it). Into
    an existing folder each entry moves by one rename (an entry of the same name is replaced), those named in
    ``last`` after the others (a stamp that says the rest is complete), so each file is old or new, never half
    written. Either way the folder's entry is fsynced.
    """
    target = Path(target)
    new = not target.exists()
    parent = target.parent if new else target
    parent.mkdir(parents=True, exist_ok=True)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", suffix=".tmp", dir=parent))
    except OSError as exc:  # the error names the folder asked for, not the staging folder's random name
        raise OSError(exc.errno, f"cannot write {target}: {exc.strerror}") from None
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # as mkdir would make it: mkdtemp's 0700 would become the target's
    try:
        yield staging
        if new:
            os.rename(staging, target)
        else:
            names = sorted(entry.name for entry in staging.iterdir())
            for name in [n for n in names if n not in last] + [n for n in last if n in names]:
                if (target / name).is_dir() and not (target / name).is_symlink():
                    shutil.rmtree(target / name)  # a folder is replaced whole
                os.replace(staging / name, target / name)
        fsync_dir(parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_atomic(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically (``atomic_write``); creates the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(obj, f))


def load_tensors(path: str | os.PathLike, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; refuses files holding anything but plain data.

    Raises ``ValueError`` naming the file when it is missing, holds objects that loading could run code
    from (a pickle that imports or calls), or cannot be read.
    """
    path = Path(path)
    if (problem := path_problem(path)) is not None:
        raise ValueError(f"{path}: {'no such file' if problem == 'not found' else problem}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{path}: refused: the file holds objects other than tensors, numbers, strings, lists "
                         f"and dicts, and loading it could run code, or it is not a torch file "
                         f"({_unpickler_detail(exc)})") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise ValueError(f"{path}: cannot be read as a torch file "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


# The sentences around the detail in torch's weights-only errors (torch 2.6 to 2.14).
_TORCH_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _unpickler_detail(exc: BaseException) -> str:
    """What torch's weights-only unpickler objected to (``Trying to load unsupported GLOBAL posix.system ...``), without
    the advice around it (torch suggests ``weights_only=False``, which would run the file's code)."""
    for line in (line.strip() for line in str(exc).splitlines()):
        if line.startswith(_TORCH_ADVICE):  # "... WeightsUnpickler error: <detail>" may end one of them
            line = line.split("WeightsUnpickler error:", 1)[1].strip() if "WeightsUnpickler error:" in line else ""
        if line:
            return line
    return type(exc).__name__


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state_dict in ``path``; a checkpoint dict holding it under "backbone" (ours) or "state_dict_backbone"
    (arcface_torch's ``checkpoint_gpu_<rank>.pt``) is accepted too, and a DDP ``module.`` prefix is removed."""
    state = load_tensors(path)
    for key in ("backbone", "state_dict_backbone"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state_dict (a dict of tensors), got {type(state).__name__}")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_weights(model: nn.Module, path: str | os.PathLike, network: str = "") -> nn.Module:
    """Load ``path`` into ``model`` with ``strict=True``; a mismatch raises one ``ValueError`` line."""
    state = load_state_dict(path)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
             if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        parts = []
        for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", wrong)):
            if items:
                parts.append(f"{len(items)} {label} (e.g. {', '.join(items[:3])})")
        raise ValueError(f"{path} does not match network {network or type(model).__name__}: " + "; ".join(parts))
    model.load_state_dict(state, strict=True)
    return model
