"""Build a verification `.bin` (the LFW/CFP-FP/AgeDB-30 format) from a list of image pairs.

    python scripts/make_bin.py --pairs pairs.txt --out my_set.bin [--root IMAGES_DIR]

Every line of the pairs file is ``path1 path2 label``, label 1 for the same identity and 0 otherwise;
blank lines and lines starting with ``#`` are skipped; relative paths are taken from ``--root`` (default:
the pairs file's folder). Images are stored as they are on disk (encoded JPEG/PNG bytes), so they should
already be aligned 112×112 faces. Every image is decoded first, with the decoder the trainer and
``eval.verify`` use: if any cannot be, each is listed with its path and the reason and nothing is written.
The `.bin` is written under a temporary name and renamed; its mode follows the umask like any new file.

Exit status: 0 written; 1 bad data: an image that cannot be decoded; 2 usage: bad options, a malformed
pairs file, a missing or unreadable image.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import argparse  # noqa: E402
from typing import Sequence  # noqa: E402

from tqdm import tqdm  # noqa: E402

from dataset.images import decode  # noqa: E402
from dataset.verification_set import save_bin  # noqa: E402
from utils.files import path_problem  # noqa: E402
from utils.cli import print_error  # noqa: E402


def read_pairs(pairs_file: Path, root: Path) -> list[tuple[Path, Path, bool]]:
    """The pairs in ``pairs_file``; ``ValueError`` naming the file and line for a malformed line or a
    missing image."""
    pairs = []
    try:
        text = pairs_file.read_text()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{pairs_file}: not a text file of pairs ({exc})") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 3 or fields[2] not in ("0", "1"):
            raise ValueError(f"{pairs_file}:{lineno}: expected 'path1 path2 0|1', got {line.strip()!r}")
        a, b = (p if p.is_absolute() else root / p for p in (Path(fields[0]), Path(fields[1])))
        for p in (a, b):
            if (problem := path_problem(p)) is not None:
                raise ValueError(f"{pairs_file}:{lineno}: image {problem}: {p}")
        pairs.append((a, b, fields[2] == "1"))
    if not pairs:
        raise ValueError(f"{pairs_file}: no pairs (every line is blank or a comment)")
    return pairs


def read_and_decode(paths: Sequence[Path]) -> tuple[dict[Path, bytes], list[str]]:
    """The bytes of every file in ``paths`` and one ``"path: reason"`` per file that does not decode;
    ``ValueError`` for a file that cannot be read."""
    data: dict[Path, bytes] = {}
    bad = []
    for path in tqdm(paths, desc="make_bin: decoding", unit="img", disable=None):
        if path in data:
            continue
        try:
            data[path] = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        try:
            decode(data[path], str(path))
        except ValueError as exc:
            bad.append(str(exc))
    return data, bad


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=Path, required=True, help="text file, one 'path1 path2 0|1' per line")
    parser.add_argument("--out", type=Path, required=True, help="the .bin to write")
    parser.add_argument("--root", type=Path, help="folder that relative paths start from (default: the pairs file's)")
    args = parser.parse_args(argv)
    try:
        if (problem := path_problem(args.pairs)) is not None:
            raise ValueError(f"pairs file {problem}: {args.pairs}")
        pairs = read_pairs(args.pairs, args.root or args.pairs.parent)
        data, bad = read_and_decode([p for a, b, _ in pairs for p in (a, b)])
        if bad:
            for line in bad:
                print(f"make_bin: bad image {line}", file=sys.stderr)
            print(f"make_bin: error: {len(bad)} of {len(data)} images cannot be decoded (listed above); "
                  f"{args.out} not written", file=sys.stderr)
            return 1
        save_bin(args.out, [data[p] for a, b, _ in pairs for p in (a, b)], [same for _, _, same in pairs])
    except (ValueError, OSError) as exc:  # OSError: an --out that cannot be written
        print_error("make_bin", exc)
        return 2
    print(f"wrote {args.out}: {len(pairs)} pairs ({sum(s for *_, s in pairs)} same)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
