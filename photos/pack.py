"""The pipeline's output in OUT_DIR: ``train.rec``/``train.idx``/``property`` (insightface layout, through
``dataset.recordio``), ``holdout.bin`` (``dataset.verification_set``), ``report.csv``, ``preview.png`` and
``prepare_faces.json``, the stamp that says the rest is complete.

``pack`` turns the photos' outcomes into those files, written through ``utils.files.staged`` with the stamp moved
in last; ``check_out_dir`` refuses an OUT_DIR holding another dataset, whose files ``--overwrite`` moves aside
(into ``OUT_DIR/replaced``) rather than leaving them beside the new records, where training would take a
``.bin`` for a verification set. Class ids follow the identities that kept a face, held-out ones left out. See
docs/data.md ("From your own photos", Output).
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dataset.identity_folders import names_shown
from dataset.recordio import write_insightface_rec
from dataset.verification_set import save_bin
from photos.holdout import form_pairs, hold_out
from photos.listing import Photo, count, identity_order
from photos.policy import Outcome
from photos.report import preview_sections, report_rows, write_preview, write_report
from photos.work import WORK, json_bytes, read_json
from utils.cli import BadData, UsageError
from utils.files import atomic_write, fsync_dir, staged

logger = logging.getLogger(__name__)

STAMP = "prepare_faces.json"
HOLDOUT = "holdout.bin"
OUTPUT_FILES = ("train.rec", "train.idx", "property", HOLDOUT, "report.csv", "preview.png", STAMP)
ASIDE = "replaced"  # where --overwrite moves another dataset's files: OUT_DIR/replaced, replaced-2, ...
_ASIDE_NAME = re.compile(rf"{ASIDE}(-[0-9]+)?")


def check_out_dir(out: Path, source: Path, overwrite: bool) -> list[str]:
    """Refuse an OUT_DIR inside the input, or one holding anything but this tool's output from this input (and its
    work folder) without ``overwrite``; the names in OUT_DIR that ``overwrite`` moves aside (none when it holds
    no other dataset)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT_DIR {out} is a file, not a folder")
    if source.is_dir() and out.resolve().is_relative_to(source.resolve()):
        raise UsageError(f"OUT_DIR {out} is inside PHOTOS_DIR {source}; the input is never written to: choose a "
                         f"folder outside it")
    if not out.is_dir():
        return []
    names = {entry.name for entry in out.iterdir()} - {WORK}
    names = {name for name in names if not _ASIDE_NAME.fullmatch(name)}
    stamp = read_json(out / STAMP)
    if not names or (isinstance(stamp, dict) and stamp.get("input") == str(source.resolve())):
        return []  # empty, or this input's own output (files a user added beside it stay)
    existing = [name for name in OUTPUT_FILES if name in names] + sorted(names - set(OUTPUT_FILES))
    if not overwrite:
        raise UsageError(f"OUT_DIR {out} holds another dataset ({names_shown(existing, 8)}) not made by "
                         f"prepare_faces.py from {source}; pass --overwrite to move its files aside (into "
                         f"{out / ASIDE}), or choose another folder")
    return existing


def _move_aside(out: Path, names: Sequence[str]) -> Path:
    """Move ``names`` of ``out`` into a new ``out/replaced[-N]`` folder; that folder."""
    aside = out / ASIDE
    number = 1
    while aside.exists():
        number += 1
        aside = out / f"{ASIDE}-{number}"
    aside.mkdir()
    for name in names:
        os.replace(out / name, aside / name)
    fsync_dir(out)
    logger.info("--overwrite: %s of another dataset moved from %s into %s: %s", count(len(names), "entry", "entries"),
                out, aside, names_shown(list(names)))
    return aside


