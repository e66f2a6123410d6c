"""A backbone written as an ONNX file, and the check that onnxruntime computes what torch does.

``export`` writes a network in eval mode, fp32, with input ``"input"`` (N, 3, H, W) and output ``"embedding"``
(N, D), the batch axis dynamic, through the TorchScript exporter as arcface_torch's ``torch2onnx.py`` does
(optionally simplified by onnxsim, as its ``--simplify``); the file is written atomically. ``max_difference`` runs
the file with onnxruntime and the network with torch on one random batch. ``onnx``, ``onnxsim`` and
``onnxruntime`` are imported only when used. The command line is ``scripts/torch2onnx.py`` (docs/evaluation.md).
"""
from __future__ import annotations

import io
import warnings
from pathlib import Path

import torch

from utils.files import atomic_write


def simplified(data: bytes) -> bytes:
    """The serialised ONNX model ``data`` simplified by onnxsim (constants folded, redundant nodes removed), as
    arcface_torch's ``--simplify`` does; ``ValueError`` (one line) when onnxsim fails or its own check of the
    result does."""
    import onnx
    import onnxsim

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


def export(model: torch.nn.Module, output: str | Path, image_size: int = 112, opset: int = 17,
           simplify: bool = False) -> None:
    """Write ``model`` (eval mode, fp32) to ``output``; input "input" (N,3,H,W), output "embedding" (N,D);
    ``simplify``: through ``simplified`` (onnxsim) first."""
    output = Path(output)
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


def max_difference(model: torch.nn.Module, onnx_path: str | Path, batch: int = 4, image_size: int = 112,
                   seed: int = 0) -> float:
    """Largest |torch − onnxruntime| over the embeddings of one random batch in [-1, 1]."""
    import onnxruntime

    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(batch, 3, image_size, image_size, generator=generator) * 2 - 1
    with torch.no_grad():
        expected = model.eval()(images)
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: images.numpy()})[0]
    return float((torch.from_numpy(got) - expected).abs().max())
