"""IJB-B / IJB-C 1:1 verification (template to template): the protocol, on the released folder layout.

``DATA_DIR`` holds ``loose_crop/`` (the images) and ``meta/`` with, for ``t = target.lower()``:
``{t}_face_tid_mid.txt`` (image name, template id, media id per line), ``{t}_template_pair_label.txt``
(template 1, template 2, 1 = same person / 0) and ``{t}_name_5pts_score.txt`` (image name, 5 landmarks as
x1 y1 ... x5 y5 in the loose crop, detector faceness score), all space-separated.

Protocol (as published for ArcFace): every face is aligned to the 112×112 ArcFace five-point template by
a least-squares similarity transform; its feature is the sum of the features of the face and of its
mirror image, scaled by the faceness score (not normalised); the features of one media (video or
photo) are averaged, the media features of a template summed, and the template feature L2-normalised;
a pair's score is the cosine of its two templates. Reported: TAR at FAR 1e-6 ... 1e-1 from the ROC.
``python -m eval.ijb`` runs it from the command line.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import auc, roc_curve
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from dataset.images import decode, normalise
from eval.model_source import device_of
from utils.files import path_problem

# Where the ArcFace alignment puts the eyes, nose tip and mouth corners in a 112×112 crop (x, y), as
# published with insightface's aligned training sets.
ARCFACE_TEMPLATE = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366],
                             [41.5493, 92.3655], [70.7299, 92.2041]], dtype=np.float64)
FAR_LEVELS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def similarity_transform(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The (2, 3) matrix [sR | t] of the similarity (scale, rotation, translation; no reflection)
    that maps the points ``src`` (N, 2) closest to ``dst`` (N, 2) in the least-squares sense.

    Closed form of Umeyama (1991), "Least-squares estimation of transformation parameters between two
    point patterns": the rotation comes from the SVD of the cross-covariance of the centred point sets.
    """
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2 or src.shape[0] < 2:
        raise ValueError(f"similarity_transform needs two (N>=2, 2) point sets of one shape, got "
                         f"{src.shape} and {dst.shape}")
    mu_src, mu_dst = src.mean(0), dst.mean(0)
    src_c, dst_c = src - mu_src, dst - mu_dst
    cov = dst_c.T @ src_c / len(src)  # (2, 2)
    u, d, vt = np.linalg.svd(cov)
    # Flip the weakest axis when the best orthogonal map would be a reflection.
    s = np.array([1.0, 1.0 if np.linalg.det(u) * np.linalg.det(vt) >= 0 else -1.0])
    rotation = u @ np.diag(s) @ vt
    var_src = (src_c ** 2).sum() / len(src)
    scale = (d * s).sum() / var_src if var_src > 0 else 1.0
    translation = mu_dst - scale * rotation @ mu_src
    return np.hstack([scale * rotation, translation[:, None]])


def warp_affine(image: torch.Tensor, matrix: np.ndarray, size: tuple[int, int] = (112, 112)) -> torch.Tensor:
    """uint8 (3, h, w) -> uint8 (3, H, W): output pixel (x, y) samples the input at ``matrix⁻¹ (x, y)``,
    bilinearly, zero outside; pixel centres sit at integer coordinates (OpenCV's warpAffine convention)."""
    h, w = image.shape[1:]
    forward = np.vstack([matrix, [0.0, 0.0, 1.0]])
    inverse = np.linalg.inv(forward)[:2]  # (2, 3) output -> input pixel coordinates
    ys, xs = torch.meshgrid(torch.arange(size[0], dtype=torch.float64),
                            torch.arange(size[1], dtype=torch.float64), indexing="ij")
    out_xy1 = torch.stack([xs, ys, torch.ones_like(xs)], dim=-1)  # (H, W, 3)
    in_xy = out_xy1 @ torch.from_numpy(inverse).T  # (H, W, 2) input pixel coordinates
    # grid_sample (align_corners=False) puts -1 at the outer edge of pixel 0, i.e. at coordinate -0.5.
    grid = torch.stack([(2 * in_xy[..., 0] + 1) / w - 1, (2 * in_xy[..., 1] + 1) / h - 1], dim=-1)
    out = F.grid_sample(image[None].float(), grid[None].float(), mode="bilinear", padding_mode="zeros",
                        align_corners=False)  # (1, 3, H, W)
    return out[0].round_().clamp_(0, 255).to(torch.uint8)


def align_face(image: torch.Tensor, landmarks: np.ndarray, size: int = 112) -> torch.Tensor:
    """The 112×112 ArcFace crop (uint8 (3, 112, 112)) of the face with five ``landmarks`` (5, 2) in ``image``."""
    template = ARCFACE_TEMPLATE * (size / 112.0)
    return warp_affine(image, similarity_transform(landmarks, template), (size, size))


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
        path = self.image_dir / self.meta.names[index]
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read image {index} ({exc.strerror or exc})") from exc
        return align_face(decode(data, str(path)), self.meta.landmarks[index])  # (3, h, w) -> (3, 112, 112)


def image_features(dataset: Dataset, backbone: nn.Module, batch_size: int, num_workers: int = 0) -> np.ndarray:
    """(N, D) float32: per image, the backbone's feature of the crop plus that of its mirror image."""
    device = device_of(backbone)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    chunks = []
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad():
            for batch in tqdm(loader, desc="features", unit="batch", file=sys.stderr, leave=False):
                x = normalise(batch.to(device))  # (B, 3, 112, 112) float32
                feats = backbone(x) + backbone(x.flip(3))  # (B, D)
                chunks.append(feats.float().cpu().numpy())
    finally:
        backbone.train(was_training)
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
