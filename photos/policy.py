"""The face policy: which of the faces detected in one photo are kept, and why, in the report's words.

The detector reports every face it finds (``alignment.FaceDetector`` with no thresholds); ``decide`` applies
``FacePolicy`` to them, so that a photo's detections and the decision over them stay apart and the report can
say why a face was not counted. Several faces are chosen by ``alignment.choose_faces``. See docs/data.md
("From your own photos", Policy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from alignment import Face, choose_faces


@dataclass(frozen=True)
class FacePolicy:
    """``multi``: largest, skip or all (``choose_faces``); faces below ``min_score`` or whose box's shorter side
    is below ``min_face_size`` pixels are not counted."""

    multi: str = "largest"
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
    chosen = choose_faces(counted, photo_size, policy.multi)
    if not chosen:
        return Decision("several_faces", [], None, len(counted), f"{len(counted)} faces (--multi skip){also}")
    if len(counted) == 1:
        reason = also.removeprefix("; ")
    elif policy.multi == "largest":
        reason = f"the largest of {len(counted)} faces, nearest the centre{also}"
    else:
        reason = f"all {len(counted)} faces (--multi all){also}"
    return Decision("kept", chosen, chosen[0], len(counted), reason)
