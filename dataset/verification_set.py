"""Verification sets (LFW, CFP-FP, AgeDB-30, ... as `.bin`): reading them safely, and writing them.

A `.bin` is a pickle of ``(bins, issame_list)``: ``2·P`` encoded images (JPEG/PNG bytes, or numpy uint8
arrays of them), pair ``i`` being ``(bins[2i], bins[2i+1])``, and ``P`` booleans; files written by
Python 2 store the images as ``str``. The files come from the internet, so they are read with an
unpickler that can only build the few types the format needs (bytes, numpy arrays and scalars, bools; an
image array that is not uint8 is refused after unpickling); any other global in the file is refused before
anything from the file runs. A new set is written from a text file of image pairs (``read_pairs``, ``read_images``,
``save_bin``: ``scripts/make_bin.py``). docs/evaluation.md#verification-sets.
"""
from __future__ import annotations

import codecs
import os
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from tqdm import tqdm

from dataset.images import decode, resize
from utils.files import atomic_write, path_problem

__all__ = ["BinData", "BadBinError", "RefusedGlobal", "load_bin", "read_images", "read_pairs", "save_bin",
           "unpickle_bin"]


class BinData(NamedTuple):
    """A verification set as ``load_bin`` returns it. The mirrored copy the flip protocol needs is not
    stored: ``embed(..., flip=True)`` mirrors each batch as it goes, so the set costs one uint8 copy."""

    images: torch.Tensor  # (2P, 3, H, W) uint8 RGB; pair i is rows (2i, 2i+1)
    issame: list[bool]  # (P,)


class BadBinError(ValueError):
    """A `.bin` that cannot be used as a verification set (truncated, not a ``(bins, issame)`` pickle,
    an image that does not decode); the message starts with the file's path."""


class RefusedGlobal(pickle.UnpicklingError):
    """A `.bin` that refers to a Python global other than the few the format needs, or uses an allowed one
    in another way (either could run code); the message starts with the file's path."""


# JPEGs are decoded this many at a time: torchvision's list form amortises the per-call overhead.
_DECODE_CHUNK = 256


