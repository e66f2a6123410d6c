"""Compute the embedding of one aligned face image (112x112; other sizes are resized, with a warning), or of the face
in a raw photo (``--align``).

    python scripts/inference.py --weights work_dirs/ms1mv3_r50/model.pt --image face.jpg [--output emb.npy]
    python scripts/inference.py --network r50 --weights backbone.pth --image face.jpg
    python scripts/inference.py --network r50 --weight backbone.pth --img face.jpg   # arcface_torch's names
    python scripts/inference.py --weights work_dirs/ms1mv3_r50 --img raw.jpg --align  # a photo as it was taken
    python scripts/inference.py --onnx work_dirs/ms1mv3_r50/model.onnx --image face.jpg  # the exported model

The model options are ``eval.model_options``' (``--img`` is arcface_torch's name of ``--image``, ``--weight`` an
abbreviation of ``--weights``). ``--align`` finds the face (MTCNN, the optional ``facenet-pytorch``: the largest
face nearest the centre of those above ``--min-score`` and ``--min-face-size``; a line says which) and aligns it as
the training data is aligned. The embedding is the vector ``scripts/compare.py`` scores: as the model.json's
thresholds were calibrated, else the flip embedding (the crop's plus its mirror image's). Prints its size, first
normalised values and its norm; ``--output`` saves it unnormalised as a (D,) float32 .npy.
docs/evaluation.md#onnx-export-and-inference.

Exit status: 0 done; 2 a usage or configuration error (a missing or undecodable image, no ``--network`` and no
``model.json``, weights that do not fit the network; with ``--align``: a photo in which no face counts (the line
says why), ``facenet-pytorch`` not installed, with the command that installs it), one line; 130 / 143 interrupted.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from alignment import FacePolicy, add_policy_options, check_policy_options
from eval.faces import face_crop, face_detector
from eval.model_card import calibrated_threshold, card_beside
from eval.model_options import add_model_options, backbone_from_options, check_model_options
from eval.model_source import model_file
from eval.verification import embed
from utils.cli import run_tool, warn
from utils.files import atomic_write

TOOL = "inference"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser, random_init=False)
    parser.add_argument("--image", "--img", required=True, type=Path,
                        help="the aligned face, or with --align a raw photo (--img: arcface_torch's name for it)")
    parser.add_argument("--align", action="store_true",
                        help="detect the face in a raw photo and align it to the ArcFace template first (needs "
                             "facenet-pytorch)")
    add_policy_options(parser)
    parser.add_argument("--output", type=Path,
                        help="save the raw embedding here (.npy, (D,) float32): model.json's calibrated embedding, "
                             "else the flip embedding (the crop's plus its mirror image's)")
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    check_policy_options(parser, args)
    return args


def calibrated_flip(args: argparse.Namespace) -> bool:
    """Whether to embed with the flip: as the first threshold of the model.json beside the model was calibrated,
    and the flip (the verification protocol's) when there is none."""
    card = card_beside(model_file(args.weights, args.onnx))
    calibration = calibrated_threshold(card) if card.is_file() else None
    return calibration.flip if calibration is not None else True


def run(args: argparse.Namespace) -> None:
    model = backbone_from_options(args)
    policy = FacePolicy("largest", args.min_score, args.min_face_size)
    detector = face_detector(args.device, policy) if args.align else None
    face = face_crop(args.image, detector, policy, lambda message: warn(TOOL, f"{message} (--align detects and "
                                                                            f"aligns it)"), print)
    embedding = embed(face[None], model, 1, flip=calibrated_flip(args))[0].astype(np.float32)  # (D,)
    norm = float(np.linalg.norm(embedding))
    shown = ", ".join(f"{v:.4f}" for v in embedding[:8] / max(norm, 1e-12))
    print(f"{args.image}: embedding of size {embedding.size}, norm {norm:.4f}; normalised: [{shown}, ...]")
    if args.output:
        path = args.output if args.output.suffix == ".npy" else Path(f"{args.output}.npy")  # as np.save names it
        atomic_write(path, lambda f: np.save(f, embedding))
        print(f"saved {args.output}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_tool(TOOL, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
