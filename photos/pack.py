"""The pipeline's output in OUT_DIR: ``train.rec``/``train.idx``/``property`` (insightface layout, through
``dataset.recordio``), ``holdout.bin`` (``dataset.verification_set``), ``report.csv``, ``preview.png`` and
``prepare_faces.json``, the stamp that says the rest is complete.

``pack`` turns the saved results into those files, written through ``utils.files.staged`` with the stamp moved
in last; ``check_out_dir`` refuses an OUT_DIR holding another dataset. Class ids follow the identities that kept
a face, held-out ones left out. See docs/data.md ("From your own photos", Output).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np

from dataset.recordio import write_insightface_rec
from dataset.verification_set import save_bin
from photos.holdout import form_pairs, hold_out
from photos.listing import Photo, count, identity_order
from photos.report import report_rows, write_preview, write_report
from photos.work import WORK, json_bytes, read_json
from utils.cli import BadData, UsageError
from utils.files import atomic_write, staged

logger = logging.getLogger(__name__)

STAMP = "prepare_faces.json"
HOLDOUT = "holdout.bin"
OUTPUT_FILES = ("train.rec", "train.idx", "property", HOLDOUT, "report.csv", "preview.png", STAMP)


def check_out_dir(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse an OUT_DIR inside the input, or one holding output not made from this input (without
    ``overwrite``)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT_DIR {out} is a file, not a folder")
    if source.is_dir() and out.resolve().is_relative_to(source.resolve()):
        raise UsageError(f"OUT_DIR {out} is inside PHOTOS_DIR {source}; the input is never written to: choose a "
                         f"folder outside it")
    existing = [name for name in (*OUTPUT_FILES, WORK) if (out / name).exists()]
    if not existing or overwrite:
        return
    stamps = [read_json(path) for path in (out / STAMP, out / WORK / "work.json")]
    ours = any(isinstance(s, dict) and s.get("input") == str(source.resolve()) for s in stamps)
    if not ours:
        raise UsageError(f"OUT_DIR {out} holds another dataset ({', '.join(existing)}) not made by "
                         f"prepare_faces.py from {source}; pass --overwrite to replace it, or choose another folder")


def pack(out: Path, photos: list[Photo], results: list[dict], holdout: int, max_pairs: int, seed: int,
         stamp: dict) -> str:
    """Write the output files of ``results`` (one per photo) into ``out``, the stamp last, then remove the work
    folder; the summary line. ``BadData`` when no face was kept (the report is then in the work folder, and an
    earlier output in ``out`` stays as it was) or the holdout cannot be filled."""
    kept_count: dict[str, int] = {}
    for photo, result in zip(photos, results):
        kept_count[photo.identity] = kept_count.get(photo.identity, 0) + len(result["crops"])
    order = identity_order([p.identity for p in photos])
    with_faces = [i for i in order if kept_count.get(i)]
    statuses = [r["status"] for r in results]
    if not with_faces:
        rows, _ = report_rows(photos, results, {}, set())
        write_report(out / WORK / "report.csv", rows)
        raise BadData(f"no face kept in any of the {len(photos)} photos ({statuses.count('no_face')} without a face, "
                      f"{statuses.count('unreadable')} unreadable); every photo's reason is in "
                      f"{out / WORK / 'report.csv'}")
    rng = np.random.default_rng(seed)
    held = hold_out(with_faces, kept_count, holdout, rng) if holdout else set()
    train_ids = [i for i in with_faces if i not in held]
    rows, crops = report_rows(photos, results, {identity: k for k, identity in enumerate(train_ids)}, held)
    train = sorted((c for c in crops if c.label is not None), key=lambda c: (c.label, c.line))

    with staged(out, last=(STAMP,)) as staging:
        images = write_insightface_rec(staging, ((c.label, c.jpeg) for c in train), len(train_ids))
        pairs: list[tuple[int, int, bool]] = []
        if held:
            held_crops = [c for c in crops if c.identity in held]
            groups = [[k for k, c in enumerate(held_crops) if c.identity == identity]
                      for identity in sorted(held, key=order.index)]
            pairs = form_pairs(groups, max_pairs, rng)
            save_bin(staging / HOLDOUT, [held_crops[k].jpeg for a, b, _ in pairs for k in (a, b)],
                     [same for _, _, same in pairs])
            if len(pairs) < 10:
                logger.warning("%s has %d pairs; eval.verify's 10 folds need at least 10", HOLDOUT, len(pairs))
        write_report(staging / "report.csv", rows)
        write_preview(staging / "preview.png", crops)
        per_identity = [sum(1 for c in train if c.label == k) for k in range(len(train_ids))]
        summary = _summary(statuses, len(order), len(with_faces), images, per_identity, len(held), len(pairs))
        atomic_write(staging / STAMP, lambda f: f.write(json_bytes({**stamp, "summary": summary})))
        (out / STAMP).unlink(missing_ok=True)  # a folder half replaced is never stamped complete
        for name in OUTPUT_FILES:
            if not (staging / name).exists():
                (out / name).unlink(missing_ok=True)  # e.g. an earlier run's holdout.bin
    shutil.rmtree(out / WORK)
    return summary


def _summary(statuses: list[str], identities: int, with_faces: int, images: int, per_identity: list[int],
             held: int, pairs: int) -> str:
    below = statuses.count("low_score") + statuses.count("small_face")
    return (f"prepare_faces: {len(statuses)} photos: {statuses.count('kept')} kept, "
            f"{statuses.count('no_face')} no face, {statuses.count('several_faces')} several faces, {below} below the "
            f"thresholds, {statuses.count('unreadable')} unreadable"
            + (f", {statuses.count('bad_landmarks')} bad landmarks" if 'bad_landmarks' in statuses else "")
            + f"; {count(len(per_identity), 'identity', 'identities')} in train.rec "
            f"({count(images, 'face', 'faces')}, {min(per_identity)}-{max(per_identity)} per identity)"
            + (f", {held} held out in {HOLDOUT} ({pairs} pairs)" if held else "")
            + (f", {identities - with_faces} without a kept face left out" if identities > with_faces else ""))
