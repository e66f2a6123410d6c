"""Build a verification `.bin` (the LFW/CFP-FP/AgeDB-30 format) from a list of image pairs.

    python scripts/make_bin.py --pairs pairs.txt --out my_set.bin [--root IMAGES_DIR]

Every line of the pairs file is ``path1 path2 label``, label 1 for the same identity and 0 otherwise;
blank lines and lines starting with ``#`` are skipped; relative paths are taken from ``--root`` (default:
the pairs file's folder). Images are stored as they are on disk (encoded JPEG/PNG bytes), so they should
already be aligned 112×112 faces. Every image is decoded first, with the decoder the trainer and
``eval.verify`` use: if any cannot be, each is listed with its path and the reason and nothing is written.
The `.bin` is written under a temporary name and renamed; its mode follows the umask like any new file.

Exit status: 0 written; 1 bad data: an image that cannot be decoded; 2 usage: bad options, a malformed
pairs file, a missing or unreadable image. The reading and writing are ``dataset.verification_set``'s.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from dataset.verification_set import read_images, read_pairs, save_bin
from utils.cli import BadData, run_tool


def make_bin(pairs_file: Path, out: Path, root: Path) -> None:
    """Read and decode every image of the pairs, then write the .bin; each bad image one line, then BadData."""
    pairs = read_pairs(pairs_file, root)
    data, bad = read_images([p for a, b, _ in pairs for p in (a, b)], desc="make_bin: decoding")
    if bad:
        for line in bad:
            print(f"make_bin: bad image {line}", file=sys.stderr)
        raise BadData(f"{len(bad)} of {len(data)} images cannot be decoded (listed above); {out} not written")
    save_bin(out, [data[p] for a, b, _ in pairs for p in (a, b)], [same for _, _, same in pairs])
    print(f"wrote {out}: {len(pairs)} pairs ({sum(s for *_, s in pairs)} same)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=Path, required=True, help="text file, one 'path1 path2 0|1' per line")
    parser.add_argument("--out", type=Path, required=True, help="the .bin to write")
    parser.add_argument("--root", type=Path, help="folder that relative paths start from (default: the pairs file's)")
    args = parser.parse_args(argv)
    return run_tool("make_bin", lambda: make_bin(args.pairs, args.out, args.root or args.pairs.parent))


if __name__ == "__main__":
    sys.exit(main())
