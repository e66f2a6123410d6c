"""The face policy: which of the faces detected in one photo are kept, and why, in the report's words.

The detector reports every face it finds (``alignment.FaceDetector`` with no thresholds), and the work folder
keeps them (``photos.work``); ``decide`` applies ``FacePolicy`` to them, so that a photo's detections and the
decision over them stay apart, the report can say why a face was not counted, and another policy needs no
detection. ``outcome`` turns a photo's saved detections into its ``Outcome``. A photo with several counted faces
is kept only on request (``--multi largest`` or ``all``, ``alignment.choose_faces``) or when a recognition model
tells which face is the identity's (``match``, the default: ``photos.matching``); otherwise it is left out,
counted and shown. See docs/data.md ("From your own photos", Policy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from alignment import Face, choose_faces

MULTI = ("match", "largest", "skip", "all")


@dataclass(frozen=True)
class FacePolicy:
    """``multi``: what a photo with several counted faces keeps: ``match`` the face a recognition model matches to
    the identity (``photos.matching``; none without a model), ``largest``, ``skip`` or ``all``
    (``choose_faces``); faces below ``min_score`` or whose box's shorter side is below ``min_face_size`` pixels
    are not counted."""

    multi: str = "match"
    min_score: float = 0.9
    min_face_size: float = 40.0


class Decision(NamedTuple):
    """What the policy made of one photo's faces."""

    status: str  # kept, no_face, low_score, small_face or several_faces (docs/data.md's report.csv)
    keep: list[Face]  # the faces to align
    shown: Face | None  # the face the report describes
    counted: int  # faces that passed both thresholds
    reason: str


def decide(faces: list[Face], photo_size: tuple[int, int], policy: FacePolicy) -> Decision:
    """The decision over one photo's detections (every face the detector returned, highest score first);
    ``photo_size`` is (H, W)."""
    counted = [f for f in faces if f.score >= policy.min_score and f.size >= policy.min_face_size]
    if not faces:
        return Decision("no_face", [], None, 0, "no face found")
    if not counted:
        confident = [f for f in faces if f.score >= policy.min_score]
        if confident:
            face = max(confident, key=lambda f: f.size)
            return Decision("small_face", [], face, 0, f"the largest face is {face.size:.0f} px, below "
                            f"--min-face-size {policy.min_face_size:g}")
        return Decision("low_score", [], faces[0], 0, f"the best face scores {faces[0].score:.4f}, below "
                        f"--min-score {policy.min_score:g}")
    below = len(faces) - len(counted)
    also = f"; {below} more below --min-score/--min-face-size" if below else ""
    if len(counted) > 1 and policy.multi == "match":
        return Decision("several_faces", [], counted[0], len(counted), f"{len(counted)} faces: telling which is the "
                        f"identity's needs a recognition model (--weights MODEL), or --multi largest{also}")
    chosen = choose_faces(counted, photo_size, "largest" if policy.multi == "match" else policy.multi)
    if not chosen:
        return Decision("several_faces", [], counted[0], len(counted), f"{len(counted)} faces (--multi skip){also}")
    if len(counted) == 1:
        reason = also.removeprefix("; ")
    elif policy.multi == "largest":
        reason = f"the largest of {len(counted)} faces, nearest the centre{also}"
    else:
        reason = f"all {len(counted)} faces (--multi all){also}"
    return Decision("kept", chosen, chosen[0], len(counted), reason)


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
    counted = [crop_of[id(f)] for f in faces if f.score >= policy.min_score and f.size >= policy.min_face_size]
    return Outcome(decision.status, decision.reason, decision.counted,
                   None if decision.shown is None else crop_of[id(decision.shown)],
                   [crop_of[id(face)] for face in decision.keep], counted if len(counted) > 1 else [])
