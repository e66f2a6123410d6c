"""From your own photos to a training set: detect each face, align it to the ArcFace template, pack.

    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR                  # PHOTOS_DIR/<identity>/<photo>
    python scripts/prepare_faces.py photos.txt OUT_DIR                  # lines: path label
    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR --holdout 20     # + OUT_DIR/holdout.bin of pairs
    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR --landmarks points.csv   # no detection for those photos

Input: a folder with one folder per identity (photos in sub-folders of it belong to it too; hidden and system
entries such as .ipynb_checkpoints, __MACOSX, @eaDir, Thumbs.db are ignored and named in one line), or a list file
of ``path label`` lines (the label is the last field; relative paths start from the list file's folder; blank
lines and ``#`` comments are skipped). Photos of any size in the formats Pillow reads (JPEG, PNG, WebP, BMP,
TIFF, GIF), read by ``alignment.read_photo``: EXIF orientation applied, every mode made RGB, 16-bit scaled.
``--landmarks`` names a CSV (``path,x1,y1,...,x5,y5``: left eye, right eye, nose, left and right mouth corners;
an optional header line) or JSON file (``{"path": [[x, y] x 5]}`` or ``[{"path": ..., "landmarks": ...}]``),
paths relative to the photo root: those photos are aligned at the given points without detection.

Each photo: decoded in ``--workers`` processes; faces found by MTCNN (``alignment.FaceDetector``, from the
optional facenet-pytorch package) in batches of ``--batch-size`` photos on ``--device``; faces below
``--min-score`` or ``--min-face-size`` (pixels of the photo, the box's shorter side) are not counted; no face
is skipped; several faces: ``--multi largest`` keeps the largest one nearest the centre, ``skip`` skips the
photo, ``all`` keeps every face. The kept faces are aligned (``alignment.align_face``: the 5-point similarity
onto the 112x112 ArcFace template, bilinear, black outside the photo) and encoded as JPEG quality 95.

OUT_DIR gets ``train.rec``, ``train.idx``, ``property`` (insightface layout; class ids follow the sorted
identities that kept a face, held-out ones left out), with ``--holdout N`` ``holdout.bin`` (pairs of N
identities, chosen with ``--seed``, none of them in train.rec: every same-identity pair, up to ``--pairs / 2``,
and as many different-identity pairs; train with ``val_targets=holdout``), ``report.csv`` (one row per photo;
with ``--multi all`` one per kept face), ``preview.png`` (a sample of the crops and the lowest-scoring ones,
captioned with their line in report.csv) and ``prepare_faces.json`` (written last: the input, the settings,
the summary). Every file is written in a staging folder and renamed into place; nothing in the input is
modified. An OUT_DIR holding these files from another input (or from another tool) is refused unless
``--overwrite``.

Work is saved in ``OUT_DIR/.prepare_faces-work`` every ``--chunk-size`` photos: an interrupted run (Ctrl-C, a
kill, a crash) continues where it stopped when started again with the same command, and its output is
byte-identical to that of an uninterrupted run. The same input and settings on the same device give the same
bytes. The folder is removed when the output is complete.

Exit status: 0 written (photos without a usable face are in the report, unreadable ones on stderr too); 1 no
face kept, a --holdout the photos cannot fill, or the face detector is not installed (one line saying how to
install it); 2 usage: bad options, a missing input, a malformed list or landmarks file, an OUT_DIR holding
another dataset or that cannot be written; 130 / 143 after Ctrl-C / SIGTERM (run again to continue).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from alignment import DetectorUnavailable
from photos.pipeline import Settings
from photos.prepare import prepare
from photos.work import WorkFolder
from utils.cli import run_tool, tool_messages
from utils.distributed import pick_device

TOOL = "prepare_faces"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("photos", type=Path, metavar="PHOTOS_DIR",
                        help="a folder of identity folders of photos, or a list file of 'path label' lines")
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="where the training set and the report go")
    parser.add_argument("--landmarks", type=Path, metavar="FILE",
                        help="CSV (path,x1,y1,...,x5,y5) or JSON file of 5 points per photo: no detection for those")
    parser.add_argument("--multi", choices=("largest", "skip", "all"), default="largest",
                        help="a photo with several faces: keep the largest one nearest the centre (default), skip "
                             "the photo, or keep them all")
    parser.add_argument("--min-score", type=float, default=0.9,
                        help="faces the detector scores below this are not counted (default 0.9)")
    parser.add_argument("--min-face-size", type=float, default=40.0, metavar="PIXELS",
                        help="faces whose box's shorter side is smaller (in the photo's pixels) are not counted "
                             "(default 40)")
    parser.add_argument("--holdout", type=int, default=0, metavar="N",
                        help="hold N identities (with 2+ kept faces) out of train.rec and write them as holdout.bin "
                             "pairs (default 0: none; at least 2)")
    parser.add_argument("--pairs", type=int, default=3000, help="at most this many pairs in holdout.bin (default 3000)")
    parser.add_argument("--seed", type=int, default=0, help="which identities are held out and which pairs (default 0)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes decoding photos (default: one per core; 0: in the main process)")
    parser.add_argument("--batch-size", type=int, default=16, help="photos per detection batch (default 16)")
    parser.add_argument("--detect-size", type=int, default=640, metavar="PIXELS",
                        help="photos are scaled to fit this square for detection (default 640)")
    parser.add_argument("--chunk-size", type=int, default=256,
                        help="photos per saved chunk of work: what an interrupted run can lose (default 256)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the output files in an OUT_DIR that holds another dataset")
    args = parser.parse_args(argv)
    for name, low in (("pairs", 2), ("workers", 0), ("batch_size", 1), ("detect_size", 64), ("chunk_size", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.holdout == 1 or args.holdout < 0:
        parser.error(f"--holdout must be 0 or >= 2 (different-identity pairs need two), got {args.holdout}")
    if not 0.0 <= args.min_score <= 1.0:
        parser.error(f"--min-score must be in [0, 1], got {args.min_score:g}")
    if args.min_face_size < 0:
        parser.error(f"--min-face-size must be >= 0, got {args.min_face_size:g}")
    try:
        args.device = pick_device(args.device, bind_local_rank=False, name="--device")
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings(args.multi, args.min_score, args.min_face_size, args.detect_size, args.batch_size,
                        args.chunk_size, args.device.type)
    opened: list[WorkFolder] = []

    def work() -> None:
        print(prepare(args.photos, args.out, settings, args.device, args.landmarks, args.holdout, args.pairs,
                      args.seed, args.workers, args.overwrite, work_opened=opened.append))

    def interrupted() -> str:
        if not opened or not opened[0].dir.exists():
            return ""
        return (f"; {opened[0].done_photos()} of {opened[0].photos} photos are saved in {opened[0].dir}: run the same "
                f"command again to continue")

    with tool_messages(TOOL, "photos"):
        return run_tool(TOOL, work, bad_data=(DetectorUnavailable,), on_interrupt=interrupted)


if __name__ == "__main__":
    sys.exit(main())
