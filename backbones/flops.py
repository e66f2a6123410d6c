"""Parameter and compute counts of a backbone.

``torch.utils.flop_counter.FlopCounterMode`` counts 2 FLOPs per multiply-add of convolutions and matrix
products (element-wise ops such as BN, PReLU and the residual add are not counted). Published
face-recognition figures (r50 ≈ 6.3 "GFLOPs", r100 ≈ 12.1) count multiply-adds, so this module reports
multiply-adds (MACs) = counted FLOPs / 2 and prints both.

Usage: ``python -m backbones.flops r50 [--num-features 512] [--image-size 112]``
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def count_flops(model: nn.Module, image_size: int = 112) -> tuple[int, int]:
    """Return ``(parameters, multiply-adds)`` of one forward of ``model`` on a (1, 3, S, S) image.

    Parameters include frozen ones (the official embedding BatchNorm scale). The forward runs in eval
    mode without grad on a zero image on the model's device (a model on the ``meta`` device is counted
    without allocating memory); the model's training mode is restored afterwards.
    """
    params = sum(p.numel() for p in model.parameters())
    first = next(model.parameters())
    x = torch.zeros(1, 3, image_size, image_size, device=first.device, dtype=first.dtype)  # (1, 3, S, S)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        model.train(was_training)
    flops = counter.get_total_flops()
    assert flops % 2 == 0, f"flop_counter should count 2 per multiply-add, got an odd total {flops}"
    return params, flops // 2


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; prints parameters, GMACs (the published 'GFLOPs') and FLOPs."""
    from . import get_model, list_models

    parser = argparse.ArgumentParser(prog="python -m backbones.flops", description=__doc__.splitlines()[0])
    parser.add_argument("name", help=f"backbone name, one of: {', '.join(list_models())}")
    parser.add_argument("--num-features", type=int, default=512, help="embedding size (default 512)")
    parser.add_argument("--image-size", type=int, default=112, help="square input side (default 112)")
    args = parser.parse_args(argv)
    try:
        # Built on the meta device: shapes only, so even r200 is counted instantly without memory.
        with torch.device("meta"):
            model = get_model(args.name, num_features=args.num_features, input_size=args.image_size)
    except ValueError as err:
        parser.error(str(err))
    params, macs = count_flops(model, args.image_size)
    print(f"backbone: {args.name}  input: 3x{args.image_size}x{args.image_size}  embedding: {args.num_features}")
    print(f"parameters: {params:,} ({params / 1e6:.2f} M)")
    print(f"GMACs (multiply-adds, the published 'GFLOPs'): {macs / 1e9:.3f}")
    print(f"GFLOPs (2 per multiply-add, torch flop_counter): {2 * macs / 1e9:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
