"""Find the identities a training set shares with verification sets, and write the training set without them.

    python scripts/overlap.py --weights work_dirs/ms1mv3_r50 --rec /data/ms1m-retinaface-t1 \\
        --bin /data/ms1m-retinaface-t1/lfw.bin --bin /data/ms1m-retinaface-t1/cfp_fp.bin > overlap.csv
    python scripts/overlap.py --weights work_dirs/ms1mv3_r50 --rec /data/ms1m-retinaface-t1 \\
        --bin lfw.bin --head work_dirs/ms1mv3_r50/checkpoints/step_000181000      # the trained class centres
    python scripts/overlap.py --weights work_dirs/ms1mv3_r50 --rec faces/ --bin lfw.bin --drop faces_clean/

Every image of each ``--bin`` is compared with every class of the training set ``--rec`` (a rec or a folder of
identity folders; a class is the mean of its images' flip embeddings, or with ``--head`` the trained centres) and
listed when its nearest class is above a threshold calibrated on training images at ``--far`` per test image
(``eval.overlap``). stdout is the CSV (``--csv FILE`` instead), stderr the threshold, one line per set and a
summary; ``--drop OUT`` writes the training set without the matched classes into the new folder OUT.
docs/overlap.md has the method, the output and its limits.

Exit status: 0 done (whether or not anything matched); 1 bad data, one line naming the file (a ``.bin`` that is
truncated, not a verification file, holds an image that does not decode or refers to code, a damaged rec, a
training image that does not decode, a training set of one class); 2 a usage or configuration error, one line
(bad options, a missing file, no ``--network`` and no ``model.json``, weights that do not fit the network, a
``--head`` of another training set or network, a ``--drop`` folder that exists or would hold no class, an output
that cannot be written); 130 / 143 after Ctrl-C / SIGTERM (no ``--drop`` folder left behind).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from dataset import MXFaceDataset
from dataset.verification_set import BadBinError, RefusedGlobal
from eval import overlap
from eval.model_options import add_model_options, backbone_from_options, check_model_options
from eval.model_source import device_of
from eval.verification import check_bin_files
from utils.cli import run_tool

TOOL = "overlap"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="overlap.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, precision=True)
    p.add_argument("--rec", type=Path, required=True, metavar="TRAIN_DIR",
                   help="the training set: a folder with train.rec/train.idx, or a folder of identity folders")
    p.add_argument("--bin", type=Path, action="append", required=True, metavar="TEST.bin", dest="bins",
                   help="a verification set (repeat for several)")
    p.add_argument("--head", type=Path, metavar="CHECKPOINT",
                   help="compare with the trained class centres of this step checkpoint folder (or of the newest "
                        "in a run's output folder) instead of the class means of the training images")
    p.add_argument("--drop", type=Path, metavar="OUT",
                   help="write the training set without the matched classes into this new folder")
    p.add_argument("--csv", type=Path, metavar="FILE", help="write the CSV here instead of to stdout")
    p.add_argument("--far", type=float, default=1e-4,
                   help="the fraction of test images of identities outside the training set that may match by "
                        "chance: the threshold's false-accept rate per image (default 1e-4)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes decoding the training images (0: in this process); default min(4, CPUs)")
    args = p.parse_args(argv)
    check_model_options(p, args)
    if not 0.0 < args.far < 1.0:
        p.error(f"--far must be in (0, 1), got {args.far}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.workers < 0:
        p.error(f"--workers must be >= 0, got {args.workers}")
    seen = set()
    for path in args.bins:
        if path.resolve() in seen:
            p.error(f"--bin {path} is given twice")
        seen.add(path.resolve())
    if args.drop is not None and args.drop.exists():
        p.error(f"--drop {args.drop} exists; --drop writes a new folder (remove it, or name another)")
    if args.drop is not None and args.drop.resolve().is_relative_to(args.rec.resolve()):
        p.error(f"--drop {args.drop} is inside the training set {args.rec}; name a folder outside it")
    return args


def bar(total: int | None, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="img", file=sys.stderr, disable=None)


def say(message: str) -> None:
    print(f"{TOOL}: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> None:
    """Embed, calibrate, match; print the threshold, each set's line and the summary; write the CSV and --drop."""
    check_bin_files(args.bins)
    data = overlap.open_training_set(args.rec)
    head = overlap.read_head(args.head, data) if args.head is not None else None  # a head of other data stops here
    backbone = backbone_from_options(args)
    tests = {}
    for path in args.bins:
        with bar(None, path.name) as progress:
            tests[path] = overlap.embed_bin(path, backbone, args.batch_size, progress.update)  # (2P, D)
    sample = overlap.calibration_indices(len(data), args.far)
    if head is not None:
        classes = overlap.head_centres(head, next(iter(tests.values())).shape[1], args.head)
        with bar(2 * len(sample), "calibration images") as progress:
            calibration = overlap.embed_training_images(data, sample, backbone, args.batch_size, args.workers,
                                                        progress.update)
    else:
        with bar(2 * len(data), "training set") as progress:
            classes, calibration = overlap.class_means(data, backbone, args.batch_size, args.workers, sample,
                                                       progress.update)
    classes.centres = classes.centres.to(device_of(backbone))  # (C·K, D)
    threshold = overlap.calibrate(calibration, classes, args.far, args.rec)
    say(threshold.describe(args.far))
    found = []
    for path, emb in tests.items():
        listed = overlap.matches(path, emb, classes, threshold)
        say(f"{path}: {emb.shape[0] // 2} pairs; {len(listed)} of {emb.shape[0]} images above the threshold")
        found += listed
    text = overlap.matches_csv(found, data)
    if args.csv is not None:
        overlap.write_csv(text, args.csv)
    else:
        sys.stdout.write(text)
    matched = {m.class_id for m in found}
    total = sum(emb.shape[0] for emb in tests.values())
    source = "trained centres" if head is not None else "class means"
    say(f"{len(found)} of {total} test images in {len(tests)} set(s) match {len(matched)} of {classes.ids.numel()} "
        f"training classes ({source}) above the threshold; by chance about {total * threshold.rate:.3g} "
        f"(images x the threshold's FAR)")
    if args.drop is not None:
        with bar(None, "writing") as progress:
            kept, images = overlap.write_without(data, matched, classes.labels, args.drop, progress.update)
        renumbered = isinstance(data, MXFaceDataset)
        extra = f", renumbered 0..{kept - 1} ({args.drop / overlap.CLASS_MAP})" if renumbered else ""
        say(f"wrote {args.drop}: {kept} classes, {images} images, without the {len(matched)} matched classes{extra}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    unwritten = f"; {args.drop} not written" if args.drop is not None else ""
    return run_tool(TOOL, lambda: run(args), bad_data=(BadBinError, RefusedGlobal), on_interrupt=unwritten)


if __name__ == "__main__":
    sys.exit(main())
