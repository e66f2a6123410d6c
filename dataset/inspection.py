"""What ``scripts/rec_info.py`` reports of a training set: a RecordIO folder's or an image folder's summary and,
with ``check``, every problem in it, listed instead of raised.

``rec_info`` runs the RecordIO checks the dataset itself runs (``dataset.recordio``: at open time, and every
record with ``check``). ``folder_info`` lists an image folder by the identity-folder rule training uses
(``dataset.identity_folders`` with its JPEG/PNG suffixes) and, with ``check``, decodes every image with the
trainer's decoder, on worker processes. See docs/data.md ("The rec tools").
"""
from __future__ import annotations

from pathlib import Path

from dataset.identity_folders import identity_folders
from dataset.images import IMAGE_EXTENSIONS, decode
from dataset.recordio import check_records, open_rec_folder

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


def image_problem(item: tuple[str, tuple[int, int]]) -> str | None:
    """Why the image at ``item[0]`` cannot be trained on (it does not read or decode, or has another size than
    ``item[1]``), or None."""
    path, size = item
    try:
        decode(Path(path).read_bytes(), path, size)
    except (OSError, ValueError) as exc:
        return str(exc) if isinstance(exc, ValueError) else f"{path}: cannot read: {exc}"
    return None


def folder_info(root: Path, check: bool = False, workers: int = 0, min_images: int = 2) -> dict:
    """``{"images", "num_classes", "classes", "few": [(identity, images), ...], "empty": [identity, ...],
    "other_files": [name, ...], "ignored_note": str | None, "problems": [str, ...]}`` of an image folder as
    training reads it: ``empty`` the identity folders without an image (no class), ``other_files`` the files
    without a JPEG/PNG suffix, ``ignored_note`` the line naming the hidden and system entries ignored. With
    ``check`` every image is read and decoded, on ``workers`` processes (0: in this one)."""
    from tqdm import tqdm

    listing = identity_folders(root, IMAGE_EXTENSIONS)
    listing.check_listed()
    samples = listing.samples()
    if not samples:
        raise ValueError(f"{root}: no images found; expected one folder per identity holding "
                         f"{'/'.join(IMAGE_EXTENSIONS)} files")
    few = [(name, len(listing.files[name])) for name in listing.classes if len(listing.files[name]) < min_images]
    problems: list[str] = []
    if check:
        items = [(str(path), IMAGE_SIZE) for path, _ in samples]
        bar = tqdm(total=len(items), desc="checking images", unit="img", disable=None)
        if workers > 0:
            import multiprocessing

            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                for problem in pool.imap(image_problem, items, chunksize=32):
                    problems += [problem] if problem else []
                    bar.update()
        else:
            for item in items:
                problem = image_problem(item)
                problems += [problem] if problem else []
                bar.update()
        bar.close()
    return {"images": len(samples), "num_classes": len(listing.classes), "classes": listing.classes, "few": few,
            "empty": listing.empty, "other_files": listing.other_files, "ignored_note": listing.ignored_note(),
            "problems": problems}
