"""IJB-B / IJB-C 1:1 verification of a backbone from the command line (the protocol: ``eval.ijb_protocol``).

    python scripts/ijb.py --network r100 --weights model.pt --data-dir IJBC --target IJBC [--json ijbc.json]
    python scripts/ijb.py --weights work_dirs/ms1mv3_r100/model.pt --data-dir IJBC   # network from model.json
    python scripts/ijb.py --onnx folder/ --data-dir IJB_release/IJBC --target IJBC   # an exported model

``python -m eval.ijb`` runs this script. ``DATA_DIR`` is the released layout (``loose_crop/``, ``meta/``). Prints
TAR at FAR 1e-6 ... 1e-1 and the AUC, in percent as the published IJB tables; ``--json`` writes them as fractions,
``--roc`` plots the ROC. The model options are ``eval.model_options``'. docs/evaluation.md#ijb-b--ijb-c.

Exit status: 0 done; 2 a usage, data or configuration error (bad options, a missing or malformed protocol
file, an image that does not read, weights that do not fit the network), one line; 130 / 143 after Ctrl-C /
SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.ijb_protocol import evaluate_ijb
from eval.model_options import add_model_options, backbone_from_options, check_model_options
from eval.plots import write_roc_curves
from utils.cli import run_tool

TOOL = "ijb"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ijb.py", description=__doc__.split("\n\n")[0])
    add_model_options(p, precision=True)
    p.add_argument("--data-dir", type=Path, required=True, help="IJB folder with loose_crop/ and meta/")
    p.add_argument("--target", default="IJBC", help="IJBB or IJBC (prefix of the meta files)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--num-workers", type=int, default=4, help="processes reading and aligning images")
    p.add_argument("--roc", type=Path, help="write the ROC plot (PNG, log FAR axis)")
    p.add_argument("--json", type=Path, help="write {target: {tar: {far: tar}, auc, pairs, ...}} as JSON")
    args = p.parse_args(argv)
    check_model_options(p, args)
    if args.batch_size < 1 or args.num_workers < 0:
        p.error(f"need --batch-size >= 1 and --num-workers >= 0; got {args.batch_size}, {args.num_workers}")
    return args


def run(args: argparse.Namespace) -> None:
    """Evaluate, print the TAR table, write --json / --roc. An image that fails in a loader worker comes back
    with the worker's traceback in its message: the one-line error is the original error's line."""
    backbone = backbone_from_options(args)
    result = evaluate_ijb(args.data_dir, args.target, backbone, args.batch_size, args.num_workers)
    levels = list(result["tar"])
    print(f"{'target':<8} {'pairs':>10} " + " ".join(f"{'FAR=' + lv:>11}" for lv in levels) + f" {'AUC':>8}")
    print(f"{args.target:<8} {result['pairs']:>10} "
          + " ".join(f"{100 * result['tar'][lv]:>11.2f}" for lv in levels) + f" {100 * result['auc']:>8.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {k: v for k, v in result.items() if k not in ("fpr", "tpr")}
        args.json.write_text(json.dumps({args.target: summary}, indent=2) + "\n")
    if args.roc is not None:
        write_roc_curves(args.roc, {args.target: (result["fpr"], result["tpr"])}, title=f"{args.target} 1:1",
                         log_fpr=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_tool(TOOL, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
