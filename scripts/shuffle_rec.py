"""Write a shuffled copy of a RecordIO dataset, without the insightface header/identity records.

    python scripts/shuffle_rec.py data/ms1m-retinaface-t1 data/ms1m-shuffled [--seed 0]
    python scripts/shuffle_rec.py data/ms1m-retinaface-t1      # writes data/shuffled_ms1m-retinaface-t1

The im2rec layout (every index entry an image), in a random order: what tools that read a rec
sequentially, or shuffle only within a buffer (e.g. MXNet's and DALI's own readers), need. Accepts both layouts;
payloads (labels included) are copied unchanged; keys become 0..N-1 in the new order; ``property`` is copied when
present. The copy is ``dataset.rec_copy.shuffle_rec``. Exit status: 0 written; 2 an unreadable source or an output
that cannot be written (one line).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.rec_copy import shuffle_rec, shuffled_name
from utils.cli import run_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="folder with train.rec and train.idx")
    parser.add_argument("dst", type=Path, nargs="?", default=None,
                        help="output folder (default: shuffled_<name of src> beside src, as in arcface_torch)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    dst = shuffled_name(args.src) if args.dst is None else args.dst

    def work() -> None:
        print(f"wrote {shuffle_rec(args.src, dst, args.seed)} shuffled images to {dst}")

    return run_tool("shuffle_rec", work)


if __name__ == "__main__":
    sys.exit(main())
