"""Extract a RecordIO dataset to an image folder: OUT/<label>/<key>.<jpg|png> (original bytes).

    python scripts/unpack_rec.py data/ms1m-retinaface-t1 faces/
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from dataset.recordio import IndexedRecordIO, RecordIOError, class_of, detect_layout, unpack  # noqa: E402
from utils.cli import print_error  # noqa: E402


def unpack_rec(src: Path, out: Path) -> int:
    """Write every image of ``src`` to ``out/<label:06d>/<key>.<ext>``; return the image count."""
    with IndexedRecordIO(src / "train.idx", src / "train.rec", "r") as rec:
        _, keys, _ = detect_layout(rec)
        out.mkdir(parents=True, exist_ok=True)  # an out that cannot be a folder fails here, before any work
        for key in tqdm(keys.tolist(), desc="unpack_rec", unit="img"):
            header, image = unpack(rec.read_idx(key))
            label = class_of(header.label, f"{rec.rec_path} (key {key})")
            ext = "png" if image[:8] == b"\x89PNG\r\n\x1a\n" else "jpg"
            folder = out / f"{label:06d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{key}.{ext}").write_bytes(image)
    return len(keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="folder with train.rec and train.idx")
    parser.add_argument("out", type=Path, help="output image folder")
    args = parser.parse_args(argv)
    try:
        n = unpack_rec(args.src, args.out)
    except (OSError, RecordIOError, ValueError, KeyError) as exc:  # OSError: an out that cannot be a folder
        print_error("unpack_rec", exc)
        return 2
    print(f"wrote {n} images to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
