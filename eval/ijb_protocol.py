"""IJB-B / IJB-C 1:1 verification (template to template): the protocol, on the released folder layout.

``read_meta`` reads ``DATA_DIR/meta/{t}_*.txt``; ``AlignedFaces`` aligns the ``loose_crop/`` images onto the ArcFace
template (``alignment.align_face``, as the training data is aligned); ``image_features`` embeds each crop plus its
mirror image; ``template_features`` averages the (faceness-weighted) features per media and sums them per template;
``pair_scores`` and ``tar_at_far`` give TAR at FAR 1e-6 ... 1e-1. ``evaluate_ijb`` runs it all;
``scripts/ijb.py`` is the command. The files and the protocol: docs/evaluation.md#ijb-b--ijb-c.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.metrics import auc, roc_curve
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from alignment import align_face, read_photo
from eval.verification import embed
from utils.files import path_problem

FAR_LEVELS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


@dataclass
class IJBMeta:
    """The 1:1 protocol files of one IJB target, one row per face image."""
    names: list[str]
    templates: np.ndarray  # (N,) int64 template id per image
    medias: np.ndarray  # (N,) int64 media id per image
    landmarks: np.ndarray  # (N, 5, 2) float32, in the loose crop
    scores: np.ndarray  # (N,) float32 faceness
    pairs: np.ndarray  # (P, 2) int64 template ids
    labels: np.ndarray  # (P,) int64, 1 = same person


def _read_table(path: Path, columns: int) -> list[list[str]]:
    if (problem := path_problem(path)) is not None:
        raise FileNotFoundError(f"IJB protocol file {problem}: {path}")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != columns:
            raise ValueError(f"{path}:{lineno}: expected {columns} space-separated fields, got {len(fields)}: "
                             f"{line.strip()[:80]!r}")
        rows.append(fields)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def read_meta(data_dir: str | os.PathLike, target: str) -> IJBMeta:
    """Read ``meta/{t}_*.txt`` for ``t = target.lower()``. ``ValueError`` on bad rows: naming file and line for a
    row with the wrong number of fields, the file for images without landmarks, the folder for a non-numeric
    id, landmark or label."""
    meta = Path(data_dir) / "meta"
    t = target.lower()
    faces = _read_table(meta / f"{t}_face_tid_mid.txt", 3)
    pairs = _read_table(meta / f"{t}_template_pair_label.txt", 3)
    lmk_path = meta / f"{t}_name_5pts_score.txt"
    lmk = {row[0]: row[1:] for row in _read_table(lmk_path, 12)}
    missing = [row[0] for row in faces if row[0] not in lmk]
    if missing:
        raise ValueError(f"{lmk_path}: no landmarks for {len(missing)} image(s) of {t}_face_tid_mid.txt "
                         f"(e.g. {missing[:3]})")
    try:
        names = [row[0] for row in faces]
        values = np.array([lmk[n] for n in names], dtype=np.float32)  # (N, 11)
        result = IJBMeta(
            names=names,
            templates=np.array([row[1] for row in faces], dtype=np.int64),
            medias=np.array([row[2] for row in faces], dtype=np.int64),
            landmarks=values[:, :10].reshape(-1, 5, 2), scores=values[:, 10],
            pairs=np.array([row[:2] for row in pairs], dtype=np.int64),
            labels=np.array([row[2] for row in pairs], dtype=np.int64))
    except ValueError as exc:
        raise ValueError(f"{meta}: non-numeric id, landmark or label in the {t} protocol files ({exc})") from exc
    unknown = np.setdiff1d(result.pairs, result.templates)
    if unknown.size:
        raise ValueError(f"{meta / f'{t}_template_pair_label.txt'}: template(s) {unknown[:5].tolist()} have no "
                         f"image in {t}_face_tid_mid.txt")
    return result


class AlignedFaces(Dataset):
    """The aligned 112×112 crops (uint8 (3, 112, 112)) of the IJB images, in ``meta.names`` order."""

    def __init__(self, image_dir: Path, meta: IJBMeta) -> None:
        self.image_dir = image_dir
        self.meta = meta

    def __len__(self) -> int:
        return len(self.meta.names)

    def __getitem__(self, index: int) -> torch.Tensor:
        image = read_photo(self.image_dir / self.meta.names[index])  # (3, h, w); PhotoError names the file
        return align_face(image, self.meta.landmarks[index])  # (3, 112, 112)


def image_features(dataset: Dataset, backbone: nn.Module, batch_size: int, num_workers: int = 0) -> np.ndarray:
    """(N, D) float32: per image, the backbone's feature of the crop plus that of its mirror image
    (``eval.verification.embed(flip=True)``)."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    chunks = [embed(batch, backbone, batch_size, flip=True).astype(np.float32)  # (B, D)
              for batch in tqdm(loader, desc="features", unit="batch", file=sys.stderr, leave=False)]
    return np.concatenate(chunks)


