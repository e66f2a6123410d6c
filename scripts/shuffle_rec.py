"""Write a shuffled copy of a RecordIO dataset, without the insightface header/identity records.

    python scripts/shuffle_rec.py data/ms1m-retinaface-t1 data/ms1m-shuffled [--seed 0]
    python scripts/shuffle_rec.py data/ms1m-retinaface-t1      # writes data/shuffled_ms1m-retinaface-t1

The im2rec layout (every index entry an image), in a random order: what tools that read a rec
sequentially, or shuffle only within a buffer (e.g. MXNet's and DALI's own readers), need. Accepts both layouts; payloads (labels included) are copied
unchanged; keys become 0..N-1 in the new order; ``property`` is copied when present.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from dataset.recordio import IndexedRecordIO, RecordIOError, detect_layout  # noqa: E402
from utils.cli import print_error  # noqa: E402


def default_dst(src: Path) -> Path:
    """``<parent of src>/shuffled_<name of src>``, as arcface_torch's script names its output."""
    if src.name in ("", ".."):  # "." or "data/..": name the folder they stand for
        src = src.resolve()
    return src.parent / f"shuffled_{src.name}"


def shuffle_rec(src: Path, dst: Path, seed: int = 0) -> int:
    """Write ``dst/train.rec``/``train.idx`` with the images of ``src`` in a seeded random order."""
    if src.resolve() == dst.resolve():
        raise ValueError(f"source and destination are the same folder: {src}")
    with IndexedRecordIO(src / "train.idx", src / "train.rec", "r") as rec:
        _, keys, _ = detect_layout(rec)
        dst.mkdir(parents=True, exist_ok=True)  # after src opened: a mistyped src leaves no empty dst behind
        order = np.random.default_rng(seed).permutation(len(keys))
        with IndexedRecordIO(dst / "train.idx", dst / "train.rec", "w") as out:
            for new_key, i in enumerate(tqdm(order.tolist(), desc="shuffle_rec", unit="rec")):
                out.write_idx(new_key, rec.read_idx(int(keys[i])))
    if (src / "property").is_file():
        shutil.copyfile(src / "property", dst / "property")
    return len(keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="folder with train.rec and train.idx")
    parser.add_argument("dst", type=Path, nargs="?", default=None,
                        help="output folder (default: shuffled_<name of src> beside src, as in arcface_torch)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    try:
        dst = default_dst(args.src) if args.dst is None else args.dst
        n = shuffle_rec(args.src, dst, args.seed)
    except (OSError, RecordIOError, ValueError, KeyError) as exc:  # OSError: a dst that cannot be a folder
        print_error("shuffle_rec", exc)
        return 2
    print(f"wrote {n} shuffled images to {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