def _latin1_encode(text: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """Stand-in for ``_codecs.encode``: Python 3 writes ``bytes`` at protocol <= 2 as
    ``_codecs.encode(text, "latin1")``; only that use is allowed, never an arbitrary codec."""
    if not isinstance(text, str) or codecs.lookup(encoding).name != "iso8859-1":
        raise RefusedGlobal(f"_codecs.encode is only allowed as encode(str, 'latin1') (bytes in a "
                            f"protocol-2 pickle); got encode({type(text).__name__}, {encoding!r})")
    return text.encode("latin-1", errors)


def _numpy_globals() -> dict[tuple[str, str], Any]:
    """The numpy pieces a pickled uint8 array (or numpy bool scalar) refers to, under the module
    names written by numpy 1.x (``numpy.core``) and numpy 2.x (``numpy._core``)."""
    from numpy._core import multiarray  # numpy >= 2; numpy.core is a deprecated alias of it

    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = multiarray._reconstruct
        allowed[(module, "scalar")] = multiarray.scalar
    return allowed


class _BinUnpickler(pickle.Unpickler):
    """Unpickler that admits only the globals a verification `.bin` needs; the file's other globals
    (``os.system``, ``builtins.eval``, ...) are refused instead of being looked up, so no code from the
    file can run."""

    _allowed: dict[tuple[str, str], Any] = {
        **_numpy_globals(),
        ("_codecs", "encode"): _latin1_encode,
        ("builtins", "bytes"): bytes,  # empty bytes at protocol <= 2 are written as bytes()
        ("builtins", "bytearray"): bytearray,
        ("builtins", "bool"): bool,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            allowed = sorted(f"{m}.{n}" for m, n in self._allowed)
            raise RefusedGlobal(
                f"refused global {module}.{name} (a verification .bin holds only encoded "
                f"images and booleans; allowed globals: {', '.join(allowed)})") from None


def unpickle_bin(path: str | os.PathLike) -> Any:
    """The object stored in the `.bin` at ``path`` as it is (not checked to be a verification set), built
    through the restricted unpickler: what ``load_bin`` reads before it checks and decodes.

    Python-2 pickles store images as ``str``; ``encoding="bytes"`` keeps them as bytes (a Python-3 file
    has no such strings, so the option does not change how it reads). ``BadBinError`` naming the file for
    a truncated file or one that is not a pickle; ``RefusedGlobal`` for a file that refers to code.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            return _BinUnpickler(f, encoding="bytes").load()
        except RefusedGlobal as exc:
            raise RefusedGlobal(f"{path}: {exc}") from None
        # Malformed pickle data can fail in any of the constructors it reaches (numpy's included), with
        # any exception type; whatever it is, the file is not a verification set.
        except Exception as exc:  # noqa: BLE001
            # The C unpickler reports running out of data as EOFError or as "pickle data was truncated".
            if isinstance(exc, EOFError) or (isinstance(exc, pickle.UnpicklingError) and "truncated" in str(exc)):
                raise BadBinError(f"{path}: truncated pickle (the file ends after {path.stat().st_size} bytes, "
                                  f"before the pickle does)") from exc
            raise BadBinError(f"{path}: not a verification file (unpickling failed: {type(exc).__name__}: "
                              f"{exc})") from exc


def _as_encoded_tensor(item: Any, path: Path, index: int) -> torch.Tensor:
    """One encoded image of the file as a 1-D uint8 tensor (no copy for bytes/uint8 arrays)."""
    if isinstance(item, (bytes, bytearray)):
        buf = np.frombuffer(item, dtype=np.uint8)
    elif isinstance(item, np.ndarray) and item.dtype == np.uint8:
        buf = item.reshape(-1)
    else:
        kind = f"ndarray of {item.dtype}" if isinstance(item, np.ndarray) else type(item).__name__
        raise BadBinError(f"{path}: not a verification file: image {index} is a {kind}; expected JPEG/PNG "
                          f"bytes or a uint8 array of them")
    if buf.size == 0:
        raise BadBinError(f"{path}: image {index} is empty (0 bytes)")
    if buf.flags.writeable:
        return torch.from_numpy(buf)
    # A view of the pickle's bytes, not a copy: copies of every encoded image would stay on the heap after
    # loading (freed, but kept by malloc). torch warns that the buffer is read-only; the decoder only reads it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(buf)


def _decode_into(out: torch.Tensor, encoded: list[torch.Tensor], start: int, source: str | Path) -> None:
    """Decode ``encoded`` into ``out[start:start+len(encoded)]`` (uint8 (N, 3, H, W), preallocated so that
    no second copy of the whole set exists at any time); ``BadBinError`` naming ``source`` and the image."""
    image_size = (out.shape[2], out.shape[3])
    jpeg = all(e.numel() > 2 and e[0] == 0xFF and e[1] == 0xD8 for e in encoded)
    try:
        if jpeg:
            images = decode_jpeg(encoded, mode=ImageReadMode.RGB)  # list of (3, h, w)
        else:
            images = [decode_image(e, mode=ImageReadMode.RGB) for e in encoded]
    except RuntimeError as exc:
        # Find the image that failed so the message can point at it.
        for i, e in enumerate(encoded):
            try:
                decode_image(e, mode=ImageReadMode.RGB)
            except RuntimeError as inner:
                raise BadBinError(f"{source}: image {start + i} cannot be decoded: {inner}") from inner
        raise BadBinError(f"{source}: images {start}..{start + len(encoded) - 1} cannot be decoded: {exc}") from exc
    for i, image in enumerate(images):
        if tuple(image.shape[1:]) != image_size:
            image = resize(image, image_size)
        out[start + i] = image


def load_bin(path: str | os.PathLike, image_size: tuple[int, int] = (112, 112)) -> BinData:
    """Read a verification `.bin`: ``BinData(images uint8 (2·P, 3, H, W) RGB, issame: P bools)``.

    ``images`` is the only copy of the decoded set (resized where not ``image_size`` (H, W)); the encoded bytes
    are released chunk by chunk as they are decoded (``bench/bin_memory.py`` measures what stays resident).
    ``FileNotFoundError`` for a missing file, ``BadBinError`` (a ``ValueError``, starting with the path) for a
    truncated or malformed file or an image that does not decode, ``RefusedGlobal`` (a
    ``pickle.UnpicklingError``) for a file that refers to anything but bytes, numpy arrays and bools.
    """
    path = Path(path)
    if (problem := path_problem(path)) is not None:
        raise FileNotFoundError(f"verification file {problem}: {path}")
    obj = unpickle_bin(path)
    if not (isinstance(obj, tuple) and len(obj) == 2):
        raise BadBinError(f"{path}: not a verification file: expected a pickled 2-tuple (bins, issame_list), got "
                          f"{type(obj).__name__}"
                          + (f" of length {len(obj)}" if isinstance(obj, (tuple, list)) else ""))
    bins, issame = obj
    if not all(isinstance(x, (list, tuple)) for x in (bins, issame)):
        raise BadBinError(f"{path}: not a verification file: expected (list of images, list of booleans), got "
                          f"({type(bins).__name__}, {type(issame).__name__})")
    issame = [bool(x) for x in issame]
    if len(bins) != 2 * len(issame):
        raise BadBinError(f"{path}: {len(bins)} images for {len(issame)} pairs; expected 2 images per pair "
                          f"({2 * len(issame)})")
    bins = list(bins)  # a mutable list of references, so that decoded entries can be dropped
    del obj
    images = torch.empty((len(bins), 3, *image_size), dtype=torch.uint8)  # (2P, 3, H, W)
    for start in range(0, len(bins), _DECODE_CHUNK):
        stop = min(start + _DECODE_CHUNK, len(bins))
        _decode_into(images, [_as_encoded_tensor(bins[i], path, i) for i in range(start, stop)], start, path)
        bins[start:stop] = [None] * (stop - start)  # the encoded bytes are not needed any more
    del bins
    return BinData(images, issame)


def save_bin(path: str | os.PathLike, images: Sequence[bytes], issame: Sequence[bool]) -> None:
    """Write a verification `.bin` that ``load_bin`` (and the reference reader) can read.

    ``images`` holds 2·P encoded images (JPEG/PNG bytes), pair ``i`` = ``(images[2i], images[2i+1])``;
    ``issame`` holds P bools. Written with pickle protocol 4 through ``utils.files.atomic_write``, so an
    interrupted write never leaves a truncated file at ``path``; the file's mode follows the umask like any
    other new file.
    """
    path = Path(path)
    images = [bytes(im) for im in images]
    issame = [bool(x) for x in issame]
    if len(images) != 2 * len(issame):
        raise ValueError(f"save_bin({path}): {len(images)} images for {len(issame)} pairs; expected "
                         f"{2 * len(issame)} (2 per pair)")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: pickle.dump((images, issame), f, protocol=4))


def read_pairs(pairs_file: Path, root: Path) -> list[tuple[Path, Path, bool]]:
    """The pairs of a text file, one ``path1 path2 0|1`` per line (1: the same identity; blank lines and lines
    starting with ``#`` skipped; relative paths from ``root``); ``ValueError`` naming the file and line for a
    malformed line or a missing image."""
    pairs = []
    if (problem := path_problem(pairs_file)) is not None:
        raise ValueError(f"pairs file {problem}: {pairs_file}")
    try:
        text = pairs_file.read_text()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{pairs_file}: not a text file of pairs ({exc})") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 3 or fields[2] not in ("0", "1"):
            raise ValueError(f"{pairs_file}:{lineno}: expected 'path1 path2 0|1', got {line.strip()!r}")
        a, b = (p if p.is_absolute() else root / p for p in (Path(fields[0]), Path(fields[1])))
        for p in (a, b):
            if (problem := path_problem(p)) is not None:
                raise ValueError(f"{pairs_file}:{lineno}: image {problem}: {p}")
        pairs.append((a, b, fields[2] == "1"))
    if not pairs:
        raise ValueError(f"{pairs_file}: no pairs (every line is blank or a comment)")
    return pairs


def read_images(paths: Sequence[Path], desc: str = "decoding") -> tuple[dict[Path, bytes], list[str]]:
    """The bytes of every file in ``paths``, each decoded once with the decoder training and verification use, and
    one ``"path: reason"`` per file that does not decode; ``ValueError`` for a file that cannot be read."""
    data: dict[Path, bytes] = {}
    bad = []
    for path in tqdm(paths, desc=desc, unit="img", disable=None):
        if path in data:
            continue
        try:
            data[path] = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        try:
            decode(data[path], str(path))
        except ValueError as exc:
            bad.append(str(exc))
    return data, bad
