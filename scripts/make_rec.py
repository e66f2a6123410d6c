"""Build an insightface-layout RecordIO (train.rec, train.idx, property) from images.

    python scripts/make_rec.py --images faces/ --out data/my_rec        # faces/<identity>/<image>.jpg
    python scripts/make_rec.py --list train.lst --out data/my_rec       # lines: path<TAB>label
    python scripts/make_rec.py --list train.lst --root faces/ --out data/my_rec  # MXNet im2rec's .lst

A list file holds ``path<TAB>label`` lines or the ``index<TAB>label<TAB>path`` lines of MXNet's ``im2rec --list``,
one kind per file; relative paths start from --root (default: the list file's folder). An image folder is read as
training reads it: sub-folders count as their identity's, hidden and system entries are ignored. Every image is
decoded first; the original bytes are stored, re-encoded (JPEG q95) only when not a JPEG/PNG of --image-size.
A file that cannot be read or decoded is listed on stderr and left out (--skip-bad, the default; --no-skip-bad
lists them all and writes nothing); an identity without a good image is no class. The files are staged and
moved into place when complete. docs/data.md#the-rec-tools has every rule.

Exit status: 0 written (skipped files, if any, listed on stderr); 1 bad data: bad files with
--no-skip-bad, or not one good image; 2 usage: bad options, a missing folder, a malformed list file, an
--out that cannot be written; 130 / 143 after Ctrl-C / SIGTERM.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.rec_from_images import list_image_folder, make_rec, read_list_file
from utils.cli import run_tool, tool_messages

TOOL = "make_rec"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", type=Path, help="folder with one sub-folder of images per identity")
    src.add_argument("--list", type=Path,
                     help="text file of 'path<TAB>label' lines or of im2rec's 'index<TAB>label<TAB>path' lines "
                          "(label 12 or 12.000000); one format per file, mixed files are refused")
    parser.add_argument("--root", type=Path, default=None, metavar="DIR",
                        help="with --list: the folder relative image paths start from (default: the list "
                             "file's folder); im2rec lists are relative to the root given to im2rec")
    parser.add_argument("--out", type=Path, required=True, help="output folder (train.rec, train.idx, property)")
    parser.add_argument("--num-classes", type=int, default=None,
                        help="default: the number of identity folders kept, or the largest label + 1")
    parser.add_argument("--image-size", type=int, nargs=2, default=(112, 112), metavar=("H", "W"))
    parser.add_argument("--skip-bad", action=argparse.BooleanOptionalAction, default=True,
                        help="leave out files that cannot be read or decoded, listing each (default); "
                             "--no-skip-bad lists them and writes nothing")
    args = parser.parse_args(argv)
    if args.num_classes is not None and args.num_classes < 1:
        parser.error(f"--num-classes must be >= 1, got {args.num_classes}")
    if args.root is not None and args.list is None:
        parser.error("--root goes with --list (an --images folder holds its own paths)")
    if min(args.image_size) < 1:
        parser.error(f"--image-size must be two sizes >= 1, got {args.image_size[0]} {args.image_size[1]}")

    def work() -> None:
        with tool_messages(TOOL, "dataset.rec_from_images"):
            source = list_image_folder(args.images) if args.images else read_list_file(args.list, args.root)
            report = make_rec(source, args.out, args.num_classes, tuple(args.image_size), args.skip_bad)
        print(f"wrote {report.images} images of {report.classes} classes to {args.out} "
              f"({report.reencoded} re-encoded as JPEG q95: not JPEG/PNG or not {args.image_size[0]}x"
              f"{args.image_size[1]}" + (f"; {len(report.bad)} bad files skipped, listed above" if report.bad else "")
              + ")")

    return run_tool(TOOL, work, on_interrupt="; nothing written")


if __name__ == "__main__":
    sys.exit(main())
