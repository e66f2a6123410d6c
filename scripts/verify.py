"""Score a backbone on verification `.bin` sets (LFW, CFP-FP, AgeDB-30, ...) with the published protocol.

    python scripts/verify.py --weights work_dirs/ms1mv3_r50/model.pt --data-dir DIR --targets lfw,cfp_fp,agedb_30
    python scripts/verify.py --network r50 --weights backbone.pth --data-dir DIR --targets lfw
    python scripts/verify.py --onnx model.onnx --data-dir DIR --targets lfw
    python scripts/verify.py --network r50 --random-init 0 --data-dir DIR     # untrained baseline
    python scripts/verify.py --weights work_dirs/ms1mv3_r50 --data-dir DIR --targets lfw --save-threshold

``python -m eval.verify`` runs this script; the protocol is ``eval.verification.test``, the model options
``eval.model_options``'. Prints one row per target; ``--json`` writes the numbers, ``--roc`` a ROC plot,
``--save-threshold`` each target's threshold into the ``model.json`` beside the model, for ``scripts/compare.py``.
docs/evaluation.md#verification-sets has the details.

Exit status: 0 done; 1 bad data (a `.bin` that is truncated, not a verification file, holds an image that does
not decode, or refers to code), one line naming the file; 2 a usage or configuration error (bad options, a
missing file, no ``--network`` and no ``model.json``, weights that do not fit the network, ``--save-threshold``
without a ``model.json`` beside the model), one line; 130 / 143 after Ctrl-C / SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from dataset.verification_set import BadBinError, RefusedGlobal, load_bin
from eval.model_card import card_beside, card_with_thresholds, save_thresholds, threshold_entry
from eval.model_options import add_model_options, backbone_from_options, check_model_options
from eval.model_source import model_file
from eval.plots import write_roc_curves
from eval.verification import check_bin_files, format_table, test
from utils.cli import run_tool

TOOL = "verify"
# Keys of test()'s result written to --json (the ROC arrays go to --roc instead).
JSON_KEYS = ("pairs", "acc", "acc_std", "acc_noflip", "val", "val_std", "far", "xnorm", "threshold")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="verify.py", description=__doc__.split("\n\n")[0])
    add_model_options(p, precision=True)
    p.add_argument("--data-dir", type=Path, required=True, help="folder holding <target>.bin")
    p.add_argument("--targets", default="lfw,cfp_fp,agedb_30",
                   help="comma-separated names of DIR/<name>.bin, with or without .bin (default: %(default)s)")
    p.add_argument("--nfolds", type=int, default=10,
                   help="folds of the protocol: each fold's threshold is chosen on the others (the published "
                        "figures use 10); a .bin needs at least as many pairs (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default: %(default)s)")
    p.add_argument("--roc", type=Path, help="write a ROC plot (PNG) of all targets")
    p.add_argument("--json", type=Path, help="write {target: {pairs, acc, ...}} as JSON")
    p.add_argument("--save-threshold", action="store_true",
                   help="write each target's calibrated threshold (flip embeddings) into model.json beside "
                        "--weights/--onnx (scripts/compare.py's verdict)")
    args = p.parse_args(argv)
    check_model_options(p, args)
    if args.save_threshold and args.random_init is not None:
        p.error("--save-threshold writes into the model.json beside --weights or --onnx; --random-init has none")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.nfolds < 2:
        p.error(f"--nfolds must be >= 2 (a fold's threshold is chosen on the others), got {args.nfolds}")
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


def threshold_card(args: argparse.Namespace) -> Path:
    """The model.json ``--save-threshold`` writes into, beside the model, checked before the evaluation: it must
    exist (a card is what the trainer writes, never made here) and hold a thresholds object."""
    card = card_beside(model_file(args.weights, args.onnx))
    if not card.is_file():
        raise FileNotFoundError(f"--save-threshold writes into the model.json beside the model, and {card} does not "
                                f"exist (the trainer writes it beside model.pt); leave out --save-threshold and "
                                f"give scripts/compare.py --threshold instead")
    try:
        card_with_thresholds(card)
    except ValueError as exc:
        raise ValueError(f"{exc}; --save-threshold cannot write into it") from None
    return card


def run(args: argparse.Namespace) -> None:
    """Evaluate every target; print the table; write --json / --roc / the thresholds."""
    paths: dict[str, Path] = args.targets
    check_bin_files(paths.values())
    card = threshold_card(args) if args.save_threshold else None  # before the evaluation: fail fast
    backbone = backbone_from_options(args)
    results: dict[str, dict[str, Any]] = {}
    for target, path in paths.items():
        data = load_bin(path)
        with tqdm(total=2 * data.images.shape[0], desc=target, unit="img", file=sys.stderr, leave=False) as bar:
            try:
                results[target] = test(data, backbone, args.batch_size, args.nfolds, progress=bar.update)
            except ValueError as exc:  # a set the protocol cannot score (too few pairs): name the file
                raise ValueError(f"{path}: {exc} (--nfolds sets the folds)") from None
    print("\n".join(format_table(results)))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {t: {k: r[k] for k in JSON_KEYS} for t, r in results.items()}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if args.roc is not None:
        curves = {f"{t} (acc {r['acc']:.4f})": (r["fpr"], r["tpr"]) for t, r in results.items()}
        write_roc_curves(args.roc, curves, str(args.onnx or args.weights or f"{args.network} seed {args.random_init}"))
    if card is not None:
        save_thresholds(card, {t: threshold_entry(r, paths[t], args.precision) for t, r in results.items()})
        print(f"saved the thresholds of {', '.join(results)} in {card}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_tool(TOOL, lambda: run(args), bad_data=(BadBinError, RefusedGlobal))


if __name__ == "__main__":
    sys.exit(main())
