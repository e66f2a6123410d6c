"""Summarise a RecordIO dataset and, with --check, verify every record.

    python scripts/rec_info.py data/ms1m-retinaface-t1 [--check]

--check reads every record, decodes every image and checks every label against num_classes; it lists
ALL problems found (no image record at all, bad magic, truncated record, index offset past the end,
undecodable image, label out of range, wrong image size) and exits 1 when there is any. It also warns about classes below
num_classes that have no image (a class no sample can teach); they do not change the exit status.

Exit status: 0 read (and, with --check, no problem); 1 bad data: problems found, or a rec that cannot be
opened as one; 2 usage: bad options, a missing folder or file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.recordio import check_records, open_rec_folder  # noqa: E402
from utils.logging_setup import print_tool_error  # noqa: E402


def rec_info(root: Path, check: bool = False, image_size: tuple[int, int] | None = None) -> dict:
    """``{"layout", "images", "num_classes", "classes_seen", "empty_classes", "problems": [str, ...]}`` of
    ``root``; ``classes_seen`` and ``empty_classes`` (ids below num_classes without an image) need ``check``.

    The checks are the dataset's own (``dataset.recordio``): the open-time ones always, every record with
    ``check``; each problem is listed instead of raised.
    """
    # With check every record is read, the last one included: the open-time read of it would say it twice.
    folder = open_rec_folder(root, read_last=not check)
    with folder.rec:
        problems = [str(p) for p in folder.problems]
        labels, bad = check_records(folder, image_size) if check else ({}, [])
    problems += [str(p) for p in bad]
    num_classes = folder.num_classes
    empty = [c for c in range(num_classes) if not labels.get(c)] if check and num_classes is not None else None
    return {"layout": folder.layout, "images": len(folder.image_keys), "num_classes": num_classes,
            "classes_seen": len(labels) if check else None, "empty_classes": empty, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="folder with train.rec and train.idx")
    parser.add_argument("--check", action="store_true", help="read, decode and label-check every record")
    args = parser.parse_args(argv)
    try:
        info = rec_info(args.root, args.check)
    except FileNotFoundError as exc:
        print_tool_error("rec_info", exc)
        return 2
    except ValueError as exc:  # the files are there but the index is not one (RecordIOError)
        print_tool_error("rec_info", exc)
        return 1
    print(f"{args.root}: {info['layout']} layout, {info['images']} images, "
          f"num_classes={info['num_classes'] if info['num_classes'] is not None else 'unknown (no property)'}"
          + (f", {info['classes_seen']} classes with images" if args.check else ""))
    if info["empty_classes"]:
        empty = info["empty_classes"]
        shown = ", ".join(map(str, empty[:20])) + (f" ... ({len(empty) - 20} more)" if len(empty) > 20 else "")
        print(f"warning: {len(empty)} of {info['num_classes']} classes have no images: {shown}", file=sys.stderr)
    if info["problems"]:
        print(f"{len(info['problems'])} problem{'s' if len(info['problems']) > 1 else ''}:", file=sys.stderr)
        for p in info["problems"]:
            print(f"  {p}", file=sys.stderr)
        return 1
    if args.check:
        print("check passed: every record reads, decodes and has a label in range")
    return 0


if __name__ == "__main__":
    sys.exit(main())
