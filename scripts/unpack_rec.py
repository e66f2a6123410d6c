"""Extract a RecordIO dataset to an image folder: OUT/<label>/<key>.<jpg|png> (original bytes).

    python scripts/unpack_rec.py data/ms1m-retinaface-t1 faces/

The folder is written in stages (``dataset.rec_copy.unpack_rec``): a new OUT appears whole; into an existing one,
each label folder arrives complete and replaces one of the same name. Exit status: 0 written; 2 an unreadable
source or an output that cannot be written (one line).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.rec_copy import unpack_rec
from utils.cli import run_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="folder with train.rec and train.idx")
    parser.add_argument("out", type=Path, help="output image folder")
    args = parser.parse_args(argv)

    def work() -> None:
        print(f"wrote {unpack_rec(args.src, args.out)} images to {args.out}")

    return run_tool("unpack_rec", work)


if __name__ == "__main__":
    sys.exit(main())
