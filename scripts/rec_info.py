"""Summarise a RecordIO dataset or an image folder and, with --check, verify every image in it.

    python scripts/rec_info.py data/ms1m-retinaface-t1 [--check]
    python scripts/rec_info.py data/my_faces --check [--workers 4] [--min-images 2]   # a folder per identity

--check reads every record, decodes every image and checks every label against num_classes; it lists
ALL problems found (no image record at all, bad magic, truncated record, index offset past the end,
undecodable image, label out of range, wrong image size) and exits 1 when there is any. It also warns about classes below
num_classes that have no image (a class no sample can teach); they do not change the exit status.

An image folder (one folder per identity, as training reads it): --check reads and decodes every image on
--workers processes (a progress bar), checks its size (112x112, what training feeds) and lists every file
that fails, with the reason; it warns about identities with fewer than --min-images images and files that
training ignores (not .jpg/.jpeg/.png). Bad images make the exit status 1; the warnings do not.

Exit status: 0 read (and, with --check, no problem); 1 bad data: problems found, or a rec that cannot be
opened as one; 2 usage: bad options, a missing folder or file.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.faces import ImageFolderDataset  # noqa: E402
from dataset.images import IMAGE_EXTENSIONS, decode  # noqa: E402
from dataset.recordio import check_records, open_rec_folder  # noqa: E402
from utils.cli import print_error  # noqa: E402

IMAGE_SIZE = (112, 112)  # (H, W) training feeds


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


def _image_problem(item: tuple[str, tuple[int, int]]) -> str | None:
    """Why the image at ``item[0]`` cannot be trained on (it does not read or decode, or has another size than
    ``item[1]``), or None."""
    path, size = item
    try:
        decode(Path(path).read_bytes(), path, size)
    except (OSError, ValueError) as exc:
        return str(exc) if isinstance(exc, ValueError) else f"{path}: cannot read: {exc}"
    return None


def folder_info(root: Path, check: bool = False, workers: int = 0, min_images: int = 2) -> dict:
    """``{"images", "num_classes", "few": [(identity, images), ...], "ignored": [path, ...], "problems": [str, ...]}``
    of an image folder as training reads it (``dataset.ImageFolderDataset``); with ``check`` every image is read
    and decoded, on ``workers`` processes (0: in this one)."""
    from tqdm import tqdm

    data = ImageFolderDataset(root, image_size=IMAGE_SIZE)
    counts = [0] * data.num_classes
    for _, label in data.samples:
        counts[label] += 1
    few = [(name, n) for name, n in zip(data.classes, counts) if n < min_images]
    ignored = sorted(f for name in data.classes for f in (root / name).iterdir()
                     if f.is_file() and f.suffix.lower() not in IMAGE_EXTENSIONS)
    problems: list[str] = []
    if check:
        items = [(str(path), IMAGE_SIZE) for path, _ in data.samples]
        bar = tqdm(total=len(items), desc="checking images", unit="img", disable=None)
        if workers > 0:
            import multiprocessing

            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                for problem in pool.imap(_image_problem, items, chunksize=32):
                    problems += [problem] if problem else []
                    bar.update()
        else:
            for item in items:
                problem = _image_problem(item)
                problems += [problem] if problem else []
                bar.update()
        bar.close()
    return {"images": len(data), "num_classes": data.num_classes, "few": few, "ignored": ignored,
            "problems": problems}


def _print_problems(problems: list[str]) -> None:
    print(f"{len(problems)} problem{'s' if len(problems) > 1 else ''}:", file=sys.stderr)
    for p in problems:
        print(f"  {p}", file=sys.stderr)


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
    is_rec = (args.root / "train.rec").exists() or (args.root / "train.idx").exists()
    if args.root.is_dir() and not is_rec and any(d.is_dir() for d in args.root.iterdir()):
        return _image_folder_main(args)
    try:
        info = rec_info(args.root, args.check)
    except FileNotFoundError as exc:
        print_error("rec_info", exc)
        return 2
    except ValueError as exc:  # the files are there but the index is not one (RecordIOError)
        print_error("rec_info", exc)
        return 1
    print(f"{args.root}: {info['layout']} layout, {info['images']} images, "
          f"num_classes={info['num_classes'] if info['num_classes'] is not None else 'unknown (no property)'}"
          + (f", {info['classes_seen']} classes with images" if args.check else ""))
    if info["empty_classes"]:
        empty = info["empty_classes"]
        shown = ", ".join(map(str, empty[:20])) + (f" ... ({len(empty) - 20} more)" if len(empty) > 20 else "")
        print(f"warning: {len(empty)} of {info['num_classes']} classes have no images: {shown}", file=sys.stderr)
    if info["problems"]:
        _print_problems(info["problems"])
        return 1
    if args.check:
        print("check passed: every record reads, decodes and has a label in range")
    return 0


def _image_folder_main(args: argparse.Namespace) -> int:
    try:
        info = folder_info(args.root, args.check, args.workers, args.min_images)
    except ValueError as exc:  # no image at all
        print_error("rec_info", exc)
        return 1
    print(f"{args.root}: image folder, {info['images']} images, {info['num_classes']} identities")
    if info["few"]:
        shown = ", ".join(f"{name} ({n})" for name, n in info["few"][:20])
        more = f" ... ({len(info['few']) - 20} more)" if len(info["few"]) > 20 else ""
        print(f"warning: {len(info['few'])} of {info['num_classes']} identities have fewer than {args.min_images} "
              f"images: {shown}{more}", file=sys.stderr)
    if info["ignored"]:
        shown = ", ".join(str(p.relative_to(args.root)) for p in info["ignored"][:20])
        print(f"warning: {len(info['ignored'])} files are not {'/'.join(IMAGE_EXTENSIONS)} images and training "
              f"ignores them: {shown}", file=sys.stderr)
    if info["problems"]:
        _print_problems(info["problems"])
        print(f"train without them: delete or fix these files, or pack the folder with scripts/make_rec.py --images "
              f"{args.root} --out DIR, which skips them", file=sys.stderr)
        return 1
    if args.check:
        print(f"check passed: every image reads, decodes and is {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
