"""``model.json``, the model card beside every ``model.pt`` (and every exported or imported model): the one place
that writes it, reads the architecture it describes, and keeps the thresholds ``scripts/verify.py
--save-threshold`` calibrates in it.

A card is a JSON object: ``format`` (1), ``network``, ``network_kwargs`` and ``embedding_size`` (what
``backbones.get_model`` builds), ``input_size`` and ``normalisation`` (what the network is fed), and what the
writer adds (the trainer: ``fingerprint`` and ``step``); ``thresholds`` holds ``{target: {"cosine", "embedding",
...}}``: the cosine similarity above which two faces are the same person, and the embedding (``EMBEDDINGS``) it was
calibrated on, which ``scripts/compare.py`` and ``scripts/inference.py`` then use.
The weights file itself stays a plain state_dict in the official layout. docs/evaluation.md describes it.
"""
from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from backbones import get_model
from dataset.images import NORMALISATION
from utils.files import atomic_write

MODEL_CARD = "model.json"
INPUT_SIZE = (112, 112)  # (H, W) the tools feed: aligned faces, as every backbone here expects
# Where the calibrated thresholds go in a card, {target: {"cosine", "embedding", ...}}.
THRESHOLDS_KEY = "thresholds"
# The embeddings a threshold is calibrated on, as eval.verification.embed makes them: "flip" (flip=True) a crop's
# embedding plus its mirror image's, "no-flip" the crop's alone. A threshold without "embedding" is "flip": all that
# --save-threshold ever wrote.
EMBEDDINGS = ("flip", "no-flip")
THRESHOLD_RULE = "best accuracy, mean of the 10 folds' thresholds, flip embeddings"


def model_card(network: str, network_kwargs: dict[str, Any], embedding_size: int, **facts: Any) -> dict[str, Any]:
    """What ``model.json`` says about a backbone: everything a tool needs to rebuild and feed it, and ``facts``
    its writer adds (the trainer's ``fingerprint`` and ``step``)."""
    return {"format": 1, "network": network, "network_kwargs": dict(network_kwargs),
            "embedding_size": int(embedding_size), "input_size": list(INPUT_SIZE), "normalisation": NORMALISATION,
            **facts}


def write_model_card(path: str | os.PathLike, card: dict[str, Any]) -> None:
    """Write ``card`` to ``path`` atomically (``utils.files.atomic_write``)."""
    text = json.dumps(card, indent=1).encode()
    atomic_write(path, lambda f: f.write(text))


@dataclass(frozen=True)
class Architecture:
    """A backbone as ``backbones.get_model`` builds it, and where that description came from."""

    network: str
    network_kwargs: dict[str, Any]
    embedding_size: int
    card: Path | None = None  # the model.json it was read from; None: from the command line

    def build(self) -> nn.Module:
        """The backbone, freshly initialised (torch's current random state); ``ValueError`` naming the
        model.json it came from for a name or argument ``backbones.get_model`` refuses, or for an
        ``input_size`` other than the faces these tools feed."""
        side = self.network_kwargs.get("input_size", INPUT_SIZE[0])
        if side != INPUT_SIZE[0]:
            where = f"{self.card}: " if self.card is not None else "--network-kwargs: "
            raise ValueError(f"{where}input_size {side!r}; these tools feed {INPUT_SIZE[0]}x{INPUT_SIZE[1]} faces "
                             f"(leave input_size out or set it to {INPUT_SIZE[0]})")
        try:
            return get_model(self.network, num_features=self.embedding_size, **self.network_kwargs)
        except (ValueError, TypeError) as exc:  # TypeError: a keyword argument of the wrong kind or type
            where = f"{self.card}: " if self.card is not None else ""
            what = f"network {self.network!r} with {self.network_kwargs}: " if isinstance(exc, TypeError) else ""
            raise ValueError(f"{where}{what}{exc}") from None

    def flags(self) -> str:
        """The options that name this architecture, as a user would type them."""
        flags = f"--network {self.network}"
        if self.network_kwargs:
            flags += f" --network-kwargs {shlex.quote(json.dumps(self.network_kwargs))}"
        return flags + f" --embedding-size {self.embedding_size}"


