"""Export a trained backbone to ONNX with a dynamic batch axis and check it against torch.

    python scripts/torch2onnx.py --weights work_dirs/ms1mv3_r50/model.pt --output r50.onnx
    python scripts/torch2onnx.py --network r50 --weights backbone.pth --output r50.onnx

The model options are those of every evaluation tool (``eval.model_source``): without ``--network`` the
network is read from ``model.json`` beside ``--weights``. The export runs on the CPU, in fp32. After writing
the file, the script runs onnxruntime and torch on the same random batch and prints the largest absolute
difference of the embeddings; the input is a normalised (N, 3, 112, 112) float32 batch.

Exit status: 0 written and within --tolerance; 1 the difference exceeds --tolerance; 2 a usage or
configuration error (no ``--network`` and no ``model.json``, weights that do not fit the network), one line.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from eval.model_source import add_model_options, build_backbone, check_model_options  # noqa: E402
from utils.files import atomic_write  # noqa: E402
from utils.logging_setup import print_tool_error  # noqa: E402


def export(model: torch.nn.Module, output: Path, image_size: int = 112, opset: int = 17) -> None:
    """Write ``model`` (eval mode, fp32) to ``output``; input "input" (N,3,H,W), output "embedding" (N,D)."""
    model.eval()
    dummy = torch.zeros(1, 3, image_size, image_size)
    output.parent.mkdir(parents=True, exist_ok=True)
    # The TorchScript-based exporter: it needs no extra package (the dynamo exporter needs onnxscript), and it
    # writes to a file object, so the file appears complete or not at all. torch >= 2.9 warns that it is the
    # legacy one on every export, and its internals warn about their own deprecated helpers: a choice made here
    # and torch's own code, nothing the user can act on, so those warnings are not shown.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export",
                                category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
        atomic_write(output, lambda f: torch.onnx.export(
            model, (dummy,), f, dynamo=False, input_names=["input"], output_names=["embedding"],
            dynamic_axes={"input": {0: "batch"}, "embedding": {0: "batch"}}, opset_version=opset,
            do_constant_folding=True))


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
    add_model_options(parser, onnx=False, random_init=False, device=False)
    parser.add_argument("--output", required=True, type=Path, help="the .onnx file to write")
    parser.add_argument("--opset", type=int, default=17)
    parser.add_argument("--batch", type=int, default=4, help="batch size of the torch/onnxruntime check")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest allowed |torch - onnxruntime|")
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    try:
        model = build_backbone(args)
        export(model, args.output, opset=args.opset)
        diff = max_difference(model, args.output, batch=args.batch)
    except (ValueError, OSError) as exc:  # OSError: an --output that cannot be written
        print_tool_error("torch2onnx", exc)
        return 2
    print(f"wrote {args.output} (opset {args.opset}, dynamic batch); max |torch - onnxruntime| = {diff:.2e} "
          f"on a batch of {args.batch}")
    if diff > args.tolerance:
        print(f"torch2onnx: difference {diff:.2e} exceeds --tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
