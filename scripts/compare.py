"""Say whether two photos show the same person: the cosine similarity of their faces' embeddings, and the verdict
at a threshold.

    python scripts/compare.py A.jpg B.jpg --weights work_dirs/ms1mv3_r50/model.pt
    python scripts/compare.py A.jpg B.jpg --weights work_dirs/ms1mv3_r50 --threshold 0.3
    python scripts/compare.py A.jpg B.jpg --weights work_dirs/ms1mv3_r50 --target cfp_fp
    python scripts/compare.py a_crop.png b_crop.png --onnx r50.onnx --no-align
    python scripts/compare.py A.jpg B.jpg --network r50 --weights backbone.pth --threshold 0.25

The model options are those of every evaluation tool (``eval.model_source``; ``--onnx`` runs an exported model).
Each photo, of any size and format, goes through the detection and alignment of the training data
(``alignment.align_photo``: MTCNN from the optional ``facenet-pytorch``, the largest face nearest the centre,
warped onto the ArcFace 112x112 template); ``--no-align`` takes the photos as aligned 112x112 crops (other sizes
are resized, with a warning). A face's embedding is the sum of the embeddings of the crop and of its mirror
image, as the verification protocol computes it (``eval.verification``), so the similarity is the one the
thresholds of ``eval.verify`` were calibrated on.

The threshold: ``--threshold T`` (a cosine similarity in [-1, 1]), else the one ``python -m eval.verify
--save-threshold`` wrote into the ``model.json`` beside the weights (or the ONNX file) for a verification set:
``--target NAME``'s, or, without ``--target``, the first in the card (the first target saved into it: with
``eval.verify``'s default ``--targets``, lfw). Two faces are the same person when their similarity is above the
threshold. Prints two lines:

    A.jpg ~ B.jpg: cosine similarity 0.6132
    same person: above the threshold 0.2350 (calibrated on lfw by eval.verify: accuracy 0.99800 on 6000 pairs)

With no threshold known (no ``--threshold``, and no ``model.json`` or none calibrated in it) the second line
says so and how to get one; that is not an error.

Exit status: 0 compared (whatever the verdict, or no threshold known); 2 a usage or configuration error, one
line: a photo that cannot be read, a photo in which no face is found, ``facenet-pytorch`` not installed (with
the command that installs it), no ``--network`` and no ``model.json``, weights that do not fit the network, a
``--target`` the card does not hold, a card whose threshold is not a number in [-1, 1].
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from alignment import DetectorUnavailable, FaceDetector, align_photo, read_photo  # noqa: E402
from dataset.images import resize  # noqa: E402
from eval.model_card import INPUT_SIZE, THRESHOLDS_KEY, card_beside, card_with_thresholds  # noqa: E402
from eval.model_source import (add_model_options, build_backbone, check_model_options, onnx_file,  # noqa: E402
                               weights_file)
from eval.verification import embed  # noqa: E402
from utils.cli import print_error  # noqa: E402

TOOL = "compare"
CALIBRATE = "python -m eval.verify {model} --data-dir DIR --targets lfw --save-threshold"


@dataclass(frozen=True)
class Threshold:
    """A cosine-similarity threshold (``value``; None: none known) and where it came from, in words."""

    value: float | None
    source: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="compare.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path, help="a photo of a face")
    parser.add_argument("second", type=Path, help="another photo")
    add_model_options(parser, random_init=False)
    parser.add_argument("--align", action=argparse.BooleanOptionalAction, default=True,
                        help="detect the face in each photo and align it to the ArcFace template (default); "
                             "--no-align: the photos are aligned 112x112 crops")
    parser.add_argument("--threshold", type=float, metavar="T",
                        help="same person above this cosine similarity (default: model.json's calibrated one)")
    parser.add_argument("--target", metavar="NAME",
                        help="use the threshold model.json holds for this verification set (default: its first)")
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    if args.threshold is not None and not -1.0 <= args.threshold <= 1.0:
        parser.error(f"--threshold is a cosine similarity, in [-1, 1]; got {args.threshold}")
    if args.threshold is not None and args.target is not None:
        parser.error(f"--threshold {args.threshold} and --target {args.target} both choose the threshold; give one")
    return args


def model_flags(args: argparse.Namespace) -> str:
    """The model option of this command, for the eval.verify command line the output suggests."""
    return f"--onnx {args.onnx}" if args.onnx is not None else f"--weights {args.weights}"


def calibrated(card: Path, target: str | None) -> tuple[str, dict[str, Any]] | None:
    """``(target, entry)`` of the threshold ``card`` holds for ``target`` (None: its first); None when it holds
    none and no ``target`` is asked for. ``ValueError`` naming the card for one that cannot be read, or that
    lacks ``target``."""
    thresholds = card_with_thresholds(card).get(THRESHOLDS_KEY, {})
    if target is None:
        return next(iter(thresholds.items()), None)
    if target not in thresholds:
        held = f"holds thresholds for {', '.join(thresholds)}" if thresholds else "holds no calibrated threshold"
        raise ValueError(f"--target {target}: {card} {held}")
    return target, thresholds[target]


def find_threshold(args: argparse.Namespace) -> Threshold:
    """``--threshold``, else the calibrated one of the model.json beside the model (``calibrated``)."""
    if args.threshold is not None:
        return Threshold(args.threshold, "--threshold")
    card = card_beside(onnx_file(args.onnx) if args.onnx is not None else weights_file(args.weights))
    if not card.is_file():
        if args.target is not None:
            raise ValueError(f"--target {args.target}: {card} does not exist")
        return Threshold(None, f"there is no {card} to hold a calibrated one; pass --threshold")
    found = calibrated(card, args.target)
    if found is None:
        return Threshold(None, f"{card} holds no calibrated one; pass --threshold, or calibrate one: "
                               f"{CALIBRATE.format(model=model_flags(args))}")
    target, entry = found
    value = entry.get("cosine") if isinstance(entry, dict) else None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not -1.0 <= value <= 1.0:
        raise ValueError(f"{card}: {THRESHOLDS_KEY}.{target}.cosine is {value!r}; expected a number in [-1, 1] "
                         f"(written by eval.verify --save-threshold)")
    acc, pairs = entry.get("acc"), entry.get("pairs")
    scores = f": accuracy {acc:.5f} on {pairs} pairs" if isinstance(acc, float) and isinstance(pairs, int) else ""
    return Threshold(float(value), f"calibrated on {target} by eval.verify{scores}")


def read_crop(path: Path) -> torch.Tensor:
    """An aligned crop as it is (``--no-align``): (3, 112, 112) uint8; other sizes are resized, with a warning."""
    image = read_photo(path)  # (3, h, w)
    if tuple(image.shape[1:]) != INPUT_SIZE:
        print(f"{TOOL}: warning: {path} is {image.shape[2]}x{image.shape[1]}, not {INPUT_SIZE[1]}x{INPUT_SIZE[0]}: "
              f"resized; is it an aligned crop? (without --no-align the face is detected and aligned)",
              file=sys.stderr)
        image = resize(image, INPUT_SIZE)
    return image


@torch.no_grad()
def cosine_similarity(model: torch.nn.Module, faces: torch.Tensor) -> float:
    """The cosine similarity of the two faces ``faces`` (2, 3, 112, 112) uint8, each embedded as the sum of the
    embeddings of the crop and of its mirror image (the verification protocol's flip)."""
    model.eval()
    both = embed(faces, model, batch_size=2) + embed(faces, model, batch_size=2, flip=True)  # (2, D) float64
    a, b = both / np.maximum(np.linalg.norm(both, axis=1, keepdims=True), 1e-12)  # (D,) each
    return float(a @ b)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        threshold = find_threshold(args)  # before the photos and the model: a --target the card lacks stops here
        if args.align:
            detector = FaceDetector(device=args.device)
            faces = [align_photo(path, detector) for path in (args.first, args.second)]
        else:
            faces = [read_crop(path) for path in (args.first, args.second)]
        similarity = cosine_similarity(build_backbone(args), torch.stack(faces))  # (2, 3, 112, 112)
    except (ValueError, OSError, DetectorUnavailable) as exc:
        # ValueError: alignment's PhotoError too (no face, a photo that cannot be read); DetectorUnavailable: its
        # message is the command that installs facenet-pytorch.
        print_error(TOOL, exc)
        return 2
    print(f"{args.first} ~ {args.second}: cosine similarity {similarity:.4f}")
    if threshold.value is None:
        print(f"no threshold known: {threshold.source}")
    else:
        verdict = "same person: above" if similarity > threshold.value else "different people: not above"
        print(f"{verdict} the threshold {threshold.value:.4f} ({threshold.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
