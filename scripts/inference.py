"""Compute the embedding of one aligned face image (112x112; other sizes are resized), or of the face in a raw
photo (``--align``).

    python scripts/inference.py --weights work_dirs/ms1mv3_r50/model.pt --image face.jpg [--output emb.npy]
    python scripts/inference.py --network r50 --weights backbone.pth --image face.jpg
    python scripts/inference.py --network r50 --weight backbone.pth --img face.jpg   # arcface_torch's names
    python scripts/inference.py --weights work_dirs/ms1mv3_r50 --img raw.jpg --align  # a photo as it was taken
    python scripts/inference.py --onnx work_dirs/ms1mv3_r50/model.onnx --image face.jpg  # the exported model

The model options are those of every evaluation tool (``eval.model_source``): without ``--network`` the
network is read from ``model.json`` beside the weights (``--weights`` may be the run folder). arcface_torch's
``--img`` is another name of ``--image``, and its ``--weight`` is argparse's abbreviation of ``--weights``. An
``.onnx`` file runs with onnxruntime, given as ``--onnx`` or as ``--weights``.
Prints the L2-normalised embedding's size and first values, and its norm before normalisation; --output saves
the raw embedding as a .npy file.

``--align`` takes a photo of any size and format (``alignment.read_photo``), finds the faces with MTCNN (the
optional ``facenet-pytorch`` package) and embeds the largest face nearest the centre, aligned onto the ArcFace
112x112 template by ``alignment.align_photo``: the detection and alignment ``scripts/prepare_faces.py`` gives
the training data. Without ``--align`` the image is taken as an aligned crop.

Exit status: 0 done; 2 a usage or configuration error (a missing or undecodable image, no ``--network`` and
no ``model.json``, weights that do not fit the network; with ``--align``: a photo that cannot be read, a photo
in which no face is found, ``facenet-pytorch`` not installed, with the command that installs it), one line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from alignment import DetectorUnavailable, FaceDetector, align_photo  # noqa: E402
from dataset.images import decode, normalise, resize  # noqa: E402
from eval.model_card import INPUT_SIZE  # noqa: E402
from eval.model_source import add_model_options, build_backbone, check_model_options  # noqa: E402
from utils.files import path_problem  # noqa: E402
from utils.cli import print_error  # noqa: E402


def read_face(path: str | Path, image_size: tuple[int, int] = INPUT_SIZE) -> torch.Tensor:
    """The image at ``path`` as a uint8 (1, 3, H, W) RGB tensor, resized to ``image_size`` when it differs."""
    path = Path(path)
    if (problem := path_problem(path)) is not None:
        raise FileNotFoundError(f"image {problem}: {path}")
    image = decode(path.read_bytes(), str(path))  # (3, h, w) uint8
    if tuple(image.shape[1:]) != tuple(image_size):
        image = resize(image, image_size)  # (3, H, W)
    return image.unsqueeze(0)


@torch.no_grad()
def embed(model: torch.nn.Module, image: torch.Tensor, device: str = "cpu") -> np.ndarray:
    """The raw (unnormalised) embedding of a uint8 (1, 3, H, W) image as a (D,) array."""
    return model.eval()(normalise(image.to(device)))[0].float().cpu().numpy()  # (D,)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser, random_init=False)
    parser.add_argument("--image", "--img", required=True, type=Path,
                        help="the aligned face, or with --align a raw photo (--img: arcface_torch's name for it)")
    parser.add_argument("--align", action="store_true",
                        help="detect the face in a raw photo and align it to the ArcFace template first (needs "
                             "facenet-pytorch)")
    parser.add_argument("--output", type=Path, help="save the raw embedding here (.npy)")
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    try:
        model = build_backbone(args)
        if args.align:  # the largest face nearest the centre, (1, 3, 112, 112) uint8
            face = align_photo(args.image, FaceDetector(device=args.device)).unsqueeze(0)
        else:
            face = read_face(args.image)
        embedding = embed(model, face, args.device)
        norm = float(np.linalg.norm(embedding))
        shown = ", ".join(f"{v:.4f}" for v in embedding[:8] / max(norm, 1e-12))
        print(f"{args.image}: embedding of size {embedding.size}, norm {norm:.4f}; normalised: [{shown}, ...]")
        if args.output:
            np.save(args.output, embedding)
            print(f"saved {args.output}")
    except (ValueError, OSError, DetectorUnavailable) as exc:
        # OSError: an --output that cannot be written; ValueError: alignment's PhotoError too (no face, a photo
        # that cannot be read); DetectorUnavailable: its message is the command that installs facenet-pytorch.
        print_error("inference", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
