"""The holdout: which identities leave the training set, and the verification pairs formed from their faces.

``hold_out`` picks the identities (those with two or more kept faces from different photos, so each can give a
same-identity pair) and ``form_pairs`` the pairs, never of two copies of one photo (``photos.duplicates``), both
from one ``numpy`` generator seeded by ``--seed``, so the same input and seed give the same ``holdout.bin``. See
docs/data.md ("From your own photos", Output).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from photos.listing import count
from utils.cli import BadData


def hold_out(with_faces: Sequence[str], kept: dict[str, int], holdout: int, rng: np.random.Generator) -> set[str]:
    """``holdout`` of the identities ``with_faces`` (in class order) that kept 2 or more faces (``kept``: faces
    per identity, copies of one photo counted once), leaving at least one for training; ``BadData`` when the
    photos cannot fill it."""
    eligible = [i for i in with_faces if kept[i] >= 2]
    if len(eligible) < holdout:
        raise BadData(f"--holdout {holdout}: only {count(len(eligible), 'identity', 'identities')} kept the 2 "
                      f"or more faces a same-identity pair needs")
    if len(with_faces) <= holdout:
        raise BadData(f"--holdout {holdout}: {count(len(with_faces), 'identity', 'identities')} kept a face; "
                      f"holding out {holdout} leaves none for training")
    return {eligible[i] for i in rng.choice(len(eligible), holdout, replace=False)}


def form_pairs(groups: Sequence[Sequence[int]], max_pairs: int, rng: np.random.Generator,
               copy_of: Sequence[int] | None = None) -> list[tuple[int, int, bool]]:
    """Verification pairs over ``groups`` (the items of each identity): up to ``max_pairs // 2`` same-identity
    pairs (all of them when they are fewer) and as many different-identity pairs, each pair once, alternating
    same and different (every fold of the protocol gets both), none of two items with the same ``copy_of``
    (item -> the photo it is a copy of); the choice depends only on ``rng``."""
    copy = (lambda item: item) if copy_of is None else copy_of.__getitem__
    positives = [pair for group in groups for pair in itertools.combinations(sorted(group), 2)
                 if copy(pair[0]) != copy(pair[1])]
    owner = {item: k for k, group in enumerate(groups) for item in group}
    items = sorted(owner)
    sizes = [len(g) for g in groups]
    copies: dict[int, list[int]] = {}
    for item in items:
        copies.setdefault(copy(item), []).append(owner[item])
    copied = sum((len(c) ** 2 - sum(c.count(k) ** 2 for k in set(c))) // 2 for c in copies.values())
    total_negative = (sum(sizes) ** 2 - sum(s * s for s in sizes)) // 2 - copied
    n = min(len(positives), max_pairs // 2, total_negative)
    positives = [positives[i] for i in sorted(rng.choice(len(positives), n, replace=False))]
    if total_negative <= 4 * n + 10_000:
        candidates = [(a, b) for a, b in itertools.combinations(items, 2)
                      if owner[a] != owner[b] and copy(a) != copy(b)]
        negatives = [candidates[i] for i in sorted(rng.choice(len(candidates), n, replace=False))]
    else:  # too many to list: draw until n distinct ones (most draws are different identities)
        chosen: set[tuple[int, int]] = set()
        while len(chosen) < n:
            a, b = (items[i] for i in rng.integers(0, len(items), 2))
            if owner[a] != owner[b] and copy(a) != copy(b):
                chosen.add((min(a, b), max(a, b)))
        negatives = sorted(chosen)
    pairs: list[tuple[int, int, bool]] = []
    for same, different in zip(positives, negatives):
        pairs += [(*same, True), (*different, False)]
    return pairs
