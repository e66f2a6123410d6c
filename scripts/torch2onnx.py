"""Export a trained backbone to ONNX with a dynamic batch axis and check it against torch.

    python scripts/torch2onnx.py --network r50 --weights work_dirs/ms1mv3_r50/model.pt --output r50.onnx

After writing the file, the script runs onnxruntime and torch on the same random batch and prints the
largest absolute difference of the embeddings; it exits non-zero when that exceeds --tolerance.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def export(model: torch.nn.Module, output: Path, image_size: int = 112, opset: int = 17) -> None:
    """Write ``model`` (eval mode, fp32) to ``output``; input "input" (N,3,H,W), output "embedding" (N,D)."""
    model.eval()
    dummy = torch.zeros(1, 3, image_size, image_size)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    # The TorchScript-based exporter: it needs no extra package (the dynamo exporter needs onnxscript).
    torch.onnx.export(model, (dummy,), str(tmp), dynamo=False, input_names=["input"], output_names=["embedding"],
                      dynamic_axes={"input": {0: "batch"}, "embedding": {0: "batch"}}, opset_version=opset,
                      do_constant_folding=True)
    tmp.replace(output)


def max_difference(model: torch.nn.Module, onnx_path: Path, batch: int = 4, image_size: int = 112,
                   seed: int = 0) -> float:
    """Largest |torch − onnxruntime| over the embeddings of one random batch in [-1, 1]."""
    import onnxruntime

    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(batch, 3, image_size, image_size, generator=generator) * 2 - 1
    with torch.no_grad():
        expected = model.eval()(images).numpy()
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: images.numpy()})[0]
    return float(np.abs(got - expected).max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--network", required=True, help="backbone name, e.g. r50, r100, mbf, tiny")
    parser.add_argument("--weights", required=True, help="model.pt (ours or an official backbone.pth)")
    parser.add_argument("--output", required=True, help="the .onnx file to write")
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--network-kwargs", default="{}",
                        help='JSON of extra backbone arguments, e.g. \'{"widths": [8, 16, 16, 32]}\'')
    parser.add_argument("--opset", type=int, default=17)
    parser.add_argument("--batch", type=int, default=4, help="batch size of the torch/onnxruntime check")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest allowed |torch - onnxruntime|")
    args = parser.parse_args(argv)

    from backbones import get_model
    from utils.files import load_weights

    try:
        kwargs = json.loads(args.network_kwargs)
        model = get_model(args.network, num_features=args.embedding_size, **kwargs)
        load_weights(model, args.weights, network=args.network)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"torch2onnx: {exc}", file=sys.stderr)
        return 2
    output = Path(args.output)
    export(model, output, opset=args.opset)
    diff = max_difference(model, output, batch=args.batch)
    print(f"wrote {output} (opset {args.opset}, dynamic batch); max |torch - onnxruntime| = {diff:.2e} "
          f"on a batch of {args.batch}")
    if diff > args.tolerance:
        print(f"torch2onnx: difference {diff:.2e} exceeds --tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
