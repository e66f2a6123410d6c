"""Copies of a RecordIO dataset: its images in a seeded random order (``shuffle_rec``), or as an image folder
(``unpack_rec``).

Both read either layout (``dataset.recordio.detect_layout``), copy each image record's bytes unchanged and write
through ``utils.files.staged``: a new output folder appears whole, and into an existing one each file (or label
folder) arrives complete, so an interrupted copy leaves what was there before. The commands are
``scripts/shuffle_rec.py`` and ``scripts/unpack_rec.py`` (docs/data.md).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dataset.images import is_png
from dataset.recordio import IndexedRecordIO, class_of, detect_layout, unpack
from utils.files import staged


def shuffled_name(src: Path) -> Path:
    """``<parent of src>/shuffled_<name of src>``, as arcface_torch's script names its output."""
    if src.name in ("", ".."):  # "." or "data/..": name the folder they stand for
        src = src.resolve()
    return src.parent / f"shuffled_{src.name}"


def shuffle_rec(src: Path, dst: Path, seed: int = 0) -> int:
    """Write ``dst/train.rec``/``train.idx`` with the images of ``src`` in a seeded random order, keys ``0..N-1``
    (the im2rec layout: no header or identity records), and copy ``property``; the image count."""
    if src.resolve() == dst.resolve():
        raise ValueError(f"source and destination are the same folder: {src}")
    with IndexedRecordIO(src / "train.idx", src / "train.rec", "r") as rec:
        _, keys, _ = detect_layout(rec)
        order = np.random.default_rng(seed).permutation(len(keys))
        with staged(dst) as stage:  # after src opened: a mistyped src leaves no dst behind
            with IndexedRecordIO(stage / "train.idx", stage / "train.rec", "w") as out:
                for new_key, i in enumerate(tqdm(order.tolist(), desc="shuffle_rec", unit="rec", disable=None)):
                    out.write_idx(new_key, rec.read_idx(int(keys[i])))
            if (src / "property").is_file():
                shutil.copyfile(src / "property", stage / "property")
    return len(keys)


def unpack_rec(src: Path, out: Path) -> int:
    """Write every image of ``src`` to ``out/<label:06d>/<key>.<jpg|png>`` (its bytes unchanged); the image count.
    Into an existing ``out``, a label folder of the same name is replaced whole."""
    with IndexedRecordIO(src / "train.idx", src / "train.rec", "r") as rec:
        _, keys, _ = detect_layout(rec)
        with staged(out) as stage:
            for key in tqdm(keys.tolist(), desc="unpack_rec", unit="img", disable=None):
                header, image = unpack(rec.read_idx(key))
                folder = stage / f"{class_of(header.label, f'{rec.rec_path} (key {key})'):06d}"
                folder.mkdir(exist_ok=True)
                (folder / f"{key}.{'png' if is_png(image) else 'jpg'}").write_bytes(image)
    return len(keys)
