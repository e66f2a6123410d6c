"""Score a backbone on verification `.bin` sets (LFW, CFP-FP, AgeDB-30, ...) with the published protocol.

    python -m eval.verify --weights work_dirs/ms1mv3_r50/model.pt --data-dir DIR --targets lfw,cfp_fp,agedb_30
    python -m eval.verify --network r50 --weights backbone.pth --data-dir DIR --targets lfw
    python -m eval.verify --onnx model.onnx --data-dir DIR --targets lfw
    python -m eval.verify --network r50 --random-init 0 --data-dir DIR     # untrained baseline

The model options are those of every evaluation tool (``eval.model_source``): without ``--network`` the
network is read from ``model.json`` beside ``--weights``, which the trainer writes. A target is the name of
``DIR/<name>.bin``, with or without the ``.bin``. Prints one row per target, every rate a fraction as in
the training log: pairs, accuracy ± std over the 10 folds (flip), accuracy without flip, VAL ± std at
FAR=1e-3 and the FAR it reached (a set with few different pairs cannot reach 1e-3), mean embedding norm
(XNorm) and the chosen distance threshold. ``--json`` writes the same numbers, ``--roc`` a ROC plot of
every target.

Exit status: 0 done; 1 bad data (a `.bin` that is truncated, not a verification file, holds an image that
does not decode, or refers to code), one line naming the file; 2 a usage or configuration error (bad
options, a missing file, no ``--network`` and no ``model.json``, weights that do not fit the network), one
line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from dataset.verification_set import BadBinError, RefusedGlobal, load_bin
from eval.model_source import add_model_options, build_backbone, check_model_options
from eval.plots import write_roc_curves
from eval.verification import format_table, test
from utils.files import unopenable_files
from utils.logging_setup import print_tool_error

# Keys of test()'s result written to --json (the ROC arrays go to --roc instead).
JSON_KEYS = ("pairs", "acc", "acc_std", "acc_noflip", "val", "val_std", "far", "xnorm", "threshold")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.verify", description=__doc__.split("\n\n")[0])
    add_model_options(p, precision=True)
    p.add_argument("--data-dir", type=Path, required=True, help="folder holding <target>.bin")
    p.add_argument("--targets", default="lfw,cfp_fp,agedb_30",
                   help="comma-separated names of DIR/<name>.bin, with or without .bin")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--roc", type=Path, help="write a ROC plot (PNG) of all targets")
    p.add_argument("--json", type=Path, help="write {target: {pairs, acc, ...}} as JSON")
    args = p.parse_args(argv)
    check_model_options(p, args)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
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
    missing, unusable = unopenable_files(paths.values())
    if missing or unusable:
        raise FileNotFoundError("; ".join(
            ([f"verification file(s) not found: {', '.join(map(str, missing))}"] if missing else [])
            + [f"verification file {why}: {p}" for p, why in unusable]))
    backbone = build_backbone(args)
    results: dict[str, dict[str, Any]] = {}
    for target, path in paths.items():
        data = load_bin(path)
        with tqdm(total=2 * data.images.shape[0], desc=target, unit="img", file=sys.stderr, leave=False) as bar:
            try:
                results[target] = test(data, backbone, args.batch_size, progress=bar.update)
            except ValueError as exc:  # a set the protocol cannot score (too few pairs): name the file
                raise ValueError(f"{path}: {exc}") from None
    print("\n".join(format_table(results)))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {t: {k: r[k] for k in JSON_KEYS} for t, r in results.items()}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if args.roc is not None:
        curves = {f"{t} (acc {r['acc']:.4f})": (r["fpr"], r["tpr"]) for t, r in results.items()}
        write_roc_curves(args.roc, curves, str(args.onnx or args.weights or f"{args.network} seed {args.random_init}"))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (BadBinError, RefusedGlobal) as exc:
        # Bad data: say which file and what is wrong in one line; a traceback would only hide it.
        print_tool_error("eval.verify", exc)
        return 1
    except (OSError, ValueError) as exc:
        # The command or its configuration was wrong (a missing file, weights for another network, an output
        # path that cannot be written).
        print_tool_error("eval.verify", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
