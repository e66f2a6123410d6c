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

``--save-threshold`` writes each target's calibrated threshold into the ``model.json`` beside ``--weights`` (or
``--onnx``), under ``"thresholds"``, for ``scripts/compare.py``'s verdict:

    python -m eval.verify --weights work_dirs/ms1mv3_r50 --data-dir DIR --targets lfw --save-threshold

The threshold is the protocol's best-accuracy one (each of the 10 folds picks the distance threshold with the
best accuracy on the other 9; the mean of the 10), on the flip embeddings, given both as a squared distance of
L2-normalised embeddings (``distance``: same person below it) and as the cosine similarity above which a pair
is the same person (``cosine = 1 - distance / 2``), with the target's accuracy, pairs, file and precision.
Targets of earlier runs stay; a target evaluated again is replaced. The card is rewritten atomically; the
trainer writes a fresh card (without thresholds) when it saves new weights.

Exit status: 0 done; 1 bad data (a `.bin` that is truncated, not a verification file, holds an image that
does not decode, or refers to code), one line naming the file; 2 a usage or configuration error (bad
options, a missing file, no ``--network`` and no ``model.json``, weights that do not fit the network,
``--save-threshold`` without a ``model.json`` beside the model), one line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from dataset.verification_set import BadBinError, RefusedGlobal, load_bin
from eval.model_card import THRESHOLDS_KEY, card_beside, card_with_thresholds
from eval.model_source import add_model_options, build_backbone, check_model_options, onnx_file, weights_file
from eval.plots import write_roc_curves
from eval.verification import format_table, test
from utils.files import atomic_write, unopenable_files
from utils.cli import print_error

# Keys of test()'s result written to --json (the ROC arrays go to --roc instead).
JSON_KEYS = ("pairs", "acc", "acc_std", "acc_noflip", "val", "val_std", "far", "xnorm", "threshold")
THRESHOLD_RULE = "best accuracy, mean of the 10 folds' thresholds, flip embeddings"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.verify", description=__doc__.split("\n\n")[0])
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
                   help="write each target's calibrated threshold into model.json beside --weights/--onnx "
                        "(scripts/compare.py's verdict)")
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


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Evaluate every target; print the table; write --json / --roc. Returns test()'s results."""
    paths: dict[str, Path] = args.targets
    missing, unusable = unopenable_files(paths.values())
    if missing or unusable:
        raise FileNotFoundError("; ".join(
            ([f"verification file(s) not found: {', '.join(map(str, missing))}"] if missing else [])
            + [f"verification file {why}: {p}" for p, why in unusable]))
    card = threshold_card(args) if args.save_threshold else None  # before the evaluation: fail fast
    backbone = build_backbone(args)
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
    return results


def threshold_card(args: argparse.Namespace) -> Path:
    """The model.json ``--save-threshold`` writes into: beside the weights file, or beside the ONNX file;
    ``FileNotFoundError`` saying so when there is none (a card is what the trainer writes, never made here)."""
    model = onnx_file(args.onnx) if args.onnx is not None else weights_file(args.weights)
    card = card_beside(model)
    if not card.is_file():
        raise FileNotFoundError(f"--save-threshold writes into the model.json beside the model, and {card} does not "
                                f"exist (the trainer writes it beside model.pt); leave out --save-threshold and "
                                f"give scripts/compare.py --threshold instead")
    _card_content(card)  # a card that cannot take the thresholds is refused before the evaluation, not after
    return card


def _card_content(card: Path) -> dict[str, Any]:
    """``card_with_thresholds(card)``, its error saying that the thresholds cannot be written."""
    try:
        return card_with_thresholds(card)
    except ValueError as exc:
        raise ValueError(f"{exc}; --save-threshold cannot write into it") from None


def threshold_entry(result: dict[str, Any], path: Path, precision: str) -> dict[str, Any]:
    """What model.json records of a target's calibrated threshold (``test()``'s ``result``)."""
    distance = result["threshold"]  # squared L2 distance of L2-normalised embeddings; "same" below it
    return {"cosine": 1.0 - distance / 2.0,  # |a - b|^2 = 2 - 2 cos(a, b) for unit vectors
            "distance": distance, "acc": result["acc"], "pairs": result["pairs"], "file": str(path),
            "precision": precision, "rule": THRESHOLD_RULE}


def save_thresholds(card: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Merge ``entries`` ({target: threshold_entry}) into ``card``'s thresholds (read again: the card as it is
    now) and rewrite it atomically, every other key as it was."""
    content = _card_content(card)
    content[THRESHOLDS_KEY] = {**content.get(THRESHOLDS_KEY, {}), **entries}
    text = json.dumps(content, indent=1).encode()  # as the trainer writes it
    atomic_write(card, lambda f: f.write(text))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (BadBinError, RefusedGlobal) as exc:
        # Bad data: say which file and what is wrong in one line; a traceback would only hide it.
        print_error("eval.verify", exc)
        return 1
    except (OSError, ValueError) as exc:
        # The command or its configuration was wrong (a missing file, weights for another network, an output
        # path that cannot be written).
        print_error("eval.verify", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
