"""Export a trained backbone to ONNX with a dynamic batch axis and check it against torch.

    python scripts/torch2onnx.py --weights work_dirs/ms1mv3_r50/model.pt --output r50.onnx
    python scripts/torch2onnx.py --network r50 --weights backbone.pth --output r50.onnx
    python scripts/torch2onnx.py work_dirs/ms1mv3_r50 --simplify    # as arcface_torch's: writes .../model.onnx

The model options are those of every evaluation tool (``eval.model_options``): without ``--network`` the
network is read from ``model.json`` beside the weights. As in arcface_torch's script, the weights may also be
the first argument instead of ``--weights``, a folder means its ``model.pt``, and ``--output`` defaults to
``model.onnx`` beside the weights; ``--simplify`` runs onnxsim (``pip install onnxsim``) on the exported
model before it is written. The export runs on the CPU, in fp32. After writing the file, the script runs
onnxruntime and torch on the same random batch and prints the largest absolute difference of the embeddings;
the input is a normalised (N, 3, 112, 112) float32 batch.

Exit status: 0 written and within --tolerance; 1 the difference exceeds --tolerance; 2 a usage or
configuration error (no ``--network`` and no ``model.json``, weights that do not fit the network, --simplify
without onnxsim or refused by onnxsim's own check), one line.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from eval.model_options import add_model_options, backbone_from_options, check_model_options  # noqa: E402
from eval.model_source import weights_file  # noqa: E402
from utils.files import atomic_write  # noqa: E402
from utils.cli import print_error  # noqa: E402

ONNX_FILE = "model.onnx"  # --output's default, beside the weights, as arcface_torch's torch2onnx.py writes it


def simplified(data: bytes) -> bytes:
    """The serialised ONNX model ``data`` simplified by onnxsim (constants folded, redundant nodes removed), as
    arcface_torch's ``--simplify`` does; ``ValueError`` (one line) when onnxsim fails or its own check of the
    result does."""
    import onnx
    import onnxsim  # only --simplify needs it; main checks that it is installed

    try:
        model, checked = onnxsim.simplify(onnx.load_model_from_string(data))
    except Exception as exc:  # onnxsim and onnx raise their own exception types
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"--simplify: onnxsim failed ({type(exc).__name__}: {first}); export without --simplify") \
            from exc
    if not checked:
        raise ValueError("--simplify: onnxsim's check found the simplified model's outputs differ from the exported "
                         "one's; export without --simplify")
    return model.SerializeToString()


def export(model: torch.nn.Module, output: Path, image_size: int = 112, opset: int = 17,
           simplify: bool = False) -> None:
    """Write ``model`` (eval mode, fp32) to ``output``; input "input" (N,3,H,W), output "embedding" (N,D);
    ``simplify``: through ``simplified`` (onnxsim) first."""
    model.eval()
    dummy = torch.zeros(1, 3, image_size, image_size)
    buffer = io.BytesIO()
    # The TorchScript-based exporter: it needs no extra package (the dynamo exporter needs onnxscript), and it
    # writes to a file object: here a buffer, which --simplify may rewrite, then written atomically, so the file
    # appears complete or not at all. torch >= 2.9 warns that it is the legacy one on every export, and its
    # internals warn about their own deprecated helpers: a choice made here and torch's own code, nothing the
    # user can act on, so those warnings are not shown.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export",
                                category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
        torch.onnx.export(model, (dummy,), buffer, dynamo=False, input_names=["input"], output_names=["embedding"],
                          dynamic_axes={"input": {0: "batch"}, "embedding": {0: "batch"}}, opset_version=opset,
                          do_constant_folding=True)
    data = simplified(buffer.getvalue()) if simplify else buffer.getvalue()
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(output, lambda f: f.write(data))


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
    if args.simplify and importlib.util.find_spec("onnxsim") is None:
        print("torch2onnx: error: --simplify needs the onnxsim package, which this Python does not have: "
              "pip install onnxsim", file=sys.stderr)
        return 2
    try:
        output = args.output or weights_file(args.weights).parent / ONNX_FILE
        model = backbone_from_options(args)
        export(model, output, opset=args.opset, simplify=args.simplify)
        diff = max_difference(model, output, batch=args.batch)
    except (ValueError, OSError) as exc:  # OSError: an --output that cannot be written
        print_error("torch2onnx", exc)
        return 2
    simplified_by = ", simplified by onnxsim" if args.simplify else ""
    print(f"wrote {output} (opset {args.opset}, dynamic batch{simplified_by}); max |torch - onnxruntime| = "
          f"{diff:.2e} on a batch of {args.batch}")
    if diff > args.tolerance:
        print(f"torch2onnx: difference {diff:.2e} exceeds --tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
