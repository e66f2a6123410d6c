"""A photo's outcome under the face policy (``alignment.policy``: which detected faces count and are kept, and
why), in the report's words.

The detector reports every face it finds, and the work folder keeps them (``photos.work``); ``outcome`` applies
the policy (``alignment.decide``) to a photo's saved detections, so that the detections and the decision over
them stay apart and another policy needs no detection. A photo with several counted faces
is kept only on request (``--multi largest`` or ``all``, ``alignment.choose_faces``) or when a recognition model
tells which face is the identity's (``match``, the default: ``photos.matching``); otherwise it is left out,
counted and shown. See docs/data.md ("From your own photos", Policy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from alignment import Face, FacePolicy, decide


@dataclass(frozen=True)
class FaceCrop:
    """A face and its aligned crop: ``box`` and ``score`` are None for a face aligned at given landmarks."""

    box: tuple[float, float, float, float] | None
    score: float | None
    points: np.ndarray  # (5, 2), in the photo's pixels
    jpeg: bytes
    similarity: float | None = None  # cosine similarity to its identity, when a model checked it (photos.matching)

    @property
    def face(self) -> Face:
        assert self.box is not None and self.score is not None, "a face at given landmarks was not detected"
        return Face(self.box, self.score, self.points)


@dataclass
class Outcome:
    """What the run made of one photo: its report row(s) and the crops it gives the output."""

    status: str  # docs/data.md's report.csv
    reason: str
    faces: int | None  # faces that passed both thresholds; None when no detection ran
    shown: FaceCrop | None = None  # the face the report describes when none is kept
    kept: list[FaceCrop] = field(default_factory=list)  # the crops going into the output
    candidates: list[FaceCrop] = field(default_factory=list)  # every counted face of a photo with several
    duplicate_of: int | None = None  # the index of the photo this one is a copy of


def saved_faces(entry: dict[str, Any]) -> list[FaceCrop]:
    """The faces of a photo's saved detections (``photos.work``), highest score first."""
    return [FaceCrop(tuple(float(v) for v in face["box"]), float(face["score"]),
                     np.asarray(face["points"], np.float64).reshape(5, 2), face["jpeg"]) for face in entry["faces"]]


def outcome(entry: dict[str, Any], policy: FacePolicy) -> Outcome:
    """The outcome of a photo from its saved detections under ``policy``."""
    crops = saved_faces(entry)
    faces = [crop.face for crop in crops]
    crop_of = {id(face): crop for face, crop in zip(faces, crops)}
    decision = decide(faces, tuple(entry["size"]), policy)
    counted = [crop_of[id(f)] for f in faces if policy.counts(f)]
    return Outcome(decision.status, decision.reason, decision.counted,
                   None if decision.shown is None else crop_of[id(decision.shown)],
                   [crop_of[id(face)] for face in decision.keep], counted if len(counted) > 1 else [])
