"""What the pipeline shows of its decisions: ``report.csv`` (a row per photo, or per kept face) and ``preview.png``
(a sample of the crops, the lowest-scoring ones, the photos with several faces and those far from their identity,
each captioned with its line in the report).

The columns and statuses are documented in docs/data.md ("report.csv"); the rows follow the photos' order, which
is the order of the records within a class.
"""
from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from photos.listing import Photo
from photos.policy import FaceCrop, Outcome
from utils.files import atomic_write

REPORT_COLUMNS = ("path", "identity", "label", "status", "faces", "score", "box", "landmarks", "similarity",
                  "duplicate_of", "reason")


class Crop(NamedTuple):
    """A kept face as the output needs it."""

    line: int  # its row in report.csv (the header is line 1)
    score: float | None  # None: aligned at given landmarks
    jpeg: bytes
    identity: str
    label: int | None  # its class id in train.rec; None when held out
    copy_of: int  # the index of the first copy of its photo (its own index when it is no copy)


def _numbers(values) -> str:
    return " ".join(f"{float(v):.1f}" for v in np.asarray(values).reshape(-1))


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def report_rows(photos: Sequence[Photo], outcomes: Sequence[Outcome], class_of: dict[str, int], held: set[str]
                ) -> tuple[list[list[str]], list[Crop], list[int]]:
    """The report's rows, every kept crop, and each photo's (first) line."""
    rows: list[list[str]] = []
    crops, lines = [], []
    for index, (photo, o) in enumerate(zip(photos, outcomes)):
        lines.append(len(rows) + 2)
        shown: list[FaceCrop | None] = list(o.kept) or [o.shown]
        copy = "" if o.duplicate_of is None else photos[o.duplicate_of].name
        for face in shown:
            status, label = o.status, None
            if o.kept:
                status = "holdout" if photo.identity in held else "kept"
                label = class_of.get(photo.identity)
                assert face is not None
                crops.append(Crop(len(rows) + 2, face.score, face.jpeg, photo.identity, label,
                                  index if o.duplicate_of is None else o.duplicate_of))
            rows.append([photo.name, photo.identity, _cell(label), status, _cell(o.faces),
                         "" if face is None or face.score is None else f"{face.score:.4f}",
                         "" if face is None or face.box is None else _numbers(face.box),
                         "" if face is None else _numbers(face.points),
                         "" if face is None or face.similarity is None else f"{face.similarity:.4f}", copy, o.reason])
    return rows, crops, lines


def write_report(path: Path, rows: list[list[str]]) -> None:
    """``report.csv`` at ``path``, atomically."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(REPORT_COLUMNS)
    writer.writerows(rows)
    atomic_write(path, lambda f: f.write(text.getvalue().encode()))


Tile = tuple[bytes, str]  # a crop's JPEG and its caption
Section = tuple[str, list[Tile]]


def preview_sections(outcomes: Sequence[Outcome], crops: Sequence[Crop], lines: Sequence[int], sample: int = 24,
                     lowest: int = 8, several: int = 16, far: int = 16) -> list[Section]:
    """The preview's sections: an evenly spaced ``sample`` of the kept crops, the ``lowest`` scores, the photos
    with several faces (the face kept, or, left out, the best-scoring one; at most ``several``), and the faces
    left out as far from their identity (``far``); empty sections are left out."""
    picks = sorted(set(np.linspace(0, len(crops) - 1, min(sample, len(crops))).round().astype(int).tolist()))
    scored = sorted((c for c in crops if c.score is not None), key=lambda c: (c.score, c.line))[:lowest]
    groups = [(lines[i], o) for i, o in enumerate(outcomes) if o.candidates]
    unmatched = [(lines[i], o) for i, o in enumerate(outcomes) if o.status == "no_match" and o.shown is not None]

    def caption(crop: Crop) -> str:
        return f"#{crop.line} " + ("landmarks" if crop.score is None else f"{crop.score:.4f}")

    def face(o: Outcome) -> FaceCrop:
        chosen = o.kept[0] if o.kept else o.shown
        assert chosen is not None, f"an outcome without a face to show: {o}"
        return chosen

    sections: list[Section] = [
        (f"sample: {len(picks)} of {len(crops)} kept faces", [(crops[i].jpeg, caption(crops[i])) for i in picks]),
        (f"lowest scores: {len(scored)}", [(c.jpeg, caption(c)) for c in scored]),
        (f"several faces: {len(groups)} photos (the face kept, or the best one when left out)",
         [(face(o).jpeg, f"#{line} {'kept' if o.kept else 'left out'}") for line, o in groups[:several]]),
        (f"far from their identity: {len(unmatched)} (left out)",
         [(face(o).jpeg, f"#{line} sim {face(o).similarity:.2f}") for line, o in unmatched[:far]])]
    return [(title, tiles) for title, tiles in sections if tiles]


def write_preview(path: Path, sections: Sequence[Section], columns: int = 8) -> None:
    """A PNG grid of ``sections`` (``preview_sections``), each under its title, each crop under its caption."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    tile, caption, title_h = 112, 14, 18
    height = sum(title_h + -(-len(tiles) // columns) * (tile + caption) for _, tiles in sections)
    canvas = Image.new("RGB", (columns * tile, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    y = 0
    for title, tiles in sections:
        draw.text((4, y + 3), title, fill=(0, 0, 0), font=font)
        y += title_h
        for k, (jpeg, text) in enumerate(tiles):
            x, row_y = (k % columns) * tile, y + (k // columns) * (tile + caption)
            with Image.open(io.BytesIO(jpeg)) as face:
                canvas.paste(face.convert("RGB"), (x, row_y))
            draw.text((x + 3, row_y + tile + 1), text, fill=(0, 0, 0), font=font)
        y += -(-len(tiles) // columns) * (tile + caption)
    out = io.BytesIO()
    canvas.save(out, "PNG")
    atomic_write(path, lambda f: f.write(out.getvalue()))
