"""Score a backbone on verification `.bin` sets (LFW, CFP-FP, AgeDB-30, ...) with the published protocol.

    python -m eval.verify --network r50 --weights model.pt --data-dir DIR --targets lfw,cfp_fp,agedb_30
    python -m eval.verify --onnx model.onnx --data-dir DIR --targets lfw
    python -m eval.verify --network r50 --random-init 0 --data-dir DIR     # untrained baseline

A target is the name of ``DIR/<name>.bin``, with or without the ``.bin``. Prints one row per target, every
rate a fraction as in the training log: pairs, accuracy ± std over the 10 folds (flip), accuracy without
flip, VAL ± std at FAR=1e-3 and the FAR it reached (a set with few different pairs cannot reach 1e-3),
mean embedding norm (XNorm) and the chosen distance threshold. ``--json`` writes the same numbers,
``--roc`` a ROC plot of every target.

Exit status: 0 done; 1 bad data (a `.bin` that is truncated, not a verification file, holds an image that
does not decode, or refers to code), one line naming the file; 2 a usage or configuration error (bad
options, a missing file, weights that do not fit the network), one line.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from eval.verification import BadBinError, RefusedGlobal, format_table, load_bin, test
from utils.files import load_weights

# Keys of test()'s result written to --json (the ROC arrays go to --roc instead).
JSON_KEYS = ("pairs", "acc", "acc_std", "acc_noflip", "val", "val_std", "far", "xnorm", "threshold")


class OnnxBackbone(nn.Module):
    """An exported model run by ONNX Runtime behind the ``nn.Module`` interface ``test()`` expects:
    (N, 3, H, W) float32 in, (N, D) float32 out, on the CPU (ORT copies to its own device)."""

    def __init__(self, path: str | os.PathLike, device: str = "cpu") -> None:
        super().__init__()
        import onnxruntime as ort  # only this path needs it

        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(path), providers=providers)
        except Exception as exc:  # ORT raises its own exception types for files that are not ONNX models
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ValueError(f"{path}: not a loadable ONNX model ({type(exc).__name__}: {first})") from exc
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise ValueError(f"{path}: expected a model with one input (images), found "
                             f"{[i.name for i in inputs]}")
        self.input_name = inputs[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.session.run(None, {self.input_name: x.detach().cpu().float().numpy()})[0]  # (N, D)
        return torch.from_numpy(out)


def model_arg(text: str) -> tuple[str, Any]:
    """argparse type of ``--model-arg KEY=VALUE``: VALUE as a Python literal, else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. widths=[4,8,8,16]), got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a bare word is a string


def build_backbone(args: argparse.Namespace) -> nn.Module:
    """The network to evaluate: an ONNX model, trained weights, or a seeded untrained network."""
    if args.onnx is not None:
        if not args.onnx.is_file():
            raise FileNotFoundError(f"ONNX model not found: {args.onnx}")
        return OnnxBackbone(args.onnx, args.device)
    from backbones import get_model

    if args.random_init is not None:
        torch.manual_seed(args.random_init)  # the same SEED gives the same untrained network
    model = get_model(args.network, num_features=args.embedding_size, **dict(args.model_arg))
    if args.weights is not None:
        load_weights(model, args.weights, network=args.network)
    return model.to(args.device)


def write_roc_curves(path: Path, curves: dict[str, tuple[np.ndarray, np.ndarray]], title: str,
                     log_fpr: bool = False) -> None:
    """One PNG with a ROC curve (TPR over FPR) per entry of ``curves`` (label -> (fpr, tpr))."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for label, (fpr, tpr) in curves.items():
        ax.plot(fpr, tpr, label=label)
    if log_fpr:
        ax.set_xscale("log")
        ax.set_xlim(1e-6, 1)
    else:
        ax.set_xlim(0, 1)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title=title, ylim=(0, 1.01))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options that say which model to evaluate (shared by eval.verify and eval.ijb)."""
    p.add_argument("--network", help="backbone name (backbones.list_models()); not used with --onnx")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--weights", type=Path, help="state_dict file (official insightface layout)")
    source.add_argument("--onnx", type=Path, help="exported ONNX model, run with onnxruntime")
    source.add_argument("--random-init", type=int, metavar="SEED", help="evaluate an untrained network seeded SEED")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--embedding-size", type=int, default=512)
    p.add_argument("--model-arg", type=model_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="extra keyword for backbones.get_model, e.g. widths=[16,32,64,128] (repeatable)")


def check_model_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject combinations of the model options that cannot work (exits through ``p.error``)."""
    if args.onnx is None and not args.network:
        p.error("--network is required with --weights or --random-init")
    if args.onnx is not None and (args.network or args.model_arg):
        p.error("--onnx evaluates the exported model as it is; --network/--model-arg do not apply")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.verify", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--data-dir", type=Path, required=True, help="folder holding <target>.bin")
    p.add_argument("--targets", default="lfw,cfp_fp,agedb_30",
                   help="comma-separated names of DIR/<name>.bin, with or without .bin")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--roc", type=Path, help="write a ROC plot (PNG) of all targets")
    p.add_argument("--json", type=Path, help="write {target: {pairs, acc, ...}} as JSON")
    args = p.parse_args(argv)
    check_model_arguments(p, args)
    args.targets = target_paths(p, args.data_dir, args.targets)
    return args


def target_paths(p: argparse.ArgumentParser, data_dir: Path, targets: str) -> dict[str, Path]:
    """``{name: DIR/<name>.bin}`` for ``--targets``; ``lfw`` and ``lfw.bin`` name the same file."""
    paths: dict[str, Path] = {}
    for t in (t.strip() for t in targets.split(",")):
        if not t:
            continue
        name = t.removesuffix(".bin")
        if Path(name).name in paths:
            p.error(f"--targets names {Path(name).name!r} twice ({targets!r})")
        paths[Path(name).name] = data_dir / f"{name}.bin"
    if not paths:
        p.error("--targets is empty")
    return paths


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Evaluate every target; print the table; write --json / --roc. Returns test()'s results."""
    paths: dict[str, Path] = args.targets
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"verification file(s) not found: {', '.join(missing)}")
    backbone = build_backbone(args)
    results: dict[str, dict[str, Any]] = {}
    for target, path in paths.items():
        data = load_bin(path)
        with tqdm(total=2 * data.images.shape[0], desc=target, unit="img", file=sys.stderr, leave=False) as bar:
            results[target] = test(data, backbone, args.batch_size, progress=bar.update)
    print("\n".join(format_table(results)))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {t: {k: r[k] for k in JSON_KEYS} for t, r in results.items()}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if args.roc is not None:
        args.roc.parent.mkdir(parents=True, exist_ok=True)
        curves = {f"{t} (acc {r['acc']:.4f})": (r["fpr"], r["tpr"]) for t, r in results.items()}
        write_roc_curves(args.roc, curves, str(args.onnx or args.weights or f"{args.network} seed {args.random_init}"))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (BadBinError, RefusedGlobal) as exc:
        # Bad data: say which file and what is wrong in one line; a traceback would only hide it.
        print("eval.verify: error: " + " ".join(str(exc).split()), file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError, pickle.UnpicklingError) as exc:
        # The command or its configuration was wrong (a missing file, weights for another network).
        print("eval.verify: error: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
