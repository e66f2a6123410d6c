"""Summarise a RecordIO dataset and, with --check, verify every record.

    python scripts/rec_info.py data/ms1m-retinaface-t1 [--check]

--check reads every record, decodes every image and checks every label against num_classes; it lists
ALL problems found (bad magic, truncated record, index offset past the end, undecodable image, label
out of range, wrong image size) and exits 1 when there is any. It also warns about classes below
num_classes that have no image (a class no sample can teach); they do not change the exit status.

Exit status: 0 read (and, with --check, no problem); 1 bad data: problems found, or a rec that cannot be
opened as one; 2 usage: bad options, a missing folder or file.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from dataset import _read_property, class_of, decode, detect_layout  # noqa: E402
from utils.recordio import IndexedRecordIO, RecordIOError, unpack  # noqa: E402


def rec_info(root: Path, check: bool = False, image_size: tuple[int, int] | None = None) -> dict:
    """``{"layout", "images", "num_classes", "classes_seen", "empty_classes", "problems": [str, ...]}`` of
    ``root``; ``classes_seen`` and ``empty_classes`` (ids below num_classes without an image) need ``check``."""
    rec_path, idx_path = root / "train.rec", root / "train.idx"
    problems: list[str] = []
    with IndexedRecordIO(idx_path, rec_path, "r") as rec:
        past = dict(rec.offsets_past_end())
        problems += [f"{rec_path} (key {k}): index offset {o} is past the end of the file "
                     f"({rec_path.stat().st_size} bytes)" for k, o in past.items()]
        try:
            layout, keys, header_classes = detect_layout(rec)
        except (RecordIOError, ValueError) as exc:
            problems.append(f"header record (key 0): {exc}")
            layout, keys, header_classes = "im2rec", rec.key_array[rec.key_array != 0], None
        prop = _read_property(root / "property")
        num_classes = prop[0] if prop else header_classes
        size = image_size or (prop[1] if prop else None)
        if prop and header_classes is not None and prop[0] != header_classes:
            problems.append(f"{root / 'property'} says {prop[0]} classes, the header record {header_classes}")
        labels: Counter[int] = Counter()
        if check:
            # Every record, not only the images: the header and class-range records can be damaged too.
            all_keys = rec.key_array
            is_image = np.isin(all_keys, keys)
            for key, image_record in tqdm(zip(all_keys.tolist(), is_image.tolist()), total=len(all_keys),
                                          desc="rec_info", unit="rec"):
                if key in past:
                    continue
                where = f"{rec_path} (key {key})"
                try:
                    payload = rec.read_idx(key)
                    if not image_record:
                        continue
                    header, image = unpack(payload)
                    label = class_of(header.label, where)
                    labels[label] += 1
                    if num_classes is not None and label >= num_classes:
                        problems.append(f"{where}: label {label} is out of range for num_classes={num_classes}")
                    img = decode(image, where)  # (3, H, W)
                    if size is not None and tuple(img.shape[1:]) != tuple(size):
                        problems.append(f"{where}: image is {img.shape[1]}x{img.shape[2]}, expected "
                                        f"{size[0]}x{size[1]}")
                except (RecordIOError, ValueError, KeyError) as exc:
                    problems.append(str(exc))
    empty = [c for c in range(num_classes) if not labels[c]] if check and num_classes is not None else None
    return {"layout": layout, "images": len(keys), "num_classes": num_classes,
            "classes_seen": len(labels) if check else None, "empty_classes": empty, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="folder with train.rec and train.idx")
    parser.add_argument("--check", action="store_true", help="read, decode and label-check every record")
    args = parser.parse_args(argv)
    try:
        info = rec_info(args.root, args.check)
    except FileNotFoundError as exc:
        print(f"rec_info: error: {exc}", file=sys.stderr)
        return 2
    except (RecordIOError, ValueError) as exc:  # the files are there but are not a readable rec
        print(f"rec_info: error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.root}: {info['layout']} layout, {info['images']} images, "
          f"num_classes={info['num_classes'] if info['num_classes'] is not None else 'unknown (no property)'}"
          + (f", {info['classes_seen']} classes with images" if args.check else ""))
    if info["empty_classes"]:
        empty = info["empty_classes"]
        shown = ", ".join(map(str, empty[:20])) + (f" ... ({len(empty) - 20} more)" if len(empty) > 20 else "")
        print(f"warning: {len(empty)} of {info['num_classes']} classes have no images: {shown}", file=sys.stderr)
    if info["problems"]:
        print(f"{len(info['problems'])} problems:", file=sys.stderr)
        for p in info["problems"]:
            print(f"  {p}", file=sys.stderr)
        return 1
    if args.check:
        print("check passed: every record reads, decodes and has a label in range")
    return 0


if __name__ == "__main__":
    sys.exit(main())