def _card_value(card: dict[str, Any], path: Path, key: str, kind: type) -> Any:
    if key not in card:
        raise ValueError(f"{path}: no {key!r}; a model card holds network, network_kwargs and embedding_size")
    value = card[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{path}: {key} is {value!r}; expected a {kind.__name__}")
    return value


def read_model_card(path: str | os.PathLike) -> Architecture:
    """The architecture ``model.json`` at ``path`` describes; ``ValueError`` naming the file and the key when
    it cannot be read, lacks a key, or describes inputs other than the ones these tools feed."""
    path = Path(path)
    try:
        card = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable model card ({exc})") from None
    if not isinstance(card, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(card).__name__}")
    if _card_value(card, path, "format", int) != 1:
        raise ValueError(f"{path}: format {card['format']} is not one this code reads (1)")
    input_size = card.get("input_size", list(INPUT_SIZE))
    if list(input_size) != list(INPUT_SIZE):
        raise ValueError(f"{path}: input_size {input_size}; these tools feed {INPUT_SIZE[0]}x{INPUT_SIZE[1]} faces")
    normalisation = card.get("normalisation", NORMALISATION)
    if normalisation != NORMALISATION:
        raise ValueError(f"{path}: normalisation {normalisation!r}; these tools feed {NORMALISATION!r}")
    return Architecture(_card_value(card, path, "network", str), _card_value(card, path, "network_kwargs", dict),
                        _card_value(card, path, "embedding_size", int), path)


def card_with_thresholds(card: Path) -> dict[str, Any]:
    """The JSON object in the model card ``card``, whose ``THRESHOLDS_KEY`` (when present) is an object:
    ``{target: {"cosine", ...}}`` as ``scripts/verify.py --save-threshold`` writes it; ``ValueError`` naming the
    card when it cannot be read or is not such an object."""
    try:
        content = json.loads(card.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{card}: not a readable model card ({exc})") from None
    if not isinstance(content, dict) or not isinstance(content.get(THRESHOLDS_KEY, {}), dict):
        raise ValueError(f"{card}: expected a JSON object whose {THRESHOLDS_KEY!r} is an object")
    return content


def card_beside(weights: str | os.PathLike) -> Path:
    """Where the model card of ``weights`` is: ``model.json`` in the same folder."""
    return Path(weights).with_name(MODEL_CARD)


def threshold_entry(result: Mapping[str, Any], path: Path, precision: str) -> dict[str, Any]:
    """What a card records of a verification set's calibrated threshold, from ``eval.verification.test``'s
    ``result`` on the set at ``path`` (flip embeddings) under the autocast ``precision``."""
    distance = result["threshold"]  # squared L2 distance of L2-normalised embeddings; "same" below it
    return {"cosine": 1.0 - distance / 2.0,  # |a - b|^2 = 2 - 2 cos(a, b) for unit vectors
            "distance": distance, "embedding": "flip", "acc": result["acc"], "pairs": result["pairs"],
            "file": str(path), "precision": precision, "rule": THRESHOLD_RULE}


def save_thresholds(card: Path, entries: Mapping[str, dict[str, Any]]) -> None:
    """Merge ``entries`` ({target: threshold_entry}) into ``card``'s thresholds (read again: the card as it is
    now) and rewrite it atomically, every other key as it was."""
    content = card_with_thresholds(card)
    content[THRESHOLDS_KEY] = {**content.get(THRESHOLDS_KEY, {}), **entries}
    write_model_card(card, content)


@dataclass(frozen=True)
class Calibration:
    """A threshold a card holds: same person above the cosine similarity ``cosine`` of two faces embedded as
    ``embedding`` says, calibrated on the verification set ``target`` (with its accuracy and pairs, when known)."""

    target: str
    cosine: float
    embedding: str
    acc: float | None = None
    pairs: int | None = None

    @property
    def flip(self) -> bool:
        """``eval.verification.embed``'s ``flip`` for this threshold's embedding."""
        return self.embedding == "flip"


def calibrated_threshold(card: Path, target: str | None = None) -> Calibration | None:
    """The threshold ``card`` holds for ``target`` (None: its first, the first saved); None when it holds none and
    no ``target`` is asked for. ``ValueError`` naming the card and key for a card that cannot be read, lacks
    ``target``, or holds a threshold that is not a cosine in [-1, 1] or an embedding not in ``EMBEDDINGS``."""
    thresholds = card_with_thresholds(card).get(THRESHOLDS_KEY, {})
    if target is None and not thresholds:
        return None
    if target is not None and target not in thresholds:
        held = f"holds thresholds for {', '.join(thresholds)}" if thresholds else "holds no calibrated threshold"
        raise ValueError(f"--target {target}: {card} {held}")
    target = target if target is not None else next(iter(thresholds))
    entry = thresholds[target] if isinstance(thresholds[target], dict) else {}
    value, embedding = entry.get("cosine"), entry.get("embedding", "flip")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not -1.0 <= value <= 1.0:
        raise ValueError(f"{card}: {THRESHOLDS_KEY}.{target}.cosine is {value!r}; expected a number in [-1, 1] "
                         f"(written by scripts/verify.py --save-threshold)")
    if embedding not in EMBEDDINGS:
        raise ValueError(f"{card}: {THRESHOLDS_KEY}.{target}.embedding is {embedding!r}; expected one of "
                         f"{', '.join(EMBEDDINGS)}")
    acc, pairs = entry.get("acc"), entry.get("pairs")
    return Calibration(target, float(value), embedding, acc if isinstance(acc, float) else None,
                       pairs if isinstance(pairs, int) and not isinstance(pairs, bool) else None)
