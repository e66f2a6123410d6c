"""Face verification on pair sets (LFW, CFP-FP, AgeDB-30, ...): the published protocol, ``test()``, and ``embed``,
the one way every tool (verify, IJB, inference, compare, overlap, an ONNX model as a torch one) embeds face crops.

The protocol the published numbers use: squared L2 distance of L2-normalised embeddings, 10 unshuffled
folds, the accuracy threshold picked on the training folds, and the validation rate at a false-accept
rate of 1e-3; with the "flip" protocol an image's embedding is the sum of the embeddings of the image and
of its mirror image (``embed(flip=True)``).

The `.bin` reader and writer live with the data (``dataset.verification_set``); ``load_bin``, ``save_bin`` and
their types are re-exported here. The table and its units: docs/evaluation.md#verification-sets.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dataset.images import normalise
from dataset.verification_set import BadBinError, BinData, RefusedGlobal, load_bin, save_bin, unpickle_bin
from eval.model_source import device_of
from utils.files import unopenable_files

__all__ = ["BinData", "BadBinError", "RefusedGlobal", "load_bin", "save_bin", "unpickle_bin", "evaluate",
           "calculate_roc", "calculate_val", "check_bin_files", "embed", "test", "format_table"]


def check_bin_files(paths: Iterable[Path]) -> None:
    """``FileNotFoundError`` naming, in one line, every one of ``paths`` that is missing or cannot be opened as a
    file (a folder): what a tool says before it loads anything."""
    missing, unusable = unopenable_files(paths)
    if missing or unusable:
        raise FileNotFoundError("; ".join(
            ([f"verification file(s) not found: {', '.join(map(str, missing))}"] if missing else [])
            + [f"verification file {why}: {p}" for p, why in unusable]))


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


def _folds(n: int, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(training, test) indices of ``k`` unshuffled folds of ``range(n)``: the test folds are consecutive, the
    first ``n % k`` of them one longer (sklearn's ``KFold(k, shuffle=False)``, without sklearn's import, which
    slows every process's start-up: only the PCA option imports it)."""
    bounds = np.cumsum([0] + [n // k + (i < n % k) for i in range(k)])
    index = np.arange(n)
    return [(np.concatenate([index[:a], index[b:]]), index[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def calculate_roc(embeddings: np.ndarray, actual_issame: Sequence[bool], nrof_folds: int = 10,
                  pca: int = 0, thresholds: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """k-fold accuracy of the pairs in ``embeddings`` (2·P, D): ``(tpr, fpr, accuracy, best_thresholds)``.

    Each of ``nrof_folds`` unshuffled folds is scored at the threshold (grid ``arange(0, 4, 0.01)`` unless given)
    with the best accuracy on the other folds; TPR and FPR per threshold are averaged over the folds, accuracy and
    threshold are per fold. ``pca > 0``: distances in a PCA of that many components fitted on the training folds.
    """
    emb1, emb2, issame = _pairs(embeddings, actual_issame)
    _check_folds(nrof_folds, issame.size)
    if thresholds is None:
        thresholds = np.arange(0, 4, 0.01)
    tprs = np.zeros((nrof_folds, len(thresholds)))
    fprs = np.zeros((nrof_folds, len(thresholds)))
    accuracy = np.zeros(nrof_folds)
    best_thresholds = np.zeros(nrof_folds)
    dist = _squared_distance(emb1, emb2) if pca == 0 else None
    for fold, (train, test_) in enumerate(_folds(issame.size, nrof_folds)):
        if pca > 0:
            from sklearn.decomposition import PCA

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

    Per fold, the threshold (grid ``arange(0, 4, 0.001)``) where the training folds' FAR curve reaches
    ``far_target``, linearly interpolated (0 when it never does), gives the fold's VAL and FAR. ``np.interp``,
    because the curve has flat stretches that SciPy's ``interp1d`` rejects; it gives the published threshold.
    """
    emb1, emb2, issame = _pairs(embeddings, actual_issame)
    _check_folds(nrof_folds, issame.size)
    thresholds = np.arange(0, 4, 0.001)
    dist = _squared_distance(emb1, emb2)
    val = np.zeros(nrof_folds)
    far = np.zeros(nrof_folds)
    for fold, (train, test_) in enumerate(_folds(issame.size, nrof_folds)):
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


def embed(images: torch.Tensor, backbone: nn.Module, batch_size: int, *, flip: bool,
          progress: Callable[[int], None] | None = None) -> np.ndarray:
    """The embeddings (N, D) float64 of uint8 face crops ``images`` (N, 3, H, W): the one way every tool embeds
    a face. ``flip=True``: each crop's embedding plus its mirror image's (the verification protocol's); False:
    the crop's alone. Batch by batch on the backbone's device, mirrored there, in eval mode under ``no_grad`` (the
    mode restored after); ``progress(n)`` after each batch of n images of each copy (2N in all with ``flip``).
    """
    original, *mirrored = _embed_copies(images, backbone, batch_size, (False, True) if flip else (False,), progress)
    return original + mirrored[0] if flip else original


def _embed_copies(images: torch.Tensor, backbone: nn.Module, batch_size: int, mirrors: tuple[bool, ...],
                  progress: Callable[[int], None] | None) -> list[np.ndarray]:
    """One (N, D) float64 array per entry of ``mirrors``: the embeddings of ``images`` (False) or of their mirror
    images (True), each batch normalised on the device (``dataset.images.normalise``), so neither a mirrored nor
    a float copy of the whole set is made; the backbone sees the values of a stored mirrored copy."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if images.shape[0] == 0:
        raise ValueError("no images to embed (0 rows)")
    device = device_of(backbone)
    was_training = backbone.training
    backbone.eval()
    copies = []
    try:
        with torch.no_grad():
            for mirror in mirrors:
                out: np.ndarray | None = None
                for start in range(0, images.shape[0], batch_size):
                    batch = images[start:start + batch_size].to(device, non_blocking=True)  # (B, 3, H, W) uint8
                    if mirror:
                        batch = torch.flip(batch, dims=[3])  # (B, 3, H, W), like a slice of a flipped copy
                    feats = backbone(normalise(batch)).float().cpu().numpy()  # (B, D)
                    if out is None:
                        # float64 like the reference, so that sums and norms round the same way.
                        out = np.zeros((images.shape[0], feats.shape[1]), dtype=np.float64)
                    out[start:start + feats.shape[0]] = feats
                    if progress is not None:
                        progress(feats.shape[0])
                copies.append(out)
    finally:
        backbone.train(was_training)
    return copies


def test(data_set: BinData, backbone: nn.Module, batch_size: int, nfolds: int = 10,
         progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Verification scores of ``backbone`` on ``data_set = BinData(images, issame)`` from ``load_bin``, the image
    embeddings ``embed(flip=True)``'s: ``acc``, ``acc_std`` (over folds, flip), ``acc_noflip``, ``val``, ``val_std``,
    ``far`` (at FAR=1e-3, flip), ``xnorm`` (mean norm of the un-normalised embeddings of both copies),
    ``threshold`` (best distance threshold, mean over folds), ``pairs`` and the flip ROC ``fpr``, ``tpr`` (mean
    over folds, thresholds 0..4 step 0.01). ``progress(n)`` after every batch of n images (2·2·P in all).
    """
    images, issame = data_set
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(f"data_set must be BinData(images, issame) from load_bin with images a uint8 "
                         f"(2P, 3, H, W) tensor; got images of type {type(images).__name__}")
    original, flipped = _embed_copies(images, backbone, batch_size, (False, True), progress)  # (2P, D) each
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
    training log and ``scripts/verify.py`` print it: every rate a fraction, VAL followed by the FAR
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
