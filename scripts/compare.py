"""Say whether two photos show the same person: the cosine similarity of their faces' embeddings, and the verdict
at a threshold.

    python scripts/compare.py A.jpg B.jpg --weights work_dirs/ms1mv3_r50/model.pt
    python scripts/compare.py A.jpg B.jpg --weights work_dirs/ms1mv3_r50 --threshold 0.3
    python scripts/compare.py A.jpg B.jpg --weights work_dirs/ms1mv3_r50 --target cfp_fp
    python scripts/compare.py a_crop.png b_crop.png --onnx r50.onnx --no-align
    python scripts/compare.py A.jpg B.jpg --network r50 --weights backbone.pth --threshold 0.25

The model options are ``eval.model_options``'. Each photo is aligned as the training data is (MTCNN from the
optional ``facenet-pytorch``: the largest face nearest the centre, of those above ``--min-score`` and
``--min-face-size``; a line per photo says which); ``--no-align`` takes them as aligned 112x112 crops. The threshold
is ``--threshold T`` (a cosine similarity), else the one ``scripts/verify.py --save-threshold`` wrote into the
``model.json`` beside the model (``--target NAME``'s, else the first), and the faces are embedded as it was
calibrated. Prints the similarity and the verdict; with no threshold known the verdict line says how to get one.
docs/evaluation.md#raw-photos-and-comparing-two-faces.

Exit status: 0 compared (whatever the verdict, or no threshold known); 2 a usage or configuration error, one
line: a photo that cannot be read, a photo in which no face counts (none found, or the largest below
``--min-face-size``, the best below ``--min-score``: the line says which), ``facenet-pytorch`` not installed (with
the command that installs it), no ``--network`` and no ``model.json``, weights that do not fit the network, a
``--target`` the card does not hold, a card whose threshold is not a number in [-1, 1]; 130 / 143 interrupted.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from alignment import FacePolicy, add_policy_options, check_policy_options
from eval.faces import face_crop, face_detector
from eval.model_card import calibrated_threshold, card_beside
from eval.model_options import add_model_options, backbone_from_options, check_model_options, model_flag
from eval.model_source import model_file
from eval.verification import embed
from utils.cli import run_tool, warn

TOOL = "compare"
CALIBRATE = "python scripts/verify.py {model} --data-dir DIR --targets lfw --save-threshold"


@dataclass(frozen=True)
class Threshold:
    """A cosine-similarity threshold (``value``; None: none known), where it came from in words, and whether the
    faces are embedded with the flip for it."""

    value: float | None
    source: str
    flip: bool = True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="compare.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path, help="a photo of a face")
    parser.add_argument("second", type=Path, help="another photo")
    add_model_options(parser, random_init=False)
    parser.add_argument("--align", action=argparse.BooleanOptionalAction, default=True,
                        help="detect the face in each photo and align it to the ArcFace template (default); "
                             "--no-align: the photos are aligned 112x112 crops")
    add_policy_options(parser)
    parser.add_argument("--threshold", type=float, metavar="T",
                        help="same person above this cosine similarity of flip embeddings (default: model.json's "
                             "calibrated one, with the embedding it was calibrated on)")
    parser.add_argument("--target", metavar="NAME",
                        help="use the threshold model.json holds for this verification set (default: its first)")
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    check_policy_options(parser, args)
    if args.threshold is not None and not -1.0 <= args.threshold <= 1.0:
        parser.error(f"--threshold is a cosine similarity, in [-1, 1]; got {args.threshold}")
    if args.threshold is not None and args.target is not None:
        parser.error(f"--threshold {args.threshold} and --target {args.target} both choose the threshold; give one")
    return args


def find_threshold(args: argparse.Namespace) -> Threshold:
    """``--threshold``, else the calibrated one of the model.json beside the model (``--target``'s or its first)."""
    if args.threshold is not None:
        return Threshold(args.threshold, "--threshold")
    card = card_beside(model_file(args.weights, args.onnx))
    if not card.is_file():
        if args.target is not None:
            raise ValueError(f"--target {args.target}: {card} does not exist")
        return Threshold(None, f"there is no {card} to hold a calibrated one; pass --threshold")
    found = calibrated_threshold(card, args.target)
    if found is None:
        return Threshold(None, f"{card} holds no calibrated one; pass --threshold, or calibrate one: "
                               f"{CALIBRATE.format(model=model_flag(args))}")
    scores = f": accuracy {found.acc:.5f} on {found.pairs} pairs" if found.acc is not None and found.pairs else ""
    return Threshold(found.cosine, f"calibrated on {found.target} by scripts/verify.py{scores}", found.flip)


def embeddings(args: argparse.Namespace, flip: bool, said: list[str]) -> np.ndarray:
    """(2, D) float64: the two photos' faces as compared, embedded with or without the flip; ``said`` gets a line
    per aligned photo saying which face was used."""
    policy = FacePolicy("largest", args.min_score, args.min_face_size)
    detector = face_detector(args.device, policy) if args.align else None
    faces = [face_crop(path, detector, policy, lambda message: warn(TOOL, f"{message} (without --no-align the face "
                                                                          f"is detected and aligned)"), said.append)
             for path in (args.first, args.second)]
    return embed(torch.stack(faces), backbone_from_options(args), batch_size=2, flip=flip)  # (2, 3, 112, 112) in


def run(args: argparse.Namespace) -> None:
    threshold = find_threshold(args)  # before the photos and the model: a --target the card lacks stops here
    said: list[str] = []
    a, b = (v / max(np.linalg.norm(v), 1e-12) for v in embeddings(args, threshold.flip, said))  # (D,) each
    similarity = float(a @ b)
    for line in said:  # which face of each photo, once both are embedded
        print(line)
    print(f"{args.first} ~ {args.second}: cosine similarity {similarity:.4f}")
    if threshold.value is None:
        print(f"no threshold known: {threshold.source}")
    else:
        verdict = "same person: above" if similarity > threshold.value else "different people: not above"
        print(f"{verdict} the threshold {threshold.value:.4f} ({threshold.source})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_tool(TOOL, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
