"""Face verification on the `.bin` pair sets (LFW, CFP-FP, AgeDB-30, ...): reading, writing, scoring.

The `.bin` format (see FORMATS.md) is a pickle of ``(bins, issame_list)``: ``2·P`` encoded images, pair
``i`` being ``(bins[2i], bins[2i+1])``, and ``P`` booleans. The files come from the internet, so they are
read with an unpickler that can only build the few types the format needs (bytes, numpy uint8 arrays,
bools); any other global in the file is refused before anything from the file runs.

The scoring protocol is the one the published LFW/CFP-FP/AgeDB-30 numbers use: squared L2 distance of
L2-normalised embeddings, 10 unshuffled folds, the accuracy threshold picked on the training folds, and
the validation rate at a false-accept rate of 1e-3.
"""
from __future__ import annotations

import codecs
import ctypes
import os
import pickle
import secrets
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
from sklearn.decomposition import PCA
from sklearn.model_selection import KFold
from torch import nn
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

__all__ = ["BinData", "BadBinError", "RefusedGlobal", "load_bin", "save_bin", "evaluate", "calculate_roc",
           "calculate_val", "embed", "test", "format_table"]


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


def _read_pickle(path: Path) -> Any:
    """The object in the pickle at ``path``, built through ``_BinUnpickler``.

    Python-2 pickles store images as ``str``; ``encoding="bytes"`` keeps them as bytes (a Python-3 file
    has no such strings, so the option does not change how it reads). ``BadBinError`` naming the file for
    a truncated file or one that is not a pickle; ``RefusedGlobal`` for a file that refers to code.
    """
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


