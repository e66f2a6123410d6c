"""Summarise a RecordIO dataset or an image folder and, with --check, verify every image in it.

    python scripts/rec_info.py data/ms1m-retinaface-t1 [--check]
    python scripts/rec_info.py data/my_faces --check [--workers 4] [--min-images 2]   # a folder per identity

A rec with --check: every record read, every image decoded, every label checked against num_classes; it lists
ALL problems (no image record, bad magic, truncated record, index offset past the end, undecodable image, label
out of range, wrong image size) and warns about classes without an image. An image folder, read as training
reads it: --check decodes every image on --workers processes and lists every file that fails or is not 112x112;
it warns about identities with fewer than --min-images images, identity folders without an image, files training
ignores and, in one line, the hidden and system entries ignored. Warnings never change the exit status.
docs/data.md#the-rec-tools.

Exit status: 0 read (and, with --check, no problem); 1 bad data: problems found, or a rec that cannot be
opened as one; 2 usage: bad options, a missing folder or file.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.identity_folders import holds_identity_folders, names_shown
from dataset.images import IMAGE_EXTENSIONS
from dataset.inspection import IMAGE_SIZE, folder_info, rec_info
from dataset.recordio import is_rec_folder
from utils.cli import run_tool

TOOL = "rec_info"


def _warn_list(what: str, names: list[str], shown: int = 20) -> None:
    more = f" ... ({len(names) - shown} more)" if len(names) > shown else ""
    print(f"warning: {what}: {', '.join(names[:shown])}{more}", file=sys.stderr)


def _print_problems(problems: list[str]) -> None:
    print(f"{len(problems)} problem{'s' if len(problems) > 1 else ''}:", file=sys.stderr)
    for p in problems:
        print(f"  {p}", file=sys.stderr)


def _rec(args: argparse.Namespace) -> int:
    info = rec_info(args.root, args.check)
    print(f"{args.root}: {info['layout']} layout, {info['images']} images, "
          f"num_classes={info['num_classes'] if info['num_classes'] is not None else 'unknown (no property)'}"
          + (f", {info['classes_seen']} classes with images" if args.check else ""))
    if info["empty_classes"]:
        _warn_list(f"{len(info['empty_classes'])} of {info['num_classes']} classes have no images",
                   [str(c) for c in info["empty_classes"]])
    if info["problems"]:
        _print_problems(info["problems"])
        return 1
    if args.check:
        print("check passed: every record reads, decodes and has a label in range")
    return 0


def _image_folder(args: argparse.Namespace) -> int:
    info = folder_info(args.root, args.check, args.workers, args.min_images)
    print(f"{args.root}: image folder, {info['images']} images, {info['num_classes']} identities")
    if info["ignored_note"]:
        print(f"warning: {info['ignored_note']}", file=sys.stderr)
    if info["empty"]:
        print(f"warning: {len(info['empty'])} identity folders have no {'/'.join(IMAGE_EXTENSIONS)} images and are "
              f"no class: {names_shown(info['empty'], 20)}", file=sys.stderr)
    if info["few"]:
        _warn_list(f"{len(info['few'])} of {info['num_classes']} identities have fewer than {args.min_images} "
                   f"images", [f"{name} ({n})" for name, n in info["few"]])
    if info["other_files"]:
        _warn_list(f"{len(info['other_files'])} files are not {'/'.join(IMAGE_EXTENSIONS)} images and training "
                   f"ignores them", info["other_files"])
    if info["problems"]:
        _print_problems(info["problems"])
        print(f"train without them: delete or fix these files, or pack the folder with scripts/make_rec.py --images "
              f"{args.root} --out DIR, which skips them", file=sys.stderr)
        return 1
    if args.check:
        print(f"check passed: every image reads, decodes and is {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="folder with train.rec and train.idx, or a folder of identity folders")
    parser.add_argument("--check", action="store_true", help="read, decode and label-check every record or image")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes decoding an image folder's images (default: one per core)")
    parser.add_argument("--min-images", type=int, default=2,
                        help="warn about identities of an image folder with fewer images (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.workers < 0 or args.min_images < 0:
        parser.error(f"--workers and --min-images must be >= 0; got {args.workers} and {args.min_images}")

    def work() -> int:
        is_rec = is_rec_folder(args.root)
        return _image_folder(args) if not is_rec and holds_identity_folders(args.root) else _rec(args)

    # A rec that is there but does not read as one, or a folder without an image, is bad data (1), a missing one 2.
    return run_tool(TOOL, work, bad_data=(ValueError,))


if __name__ == "__main__":
    sys.exit(main())