def template_features(features: np.ndarray, templates: np.ndarray, medias: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Aggregate image features (N, D) into L2-normalised template features.

    Within a template, the images of one media are averaged and the media features summed, so that a
    video with many frames counts as much as a single photo. Returns ``(template_ids (T,), feats (T, D))``
    with ``template_ids`` sorted.
    """
    features = features.astype(np.float64)
    template_ids, template_of = np.unique(templates, return_inverse=True)  # (T,), (N,)
    _, media_of = np.unique(np.stack([template_of, medias], axis=1), axis=0, return_inverse=True)  # (N,)
    media_of = media_of.reshape(-1)
    n_media = int(media_of.max()) + 1
    media_sum = np.zeros((n_media, features.shape[1]))
    np.add.at(media_sum, media_of, features)
    media_count = np.bincount(media_of, minlength=n_media)
    media_template = np.zeros(n_media, dtype=np.int64)
    media_template[media_of] = template_of
    template_sum = np.zeros((len(template_ids), features.shape[1]))
    np.add.at(template_sum, media_template, media_sum / media_count[:, None])
    norms = np.linalg.norm(template_sum, axis=1, keepdims=True)
    return template_ids, template_sum / np.where(norms == 0, 1.0, norms)


def pair_scores(template_ids: np.ndarray, feats: np.ndarray, pairs: np.ndarray, chunk: int = 100_000) -> np.ndarray:
    """Cosine score (P,) of every template pair; computed in chunks (IJB-C has 15.6 M pairs)."""
    index = np.searchsorted(template_ids, pairs)  # (P, 2) rows of feats
    scores = np.empty(len(pairs))
    for start in range(0, len(pairs), chunk):
        a, b = index[start:start + chunk, 0], index[start:start + chunk, 1]
        scores[start:start + chunk] = np.einsum("ij,ij->i", feats[a], feats[b])
    return scores


def tar_at_far(labels: np.ndarray, scores: np.ndarray, far_levels: Sequence[float] = FAR_LEVELS
               ) -> tuple[dict[str, float], np.ndarray, np.ndarray, float]:
    """TAR at each FAR level, read at the ROC point whose FAR is nearest the level (the convention of
    the published IJB tables), plus the ROC ``(fpr, tpr)`` and its AUC."""
    if labels.min() == labels.max():
        raise ValueError(f"the template pairs have only label {labels.min()}; a ROC needs both 0 and 1")
    fpr, tpr, _ = roc_curve(labels, scores)
    tar = {f"{far:g}": float(tpr[np.argmin(np.abs(fpr - far))]) for far in far_levels}
    return tar, fpr, tpr, float(auc(fpr, tpr))


def evaluate_ijb(data_dir: str | os.PathLike, target: str, backbone: nn.Module, batch_size: int = 128,
                 num_workers: int = 0) -> dict[str, Any]:
    """The 1:1 protocol end to end: ``{"tar": {far: tar}, "auc", "pairs", "templates", "images",
    "fpr", "tpr"}``."""
    meta = read_meta(data_dir, target)
    image_dir = Path(data_dir) / "loose_crop"
    if (problem := path_problem(image_dir, folder=True)) is not None:
        raise FileNotFoundError(f"IJB image folder {problem}: {image_dir}")
    feats = image_features(AlignedFaces(image_dir, meta), backbone, batch_size, num_workers)  # (N, D)
    feats = feats * meta.scores[:, None]  # faceness weighting: poor detections count less
    template_ids, template_feats = template_features(feats, meta.templates, meta.medias)
    scores = pair_scores(template_ids, template_feats, meta.pairs)
    tar, fpr, tpr, area = tar_at_far(meta.labels, scores)
    return {"tar": tar, "auc": area, "pairs": int(len(scores)), "templates": int(len(template_ids)),
            "images": len(meta.names), "fpr": fpr, "tpr": tpr}
