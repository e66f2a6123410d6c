"""Who is who, with a recognition model: the face of a group photo that is the identity's, and the photos whose
face is far from their identity (mislabelled).

Each face is embedded as the verification protocol embeds it (``eval.verification.embed``: the crop and its mirror
image, summed), by any model the evaluation tools take (``load_model``: ours, an arcface_torch ``.pt``, an ONNX
file). An identity's references are its photos with one face; the similarity of a face to an identity is the
cosine between the face's embedding and the sum of the references' (for a reference, the sum of the others).
``check_identities`` then marks a reference below ``threshold`` as ``no_match`` (left out), keeps the face of a
group photo that matches the identity best (``--multi match``) or leaves the photo out when none reaches the
threshold, and leaves out the faces ``--multi largest``/``all`` kept that do not reach it. The similarity of
every checked face goes into report.csv. See docs/data.md ("From your own photos", Policy).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dataset.images import decode_many
from eval.model_source import build_backbone, is_onnx
from eval.verification import embed
from photos.listing import Photo
from photos.policy import FaceCrop, Outcome

DEFAULT_THRESHOLD = 0.3


def load_model(model: Path, network: str | None, device: torch.device) -> nn.Module:
    """The recognition model at ``model`` in eval mode on ``device``, loaded as the evaluation tools load it: an
    ``.onnx`` file, or torch weights (a file or a run folder) whose architecture is ``network`` (default 512-d
    embeddings) or, without it, the ``model.json`` beside them. ``ValueError``/``FileNotFoundError``, one line."""
    onnx = is_onnx(model)
    return build_backbone(weights=None if onnx else model, onnx=model if onnx else None, network=network,
                          device=device.type).eval()


def embedder(model: nn.Module, batch_size: int = 64) -> Callable[[Sequence[bytes]], np.ndarray]:
    """A function from JPEG crops to their embeddings (N, D), each row of unit length: the crop's and its mirror
    image's, summed (the verification protocol's flip)."""

    @torch.no_grad()
    def embed_crops(jpegs: Sequence[bytes]) -> np.ndarray:
        images = torch.stack(decode_many(jpegs, [f"crop {i}" for i in range(len(jpegs))]))  # (N, 3, 112, 112)
        both = embed(images, model, batch_size, flip=True)  # (N, D) float64
        return both / np.maximum(np.linalg.norm(both, axis=1, keepdims=True), 1e-12)

    return embed_crops


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def check_identities(photos: Sequence[Photo], outcomes: Sequence[Outcome],
                     embed_crops: Callable[[Sequence[bytes]], np.ndarray], threshold: float) -> None:
    """Decide, with ``embed_crops`` (``embedder``), which face of each photo with several faces is its identity's
    and which photos are far from their identity; ``outcomes`` (one per photo) are updated in place, each face
    checked carrying its similarity."""
    references = [i for i, o in enumerate(outcomes) if o.status == "kept" and len(o.kept) == 1 and not o.candidates]
    groups = [i for i, o in enumerate(outcomes) if o.candidates and o.status in ("kept", "several_faces")]
    crops: list[FaceCrop] = [outcomes[i].kept[0] for i in references]
    crops += [c for i in groups for c in outcomes[i].candidates]
    if not crops:
        return
    embeddings = dict(zip(map(id, crops), embed_crops([c.jpeg for c in crops])))
    by_identity: dict[str, list[int]] = {}
    for i in references:
        by_identity.setdefault(photos[i].identity, []).append(i)
    centres: dict[str, tuple[np.ndarray, int]] = {}  # the sum of the references that match the others, and their number
    for identity, members in by_identity.items():
        vectors = [embeddings[id(outcomes[i].kept[0])] for i in members]
        total = np.sum(vectors, axis=0)
        trusted = []
        for i, vector in zip(members, vectors):
            if len(members) < 2:  # one photo: nothing to compare it with
                trusted.append(vector)
                continue
            o = outcomes[i]
            similarity = _cosine(vector, total - vector)
            o.kept = [replace(o.kept[0], similarity=similarity)]
            if similarity >= threshold:
                trusted.append(vector)
                continue
            o.status, o.shown, o.kept = "no_match", o.kept[0], []
            o.reason = (f"far from the other {len(members) - 1} photos of {identity}: similarity {similarity:.3f}, "
                        f"below --match-threshold {threshold:g}")
        if trusted:
            centres[identity] = (np.sum(trusted, axis=0), len(trusted))
    for i in groups:
        o, identity = outcomes[i], photos[i].identity
        if identity not in centres:
            if o.status == "several_faces":
                o.reason = (f"{len(o.candidates)} faces, and no photo of {identity} with one face to tell which is "
                            f"theirs")
            continue
        centre, n = centres[identity]
        checked = {id(c): replace(c, similarity=_cosine(embeddings[id(c)], centre)) for c in o.candidates}
        refs = f"{identity}'s {n} photo{'s' if n > 1 else ''} with one face"
        if o.status == "several_faces":  # --multi match
            best = max(checked.values(), key=lambda c: c.similarity)
            o.shown = best
            if best.similarity >= threshold:
                o.status, o.kept = "kept", [best]
                o.reason = f"the face of {len(o.candidates)} that matches {refs} (similarity {best.similarity:.3f})"
            else:
                o.status = "no_match"
                o.reason = (f"none of the {len(o.candidates)} faces matches {refs} (best similarity "
                            f"{best.similarity:.3f}, below --match-threshold {threshold:g})")
            continue
        kept = [checked[id(c)] for c in o.kept]  # --multi largest or all: the faces kept must match too
        o.kept = [c for c in kept if c.similarity >= threshold]
        if not o.kept:
            o.status, o.shown = "no_match", kept[0]
            o.reason = (f"the face kept ({o.reason}) does not match {refs} (similarity {kept[0].similarity:.3f}, "
                        f"below --match-threshold {threshold:g})")