def pack(out: Path, photos: list[Photo], outcomes: list[Outcome], holdout: int, max_pairs: int, seed: int,
         stamp: dict, aside: Sequence[str] = ()) -> str:
    """Write the output files of ``outcomes`` (one per photo) into ``out``, the stamp last, after moving ``aside``
    (``check_out_dir``'s) out of the way; the summary line. ``BadData`` when no face was kept (the report is then
    in the work folder, and an earlier output in ``out`` stays as it was) or the holdout cannot be filled."""
    kept_count: dict[str, int] = {}
    distinct: dict[str, set[int]] = {}  # the photos (first copies) each identity kept a face from
    for index, (photo, o) in enumerate(zip(photos, outcomes)):
        kept_count[photo.identity] = kept_count.get(photo.identity, 0) + len(o.kept)
        if o.kept:
            distinct.setdefault(photo.identity, set()).add(index if o.duplicate_of is None else o.duplicate_of)
    order = identity_order([p.identity for p in photos])
    with_faces = [i for i in order if kept_count.get(i)]
    statuses = [o.status for o in outcomes]
    if not with_faces:
        rows, _, _ = report_rows(photos, outcomes, {}, set())
        (out / WORK).mkdir(parents=True, exist_ok=True)
        write_report(out / WORK / "report.csv", rows)
        raise BadData(f"no face kept in any of the {len(photos)} photos ({statuses.count('no_face')} without a face, "
                      f"{statuses.count('unreadable')} unreadable); every photo's reason is in "
                      f"{out / WORK / 'report.csv'}")
    rng = np.random.default_rng(seed)
    held = hold_out(with_faces, {i: len(p) for i, p in distinct.items()}, holdout, rng) if holdout else set()
    train_ids = [i for i in with_faces if i not in held]
    rows, crops, lines = report_rows(photos, outcomes, {identity: k for k, identity in enumerate(train_ids)}, held)
    train = sorted((c for c in crops if c.label is not None), key=lambda c: (c.label, c.line))

    with staged(out, last=(STAMP,)) as staging:
        images = write_insightface_rec(staging, ((c.label, c.jpeg) for c in train), len(train_ids))
        pairs: list[tuple[int, int, bool]] = []
        if held:
            held_crops = [c for c in crops if c.identity in held]
            groups = [[k for k, c in enumerate(held_crops) if c.identity == identity]
                      for identity in sorted(held, key=order.index)]
            pairs = form_pairs(groups, max_pairs, rng, [c.copy_of for c in held_crops])
            save_bin(staging / HOLDOUT, [held_crops[k].jpeg for a, b, _ in pairs for k in (a, b)],
                     [same for _, _, same in pairs])
            if len(pairs) < 10:
                logger.warning("%s has %d pairs; eval.verify's 10 folds need at least 10", HOLDOUT, len(pairs))
        write_report(staging / "report.csv", rows)
        write_preview(staging / "preview.png", preview_sections(outcomes, crops, lines))
        per_identity = [kept_count[i] for i in train_ids]  # report_rows labels each kept crop by its identity
        summary = _summary(outcomes, len(order), len(with_faces), images, per_identity, len(held), len(pairs))
        atomic_write(staging / STAMP, lambda f: f.write(json_bytes({**stamp, "summary": summary})))
        if aside:
            _move_aside(out, aside)
        (out / STAMP).unlink(missing_ok=True)  # a folder half replaced is never stamped complete
        for name in OUTPUT_FILES:
            if not (staging / name).exists():
                (out / name).unlink(missing_ok=True)  # e.g. an earlier run's holdout.bin
    return summary


def _summary(outcomes: list[Outcome], identities: int, with_faces: int, images: int, per_identity: list[int],
             held: int, pairs: int) -> str:
    statuses = [o.status for o in outcomes]
    several = [o for o in outcomes if o.candidates]
    kept_several = sum(1 for o in several if o.kept)
    below = statuses.count("low_score") + statuses.count("small_face")
    copies = sum(o.duplicate_of is not None for o in outcomes)
    return (f"prepare_faces: {len(statuses)} photos: {statuses.count('kept')} kept, "
            f"{statuses.count('no_face')} no face, {len(several)} several faces"
            + (f" ({kept_several} kept)" if kept_several else "")
            + f", {below} below the thresholds, {statuses.count('unreadable')} unreadable"
            + (f", {statuses.count('bad_landmarks')} bad landmarks" if 'bad_landmarks' in statuses else "")
            + (f", {statuses.count('no_match')} not matching their identity" if "no_match" in statuses else "")
            + (f", {count(copies, 'duplicate', 'duplicates')}" if copies else "")
            + f"; {count(len(per_identity), 'identity', 'identities')} in train.rec "
            f"({count(images, 'face', 'faces')}, {min(per_identity)}-{max(per_identity)} per identity)"
            + (f", {held} held out in {HOLDOUT} ({pairs} pairs)" if held else "")
            + (f", {identities - with_faces} without a kept face left out" if identities > with_faces else ""))
