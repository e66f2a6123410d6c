"""What the pipeline shows of its decisions: ``report.csv`` (a row per photo, or per kept face) and ``preview.png``
(a sample of the crops and the lowest-scoring ones, captioned with their line in the report).

The columns and statuses are documented in docs/data.md ("report.csv"); the rows follow the photos' order, which
is the order of the records within a class.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from photos.listing import Photo
from utils.files import atomic_write

REPORT_COLUMNS = ("path", "identity", "label", "status", "faces", "score", "box", "landmarks", "reason")


class Crop(NamedTuple):
    """A kept face as the output needs it."""

    line: int  # its row in report.csv (the header is line 1)
    score: float | None  # None: aligned at given landmarks
    jpeg: bytes
    identity: str
    label: int | None  # its class id in train.rec; None when held out


def _numbers(values) -> str:
    return " ".join(f"{float(v):.1f}" for v in np.asarray(values).reshape(-1))


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def report_rows(photos: list[Photo], results: list[dict], class_of: dict[str, int], held: set[str]
                ) -> tuple[list[list[str]], list[Crop]]:
    """The report's rows, and every kept crop."""
    rows: list[list[str]] = []
    crops = []
    for photo, result in zip(photos, results):
        shown = [result] if not result["crops"] else result["crops"]
        for crop in shown:
            status, label = result["status"], None
            if result["crops"]:
                status = "holdout" if photo.identity in held else "kept"
                label = class_of.get(photo.identity)
                crops.append(Crop(len(rows) + 2, crop["score"], bytes(crop["jpeg"].numpy().tobytes()), photo.identity,
                                  label))
            rows.append([photo.name, photo.identity, _cell(label), status, _cell(result["faces"]),
                         "" if crop["score"] is None else f"{crop['score']:.4f}",
                         "" if crop["box"] is None else _numbers(crop["box"]),
                         "" if crop["points"] is None else _numbers(crop["points"]), result["reason"]])
    return rows, crops


def write_report(path: Path, rows: list[list[str]]) -> None:
    """``report.csv`` at ``path``, atomically."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(REPORT_COLUMNS)
    writer.writerows(rows)
    atomic_write(path, lambda f: f.write(text.getvalue().encode()))


def write_preview(path: Path, crops: list[Crop], sample: int = 24, lowest: int = 8, columns: int = 8) -> None:
    """A PNG grid: an evenly spaced sample of the kept crops, then the lowest-scoring ones, each captioned with
    its line in report.csv and its score."""
    from PIL import Image, ImageDraw, ImageFont

    picks = sorted(set(np.linspace(0, len(crops) - 1, min(sample, len(crops))).round().astype(int).tolist()))
    scored = sorted((c for c in crops if c.score is not None), key=lambda c: (c.score, c.line))[:lowest]
    sections = [(f"sample: {len(picks)} of {len(crops)} kept faces", [crops[i] for i in picks]),
                (f"lowest scores: {len(scored)}", scored)]
    sections = [(title, items) for title, items in sections if items]
    font = ImageFont.load_default()
    tile, caption, title_h = 112, 14, 18
    height = sum(title_h + -(-len(items) // columns) * (tile + caption) for _, items in sections)
    canvas = Image.new("RGB", (columns * tile, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    y = 0
    for title, items in sections:
        draw.text((4, y + 3), title, fill=(0, 0, 0), font=font)
        y += title_h
        for k, item in enumerate(items):
            x, row_y = (k % columns) * tile, y + (k // columns) * (tile + caption)
            with Image.open(io.BytesIO(item.jpeg)) as face:
                canvas.paste(face.convert("RGB"), (x, row_y))
            text = f"#{item.line} " + ("landmarks" if item.score is None else f"{item.score:.4f}")
            draw.text((x + 3, row_y + tile + 1), text, fill=(0, 0, 0), font=font)
        y += -(-len(items) // columns) * (tile + caption)
    out = io.BytesIO()
    canvas.save(out, "PNG")
    atomic_write(path, lambda f: f.write(out.getvalue()))