def _resize(image: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """uint8 (3, h, w) -> uint8 (3, H, W), bilinear with antialiasing (only for files whose images are
    not already ``image_size``)."""
    out = torch.nn.functional.interpolate(image[None].float(), size=image_size, mode="bilinear",
                                          align_corners=False, antialias=True)  # (1, 3, H, W)
    return out[0].round_().clamp_(0, 255).to(torch.uint8)


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
            image = _resize(image, image_size)
        out[start + i] = image


def load_bin(path: str | os.PathLike, image_size: tuple[int, int] = (112, 112)) -> BinData:
    """Read a verification `.bin`; return ``BinData(images, issame)``.

    ``images`` is a uint8 tensor (2·P, 3, H, W), RGB, the only copy of the decoded set (the flip protocol
    mirrors batches when it embeds them); ``issame`` holds P Python bools. Images whose size differs from
    ``image_size`` (H, W) are resized. The encoded bytes are released chunk by chunk as they are decoded
    and the freed heap is handed back to the OS, so what stays resident is about that one copy
    (``bench/bin_memory.py`` measures it). Raises ``FileNotFoundError`` for a missing file, ``BadBinError``
    (a ``ValueError``) whose message starts with the path for a truncated or malformed file or an image
    that does not decode, and ``RefusedGlobal`` (a ``pickle.UnpicklingError``) for a file that refers to
    anything other than bytes, numpy arrays and bools.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"verification file not found: {path}")
    obj = _read_pickle(path)
    if not (isinstance(obj, tuple) and len(obj) == 2):
        raise BadBinError(f"{path}: not a verification file: expected a pickled 2-tuple (bins, issame_list), got "
                          f"{type(obj).__name__}" + (f" of length {len(obj)}" if isinstance(obj, (tuple, list)) else ""))
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
    _release_freed_heap()
    return BinData(images, issame)


def _release_freed_heap() -> None:
    """Hand the heap freed by the encoded bytes back to the OS (glibc ``malloc_trim``).

    glibc returns freed heap to the OS only from the top of the heap; the pickle's thousands of small
    bytes objects lie between longer-lived allocations, so without this about the size of the file stays
    resident after loading (measured: 1.15x one uint8 copy instead of 1.00x for LFW-sized JPEGs). A no-op
    where the C library has no ``malloc_trim`` (macOS, musl, Windows).
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return
    trim(0)


def save_bin(path: str | os.PathLike, images: Sequence[bytes], issame: Sequence[bool]) -> None:
    """Write a verification `.bin` that ``load_bin`` (and the reference reader) can read.

    ``images`` holds 2·P encoded images (JPEG/PNG bytes), pair ``i`` = ``(images[2i], images[2i+1])``;
    ``issame`` holds P bools. Written with pickle protocol 4 to a temporary file that is then renamed,
    so an interrupted write never leaves a truncated file at ``path``; the file's mode follows the umask
    like any other new file.
    """
    path = Path(path)
    images = [bytes(im) for im in images]
    issame = [bool(x) for x in issame]
    if len(images) != 2 * len(issame):
        raise ValueError(f"save_bin({path}): {len(images)} images for {len(issame)} pairs; expected "
                         f"{2 * len(issame)} (2 per pair)")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkstemp: it creates the file 0600 whatever the umask, and the rename would keep that mode.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump((images, issame), f, protocol=4)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _l2_normalise(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` divided by their L2 norm (rows of zeros stay zero), in float64."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1.0, norms)


def _accept_counts(thresholds: np.ndarray, dist: np.ndarray, issame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every threshold t: how many same pairs and how many different pairs have ``dist < t``.
    Counting by binary search in the sorted distances gives the same integers as comparing every pair
    with every threshold, in O((P + T) log P)."""
    thresholds = np.atleast_1d(np.asarray(thresholds, dtype=np.float64))
    same = np.searchsorted(np.sort(dist[issame]), thresholds, side="left")  # (T,) true accepts
    diff = np.searchsorted(np.sort(dist[~issame]), thresholds, side="left")  # (T,) false accepts
    return same, diff


def _safe_rate(count: np.ndarray, total: int) -> np.ndarray:
    """count / total, 0 where there is nothing to count (a fold without positive or negative pairs)."""
    return count / total if total > 0 else np.zeros(count.shape)


def _roc_rates(thresholds: np.ndarray, dist: np.ndarray, issame: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tpr, fpr, accuracy) per threshold when pairs with ``dist < threshold`` are called "same"."""
    tp, fp = _accept_counts(thresholds, dist, issame)
    n_same, n_diff = int(issame.sum()), int((~issame).sum())
    tn = n_diff - fp
    return _safe_rate(tp, n_same), _safe_rate(fp, n_diff), (tp + tn) / dist.size


def _val_far(thresholds: np.ndarray, dist: np.ndarray, issame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(validation rate, false-accept rate) per threshold when pairs with ``dist < threshold`` are accepted."""
    true_accept, false_accept = _accept_counts(thresholds, dist, issame)
    return _safe_rate(true_accept, int(issame.sum())), _safe_rate(false_accept, int((~issame).sum()))


def _pairs(embeddings: np.ndarray, actual_issame: Sequence[bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Embeddings of the first and second image of every pair (rows 2i, 2i+1), and the labels."""
    embeddings = np.asarray(embeddings)
    issame = np.asarray(actual_issame, dtype=bool)
    if issame.size < 2:
        raise ValueError(f"{issame.size} pairs; the k-fold protocol needs at least 2")
    if embeddings.ndim != 2 or embeddings.shape[0] != 2 * issame.size:
        raise ValueError(f"embeddings of shape {embeddings.shape} for {issame.size} pairs; expected "
                         f"({2 * issame.size}, D): rows 2i and 2i+1 form pair i")
    return embeddings[0::2], embeddings[1::2], issame


def _check_folds(nrof_folds: int, pairs: int) -> None:
    if not 2 <= nrof_folds <= pairs:
        raise ValueError(f"nrof_folds={nrof_folds} for {pairs} pairs; allowed: 2 <= nrof_folds <= pairs")


def _squared_distance(emb1: np.ndarray, emb2: np.ndarray) -> np.ndarray:
    return np.sum(np.square(_l2_normalise(emb1) - _l2_normalise(emb2)), axis=1)  # (P,)


def calculate_roc(embeddings: np.ndarray, actual_issame: Sequence[bool], nrof_folds: int = 10,
                  pca: int = 0, thresholds: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """k-fold accuracy of the pairs in ``embeddings`` (2·P, D).

    For each of ``nrof_folds`` unshuffled folds, the threshold with the best accuracy on the other folds
    is applied to the fold. With ``pca > 0`` a PCA of that many components is fitted on the training
    folds' embeddings (both images of every pair) and the distances are taken in its space.
    Returns ``(tpr, fpr, accuracy, best_thresholds)``: TPR and FPR per threshold (thresholds
    ``arange(0, 4, 0.01)`` unless given) averaged over the folds, and accuracy and the chosen threshold
    per fold.
    """
    emb1, emb2, issame = _pairs(embeddings, actual_issame)
    _check_folds(nrof_folds, issame.size)
    if thresholds is None:
        thresholds = np.arange(0, 4, 0.01)
    folds = KFold(n_splits=nrof_folds, shuffle=False)
    tprs = np.zeros((nrof_folds, len(thresholds)))
    fprs = np.zeros((nrof_folds, len(thresholds)))
    accuracy = np.zeros(nrof_folds)
    best_thresholds = np.zeros(nrof_folds)
    dist = _squared_distance(emb1, emb2) if pca == 0 else None
    for fold, (train, test_) in enumerate(folds.split(np.arange(issame.size))):
        if pca > 0:
            projection = PCA(n_components=pca).fit(np.concatenate([emb1[train], emb2[train]]))
            dist = _squared_distance(projection.transform(emb1), projection.transform(emb2))
        assert dist is not None
        best = int(np.argmax(_roc_rates(thresholds, dist[train], issame[train])[2]))
        tprs[fold], fprs[fold], acc_test = _roc_rates(thresholds, dist[test_], issame[test_])
        accuracy[fold] = acc_test[best]
        best_thresholds[fold] = thresholds[best]
    return tprs.mean(axis=0), fprs.mean(axis=0), accuracy, best_thresholds


def calculate_val(embeddings: np.ndarray, actual_issame: Sequence[bool], far_target: float = 1e-3,
                  nrof_folds: int = 10) -> tuple[float, float, float]:
    """Validation rate at a false-accept rate of ``far_target``: ``(val_mean, val_std, far_mean)``.

    Per fold, the threshold (grid ``arange(0, 4, 0.001)``) where the training folds reach
    ``far_target`` is found by linear interpolation of the training FAR curve, or 0 when the training
    folds never reach it; VAL and FAR are then measured on the fold. ``np.interp`` is used because the
    FAR curve repeats values (flat stretches), which SciPy's current ``interp1d`` rejects; on the same
    curve it gives the threshold the published numbers were computed with.
    """
    emb1, emb2, issame = _pairs(embeddings, actual_issame)
    _check_folds(nrof_folds, issame.size)
    thresholds = np.arange(0, 4, 0.001)
    dist = _squared_distance(emb1, emb2)
    val = np.zeros(nrof_folds)
    far = np.zeros(nrof_folds)
    for fold, (train, test_) in enumerate(KFold(n_splits=nrof_folds, shuffle=False).split(np.arange(issame.size))):
        far_train = _val_far(thresholds, dist[train], issame[train])[1]  # (T,), non-decreasing
        threshold = float(np.interp(far_target, far_train, thresholds)) if far_train.max() >= far_target else 0.0
        val_fold, far_fold = _val_far(np.array([threshold]), dist[test_], issame[test_])
        val[fold], far[fold] = val_fold[0], far_fold[0]
    return float(val.mean()), float(val.std()), float(far.mean())


def evaluate(embeddings: np.ndarray, actual_issame: Sequence[bool], nrof_folds: int = 10, pca: int = 0
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float, float]:
    """The published verification protocol on ``embeddings`` (2·P, D), pairs in rows (2i, 2i+1).

    Returns ``(tpr, fpr, accuracy, val, val_std, far)``: the k-fold ROC (``calculate_roc``), the accuracy
    of every fold, and VAL ± std at FAR = 1e-3 with the FAR reached (``calculate_val``).
    """
    tpr, fpr, accuracy, _ = calculate_roc(embeddings, actual_issame, nrof_folds=nrof_folds, pca=pca)
    val, val_std, far = calculate_val(embeddings, actual_issame, 1e-3, nrof_folds=nrof_folds)
    return tpr, fpr, accuracy, val, val_std, far


def _device_of(module: nn.Module) -> torch.device:
    """The device of the module's first parameter or buffer; the CPU for a module that has none
    (e.g. a wrapper around an ONNX Runtime session)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def embed(images: torch.Tensor, backbone: nn.Module, batch_size: int,
          progress: Callable[[int], None] | None = None, flip: bool = False) -> np.ndarray:
    """Embeddings (N, D) float64 of uint8 ``images`` (N, 3, H, W), batch by batch.

    Each batch is moved to the backbone's device, mirrored left-right there when ``flip`` is set, and
    normalised as (x - 127.5) / 127.5, so neither a mirrored nor a float copy of the whole set is ever
    made; the backbone sees the same values as from a stored mirrored copy. ``progress(n)`` is called after
    each batch of n images. The caller sets eval mode and ``no_grad``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = _device_of(backbone)
    out: np.ndarray | None = None
    for start in range(0, images.shape[0], batch_size):
        batch = images[start:start + batch_size].to(device, non_blocking=True)  # (B, 3, H, W) uint8
        if flip:
            batch = torch.flip(batch, dims=[3])  # (B, 3, H, W), contiguous like a slice of a flipped copy
        x = (batch.float() - 127.5) / 127.5  # (B, 3, H, W) in [-1, 1]
        feats = backbone(x).float().cpu().numpy()  # (B, D)
        if out is None:
            # float64 like the reference, so that sums and norms round the same way.
            out = np.zeros((images.shape[0], feats.shape[1]), dtype=np.float64)
        out[start:start + feats.shape[0]] = feats
        if progress is not None:
            progress(feats.shape[0])
    if out is None:
        raise ValueError("no images to embed (0 rows)")
    return out


def test(data_set: BinData, backbone: nn.Module, batch_size: int, nfolds: int = 10,
         progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Verification scores of ``backbone`` on ``data_set = BinData(images, issame)`` from ``load_bin``.

    The embedding of an image is the sum of the embeddings of the image and of its mirror image (the
    published "flip" protocol; the mirror images are made batch by batch). Runs in eval mode under ``torch.no_grad()`` and restores the backbone's
    previous training mode. Returns a dict with ``acc``, ``acc_std`` (mean/std over folds, flip),
    ``acc_noflip``, ``val``, ``val_std``, ``far`` (at FAR=1e-3, flip), ``xnorm`` (mean L2 norm of the
    un-normalised embeddings of both copies), ``threshold`` (best distance threshold, mean over folds),
    ``pairs``, and the ROC arrays ``fpr``, ``tpr`` (flip, mean over folds, thresholds 0..4 step 0.01).
    ``progress(n)`` is called after every batch of n images (2·2·P images in all).
    """
    images, issame = data_set
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(f"data_set must be BinData(images, issame) from load_bin with images a uint8 "
                         f"(2P, 3, H, W) tensor; got images of type {type(images).__name__}")
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad():
            original, flipped = (embed(images, backbone, batch_size, progress, flip=f)
                                 for f in (False, True))  # (2P, D) each
    finally:
        backbone.train(was_training)
    xnorm = float(np.mean(np.linalg.norm(np.concatenate([original, flipped]), axis=1)))
    _, _, acc_noflip, _, _, _ = evaluate(original, issame, nrof_folds=nfolds)
    summed = original + flipped  # (2P, D)
    tpr, fpr, accuracy, thresholds = calculate_roc(summed, issame, nrof_folds=nfolds)
    val, val_std, far = calculate_val(summed, issame, 1e-3, nrof_folds=nfolds)
    return {
        "pairs": len(issame),
        "acc": float(accuracy.mean()),
        "acc_std": float(accuracy.std()),
        "acc_noflip": float(acc_noflip.mean()),
        "val": val,
        "val_std": val_std,
        "far": far,
        "xnorm": xnorm,
        "threshold": float(thresholds.mean()),
        "fpr": fpr,
        "tpr": tpr,
    }


def format_table(results: dict[str, dict[str, Any]], best: dict[str, float] | None = None) -> list[str]:
    """The verification table (header, then one row per target) of ``test()`` results, as both the
    training log and ``python -m eval.verify`` print it: every rate a fraction, VAL followed by the FAR
    it actually reached (a set with few different pairs cannot reach FAR = 1e-3; its VAL is then at the
    FAR shown). ``best`` adds the best flip accuracy so far per target (the training log's column)."""
    header = (f"{'target':<12} {'pairs':>6} {'acc (flip) ± std':>17} {'no-flip':>8} "
              + (f"{'best':>8} " if best is not None else "")
              + f"{'VAL@FAR=1e-3 ± std':>18} {'FAR reached':>11} {'XNorm':>8} {'thresh':>7}")
    rows = [header]
    for target, r in results.items():
        rows.append(f"{target:<12} {r['pairs']:>6} {r['acc']:>8.5f}±{r['acc_std']:<8.5f} {r['acc_noflip']:>8.5f} "
                    + (f"{best[target]:>8.5f} " if best is not None else "")
                    + f"{r['val']:>9.5f}±{r['val_std']:<8.5f} {r['far']:>11.5f} {r['xnorm']:>8.3f} "
                    f"{r['threshold']:>7.3f}")
    return rows
