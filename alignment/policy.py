"""The face policy: which of the faces detected in one photo count and are used, and why, in a report's words.

The detector reports every face it finds (``FaceDetector`` with no thresholds: ``detector_for``); ``decide``
applies ``FacePolicy`` (``--min-score``, ``--min-face-size``, ``--multi``) to them, so that a tool can say why a
face was not counted (too small, a low score) and another policy needs no detection. ``scripts/prepare_faces.py``
(through ``photos.policy``), ``scripts/inference.py --align`` and ``scripts/compare.py`` decide with it;
``add_policy_options`` declares the thresholds' command-line options for them. See docs/data.md ("Policy").
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import NamedTuple

import torch

from alignment.detect import Face, FaceDetector, choose_faces, smallest_face_for

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

    def counts(self, face: Face) -> bool:
        """Whether ``face`` passes both thresholds (``min_score`` and ``min_face_size``)."""
        return face.score >= self.min_score and face.size >= self.min_face_size


LARGEST = FacePolicy("largest")  # the tools' policy for one photo: the largest face nearest the centre


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
    counted = [f for f in faces if policy.counts(f)]
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


def detector_for(policy: FacePolicy, device: torch.device | str = "cpu", **settings) -> FaceDetector:
    """A detector that reports every face (the policy applies the thresholds), detecting photos at the scale
    ``policy.min_face_size`` needs; ``settings``: ``FaceDetector``'s others (``detect_size``, ``batch_size``)."""
    return FaceDetector(device, min_score=0.0, min_face_size=0.0,
                        smallest_face=smallest_face_for(policy.min_face_size), **settings)


def add_policy_options(parser: argparse.ArgumentParser) -> None:
    """``--min-score`` and ``--min-face-size``, as every tool that detects faces takes them."""
    parser.add_argument("--min-score", type=float, default=FacePolicy.min_score,
                        help=f"faces the detector scores below this are not counted (default {FacePolicy.min_score})")
    parser.add_argument("--min-face-size", type=float, default=FacePolicy.min_face_size, metavar="PIXELS",
                        help=f"faces whose box's shorter side is smaller (in the photo's pixels) are not counted "
                             f"(default {FacePolicy.min_face_size:g})")


def check_policy_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse thresholds outside their ranges (exits through ``parser.error``)."""
    if not 0.0 <= args.min_score <= 1.0:
        parser.error(f"--min-score must be in [0, 1], got {args.min_score:g}")
    if args.min_face_size < 0:
        parser.error(f"--min-face-size must be >= 0, got {args.min_face_size:g}")
