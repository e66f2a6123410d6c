"""Export a trained backbone to ONNX with a dynamic batch axis and check it against torch.

    python scripts/torch2onnx.py --weights work_dirs/ms1mv3_r50/model.pt --output r50.onnx
    python scripts/torch2onnx.py --network r50 --weights backbone.pth --output r50.onnx
    python scripts/torch2onnx.py work_dirs/ms1mv3_r50 --simplify    # as arcface_torch's: writes .../model.onnx

The model options are ``eval.model_options``'. As in arcface_torch's script, the weights may also be the first
argument, ``--output`` defaults to ``model.onnx`` beside them, and ``--simplify`` runs onnxsim (``pip install
onnxsim``) before the file is written. The export runs on the CPU in fp32 and takes a normalised (N, 3, 112, 112)
float32 batch; onnxruntime and torch then embed the same random batch and the largest absolute difference is
printed. docs/evaluation.md#onnx-export-and-inference.

Exit status: 0 written and within --tolerance; 1 the difference exceeds --tolerance; 2 a usage or
configuration error (no ``--network`` and no ``model.json``, weights that do not fit the network, --simplify
without onnxsim or refused by onnxsim's own check), one line. The export and the check are
``backbones.onnx_export``.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backbones.onnx_export import export, max_difference
from eval.model_options import add_model_options, backbone_from_options, check_model_options
from eval.model_source import weights_file
from utils.cli import UsageError, run_tool

ONNX_FILE = "model.onnx"  # --output's default, beside the weights, as arcface_torch's torch2onnx.py writes it


def convert(args: argparse.Namespace) -> int:
    """Export, check against torch, say what was written; 1 when the difference exceeds --tolerance."""
    if args.simplify and importlib.util.find_spec("onnxsim") is None:
        raise UsageError("--simplify needs the onnxsim package, which this Python does not have: pip install onnxsim")
    output = args.output or weights_file(args.weights).parent / ONNX_FILE
    model = backbone_from_options(args)
    export(model, output, opset=args.opset, simplify=args.simplify)
    diff = max_difference(model, output, batch=args.batch)
    simplified_by = ", simplified by onnxsim" if args.simplify else ""
    print(f"wrote {output} (opset {args.opset}, dynamic batch{simplified_by}); max |torch - onnxruntime| = "
          f"{diff:.2e} on a batch of {args.batch}")
    if diff > args.tolerance:
        print(f"torch2onnx: difference {diff:.2e} exceeds --tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser, onnx=False, random_init=False, device=False, weights_argument=True)
    parser.add_argument("--output", type=Path,
                        help=f"the .onnx file to write (default: {ONNX_FILE} beside the weights)")
    parser.add_argument("--simplify", action="store_true", help="simplify the model with onnxsim (pip install onnxsim)")
    parser.add_argument("--opset", type=int, default=17)
    parser.add_argument("--batch", type=int, default=4, help="batch size of the torch/onnxruntime check")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest allowed |torch - onnxruntime|")
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    return run_tool("torch2onnx", lambda: convert(args))


if __name__ == "__main__":
    sys.exit(main())
