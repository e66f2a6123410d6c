"""Generate a synthetic face-recognition dataset in the real formats (no real face data needed).

    python scripts/make_synthetic.py --out data/synthetic --num-classes 1000 --images-per-class 20 \\
        --pairs 3000 --seed 0 --workers 2 --preview data/synthetic/preview.png

writes ``train.rec``/``train.idx``/``property`` (insightface layout), ``syn_easy.bin`` and ``syn_hard.bin``
(verification pairs from identities disjoint from the training ones) and ``synthetic.json`` (the stamp, last),
staged so that an interrupted run leaves no half dataset. A second run with the same parameters finds the stamp
and writes nothing (but the ``--preview`` image when asked). See ``dataset/synthetic_faces.py``. Exit status: 0
written or already there; 2 a bad option or an output that cannot be written (one line).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset import synthetic_faces
from utils.cli import run_tool

logger = logging.getLogger("make_synthetic")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--num-classes", type=int, default=1000, help="training identities (default 1000)")
    p.add_argument("--images-per-class", type=int, default=20, help="images per training identity (default 20)")
    p.add_argument("--pairs", type=int, default=3000, help="pairs in each verification .bin (default 3000)")
    p.add_argument("--seed", type=int, default=0, help="seed of identities and images (default 0)")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                   help="rendering processes (default: min(2, CPU count)); the output does not depend on it")
    p.add_argument("--preview", default=None, help="also write a PNG grid of samples (rows = identities, "
                                                   "columns = nuisance draws) to this path")
    args = p.parse_args(argv)
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    return args


def generate(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    wrote = synthetic_faces.write_dataset(args.out, num_classes=args.num_classes,
                                          images_per_class=args.images_per_class, pairs=args.pairs,
                                          seed=args.seed, workers=args.workers, progress=True)
    if args.preview:
        synthetic_faces.preview_grid(args.preview, seed=args.seed)
        logger.info("preview written to %s", args.preview)
    if wrote:
        logger.info("synthetic dataset written to %s in %.1f s", args.out, time.perf_counter() - start)
    else:
        logger.info("%s already holds a complete dataset with these parameters (%s); skipped", args.out,
                    synthetic_faces.STAMP_NAME)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    return run_tool("make_synthetic", lambda: generate(args))


if __name__ == "__main__":
    sys.exit(main())
