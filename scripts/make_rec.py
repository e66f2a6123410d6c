"""Build an insightface-layout RecordIO (train.rec, train.idx, property) from images.

    python scripts/make_rec.py --images faces/ --out data/my_rec        # faces/<identity>/<image>.jpg
    python scripts/make_rec.py --list train.lst --out data/my_rec       # lines: path<TAB>label

Images are stored as their original encoded bytes. They are re-encoded (JPEG, quality 95) only when
they would not load as-is: a format other than JPEG/PNG, or a size other than --image-size (resized).
"""
from __future__ import annotations

import argparse
import io
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from dataset import IMAGE_EXTENSIONS  # noqa: E402
from utils.recordio import write_insightface_rec  # noqa: E402

logger = logging.getLogger("make_rec")


def list_image_folder(root: Path) -> list[tuple[Path, int]]:
    """``(path, label)`` for ``root/<identity>/<image>``; labels follow the sorted identity names."""
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    items = [(f, label) for label, name in enumerate(classes)
             for f in sorted((root / name).iterdir()) if f.suffix.lower() in IMAGE_EXTENSIONS]
    if not items:
        raise ValueError(f"{root}: no images; expected one folder per identity holding "
                         f"{'/'.join(IMAGE_EXTENSIONS)} files")
    return items


def read_list_file(path: Path) -> list[tuple[Path, int]]:
    """``(path, label)`` from lines ``path<TAB>label``; relative paths are relative to the list file."""
    items = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 2 or not fields[1].strip().isdigit():
            raise ValueError(f"{path}: line {lineno} is {line[:80]!r}; expected 'path<TAB>label' with an integer "
                             f"label >= 0")
        p = Path(fields[0])
        items.append((p if p.is_absolute() else path.parent / p, int(fields[1])))
    if not items:
        raise ValueError(f"{path}: no 'path<TAB>label' lines")
    return items


def image_bytes(path: Path, image_size: tuple[int, int]) -> tuple[bytes, bool]:
    """``(encoded bytes, re-encoded?)``: the file's own bytes when it is a JPEG/PNG of the right size."""
    from PIL import Image, UnidentifiedImageError

    data = path.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format in ("JPEG", "PNG") and im.size == (image_size[1], image_size[0]):
                return data, False
            out = io.BytesIO()
            im.convert("RGB").resize((image_size[1], image_size[0]), Image.BICUBIC).save(out, "JPEG", quality=95)
            return out.getvalue(), True
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{path}: not a readable image: {exc}") from exc


def make_rec(items: list[tuple[Path, int]], out_dir: Path, num_classes: int | None = None,
             image_size: tuple[int, int] = (112, 112)) -> dict:
    """Write the rec; return ``{"images", "classes", "reencoded"}``."""
    items = sorted(items, key=lambda t: (t[1], str(t[0])))  # grouped by label, ascending
    num_classes = num_classes or items[-1][1] + 1
    reencoded = 0

    def gen():
        nonlocal reencoded
        for path, label in tqdm(items, desc="make_rec", unit="img"):
            data, changed = image_bytes(path, image_size)
            reencoded += changed
            yield label, data

    n = write_insightface_rec(out_dir, gen(), num_classes, image_size)
    return {"images": n, "classes": num_classes, "reencoded": reencoded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", type=Path, help="folder with one sub-folder of images per identity")
    src.add_argument("--list", type=Path, help="text file of 'path<TAB>label' lines")
    parser.add_argument("--out", type=Path, required=True, help="output folder (train.rec, train.idx, property)")
    parser.add_argument("--num-classes", type=int, default=None, help="default: largest label + 1")
    parser.add_argument("--image-size", type=int, nargs=2, default=(112, 112), metavar=("H", "W"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        items = list_image_folder(args.images) if args.images else read_list_file(args.list)
        stats = make_rec(items, args.out, args.num_classes, tuple(args.image_size))
    except (ValueError, FileNotFoundError) as exc:
        print(f"make_rec: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {stats['images']} images of {stats['classes']} classes to {args.out} "
          f"({stats['reencoded']} re-encoded as JPEG q95: not JPEG/PNG or not {args.image_size[0]}x"
          f"{args.image_size[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
