"""Compute the embedding of one aligned face image (112x112; other sizes are resized).

    python scripts/inference.py --network r50 --weights model.pt --image face.jpg [--output emb.npy]

Prints the L2-normalised embedding's size and first values, and its norm before normalisation; --output
saves the raw embedding as a .npy file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def read_face(path: str | Path, image_size: int = 112) -> torch.Tensor:
    """The image at ``path`` as a (1, 3, S, S) float tensor normalised to [-1, 1] (RGB)."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.functional import resize

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image not found: {path}")
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    try:
        image = decode_image(data, mode=ImageReadMode.RGB)  # (3, H, W) uint8
    except RuntimeError as exc:
        raise ValueError(f"{path}: not a decodable JPEG/PNG image ({exc})") from exc
    if image.shape[1:] != (image_size, image_size):
        image = resize(image, [image_size, image_size], antialias=True)
    return ((image.float() - 127.5) / 127.5).unsqueeze(0)


@torch.no_grad()
def embed(model: torch.nn.Module, image: torch.Tensor) -> np.ndarray:
    """The raw (unnormalised) embedding of a (1, 3, S, S) image as a (D,) array."""
    return model.eval()(image)[0].numpy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--network", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--image", required=True)
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--network-kwargs", default="{}", help="JSON of extra backbone arguments")
    parser.add_argument("--output", help="save the raw embedding here (.npy)")
    args = parser.parse_args(argv)

    from backbones import get_model
    from utils.files import load_weights

    try:
        model = get_model(args.network, num_features=args.embedding_size, **json.loads(args.network_kwargs))
        load_weights(model, args.weights, network=args.network)
        embedding = embed(model, read_face(args.image))
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"inference: {exc}", file=sys.stderr)
        return 2
    norm = float(np.linalg.norm(embedding))
    shown = ", ".join(f"{v:.4f}" for v in embedding[:8] / max(norm, 1e-12))
    print(f"{args.image}: embedding of size {embedding.size}, norm {norm:.4f}; normalised: [{shown}, ...]")
    if args.output:
        np.save(args.output, embedding)
        print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
