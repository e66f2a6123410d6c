"""From your own photos to a training set: detect each face, align it to the ArcFace template, pack.

    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR                  # PHOTOS_DIR/<identity>/<photo>
    python scripts/prepare_faces.py photos.txt OUT_DIR                  # lines: path label
    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR --holdout 20     # + OUT_DIR/holdout.bin of pairs
    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR --weights MODEL  # who is who in group photos, mislabels
    python scripts/prepare_faces.py PHOTOS_DIR OUT_DIR --landmarks points.csv   # no detection for those photos

Input: a folder with one folder per identity (photos in sub-folders of it belong to it too; hidden and system
entries such as .ipynb_checkpoints, __MACOSX, @eaDir, Thumbs.db are ignored and named in one line), or a list file
of ``path label`` lines (the label is the last field; relative paths start from the list file's folder; blank
lines and ``#`` comments are skipped). Photos of any size in every format the installed Pillow reads (JPEG, PNG,
WebP, BMP, TIFF, GIF, PGM/PPM, ...; HEIC/HEIF with pillow-heif installed), a file of another suffix when its
content is one; read by ``alignment.read_photo``: EXIF orientation applied, every mode made RGB, 16-bit scaled.
``--landmarks`` names a CSV (``path,x1,y1,...,x5,y5``: left eye, right eye, nose, left and right mouth corners;
an optional header line) or JSON file (``{"path": [[x, y] x 5]}`` or ``[{"path": ..., "landmarks": ...}]``),
paths relative to the photo root: those photos are aligned at the given points without detection.

Each photo: read in ``--workers`` processes; faces found by MTCNN (``alignment.FaceDetector``, from the optional
facenet-pytorch package) on ``--device``, every face aligned (``alignment.align_face``: the 5-point similarity
onto the 112x112 ArcFace template, bilinear, black outside the photo) and encoded as JPEG quality 95, and all of it
kept in ``OUT_DIR/.prepare_faces-work`` (by the photo's content and the detection settings), so that running
again, with other thresholds, ``--multi``, model or holdout, detects nothing already detected. Then the policy:
faces below ``--min-score`` or ``--min-face-size`` (pixels of the photo, the box's shorter side) are not counted;
no face: left out; several faces: ``--multi match`` (the default) keeps the face a recognition model
(``--weights``) matches to the identity's photos with one face, and without a model leaves the photo out;
``largest`` keeps the largest one nearest the centre, ``skip`` leaves the photo out, ``all`` keeps every face.
With ``--weights``, a face far from its identity's other photos (below ``--match-threshold``) is left out as
mislabelled. Copies of one photo (the same file, or re-encoded, resized) are marked in the report and never
form a holdout pair.

OUT_DIR gets ``train.rec``, ``train.idx``, ``property`` (insightface layout; class ids follow the sorted
identities that kept a face, held-out ones left out), with ``--holdout N`` ``holdout.bin`` (pairs of N
identities, chosen with ``--seed``, none of them in train.rec: every same-identity pair, up to ``--pairs / 2``,
and as many different-identity pairs; train with ``val_targets=holdout``), ``report.csv`` (one row per photo;
with ``--multi all`` one per kept face), ``preview.png`` (a sample of the crops, the lowest-scoring ones, the
photos with several faces and those far from their identity, captioned with their line in report.csv) and
``prepare_faces.json`` (written last: the input, the settings, the summary). Every file is written in a staging
folder and renamed into place; nothing in the input is modified. An OUT_DIR holding anything from another input
(or from another tool) is refused unless ``--overwrite``, which moves those files into ``OUT_DIR/replaced``.

An interrupted run (Ctrl-C, a kill, a crash) continues where it stopped when started again, and its output is
byte-identical to that of an uninterrupted run. The same input and settings on the same device give the same
bytes. Remove ``OUT_DIR/.prepare_faces-work`` to free its space; a run without it detects again.

Exit status: 0 written (photos without a usable face are in the report, unreadable ones on stderr too); 1 no
face kept, a --holdout the photos cannot fill, or the face detector is not installed (one line saying how to
install it); 2 usage: bad options, a missing input, a malformed list or landmarks file, a model that cannot be
loaded, an OUT_DIR holding another dataset or that cannot be written; 130 / 143 after Ctrl-C / SIGTERM (run
again to continue).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from utils.cli import quiet_interrupt, run_tool, tool_messages, warn

TOOL = "prepare_faces"

with quiet_interrupt(TOOL):  # torch takes seconds to import: Ctrl-C meanwhile is one line
    from alignment import MULTI, DetectorUnavailable, add_policy_options, check_policy_options
    from photos.matching import DEFAULT_THRESHOLD
    from photos.pipeline import Settings
    from photos.prepare import prepare
    from photos.work import WorkFolder
    from utils.distributed import pick_device


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("photos", type=Path, metavar="PHOTOS_DIR",
                        help="a folder of identity folders of photos, or a list file of 'path label' lines")
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="where the training set and the report go")
    parser.add_argument("--landmarks", type=Path, metavar="FILE",
                        help="CSV (path,x1,y1,...,x5,y5) or JSON file of 5 points per photo: no detection for those")
    parser.add_argument("--multi", choices=MULTI, default="match",
                        help="a photo with several faces: keep the face --weights' model matches to the identity "
                             "(default; without a model the photo is left out), the largest one nearest the centre, "
                             "none (skip), or all")
    parser.add_argument("--weights", type=Path, metavar="MODEL",
                        help="a recognition model (a run's model.pt or folder, an arcface_torch .pt with --network, "
                             "an .onnx) that tells who is who: the face of a group photo that is the identity's, "
                             "and photos far from their identity")
    parser.add_argument("--network", help="the architecture of --weights when no model.json is beside them, e.g. r50")
    parser.add_argument("--match-threshold", type=float, default=DEFAULT_THRESHOLD, metavar="COSINE",
                        help=f"with --weights: a face less similar to its identity is left out (default "
                             f"{DEFAULT_THRESHOLD})")
    add_policy_options(parser)
    parser.add_argument("--holdout", type=int, default=0, metavar="N",
                        help="hold N identities (with 2+ kept faces) out of train.rec and write them as holdout.bin "
                             "pairs (default 0: none; at least 2)")
    parser.add_argument("--pairs", type=int, default=3000, help="at most this many pairs in holdout.bin (default 3000)")
    parser.add_argument("--seed", type=int, default=0, help="which identities are held out and which pairs (default 0)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes reading photos, which on the CPU also detect them (default: one per core; "
                             "0: in the main process)")
    parser.add_argument("--batch-size", type=int, default=16, help="photos per detection batch (default 16)")
    parser.add_argument("--detect-size", type=int, default=640, metavar="PIXELS",
                        help="larger photos are shrunk to fit this square for detection (default 640)")
    parser.add_argument("--chunk-size", type=int, help=argparse.SUPPRESS)  # before detections were kept per photo
    parser.add_argument("--overwrite", action="store_true",
                        help="move the files of another dataset in OUT_DIR aside (into OUT_DIR/replaced)")
    args = parser.parse_args(argv)
    for name, low in (("pairs", 2), ("workers", 0), ("batch_size", 1), ("detect_size", 64)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.holdout == 1 or args.holdout < 0:
        parser.error(f"--holdout must be 0 or >= 2 (different-identity pairs need two), got {args.holdout}")
    check_policy_options(parser, args)
    if not -1.0 <= args.match_threshold <= 1.0:
        parser.error(f"--match-threshold is a cosine similarity, in [-1, 1]; got {args.match_threshold:g}")
    if args.network is not None and args.weights is None:
        parser.error("--network describes the model of --weights; pass --weights too")
    if args.network is not None and args.weights.suffix.lower() == ".onnx":
        parser.error(f"--weights {args.weights} is an ONNX model, run as it is; --network does not apply")
    try:
        args.device = pick_device(args.device, bind_local_rank=False, name="--device")
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.chunk_size is not None:
        warn(TOOL, "--chunk-size is no longer needed (each photo's detections are saved as soon as it is done); "
                   "ignored")
    settings = Settings(args.multi, args.min_score, args.min_face_size, args.detect_size, args.batch_size,
                        args.device.type)
    opened: list[tuple[WorkFolder, int]] = []

    def work() -> None:
        print(prepare(args.photos, args.out, settings, args.device, args.landmarks, args.holdout, args.pairs,
                      args.seed, args.workers, args.overwrite, args.weights, args.network, args.match_threshold,
                      work_opened=lambda folder, photos: opened.append((folder, photos))))

    def interrupted() -> str:
        if not opened or not opened[0][0].root.exists():
            return ""
        folder, photos = opened[0]
        return (f"; the detections of {min(folder.saved(), photos)} of {photos} photos are saved in {folder.root}: "
                f"run the same command again to continue")

    with tool_messages(TOOL, "photos"):
        return run_tool(TOOL, work, bad_data=(DetectorUnavailable,), on_interrupt=interrupted)


if __name__ == "__main__":
    sys.exit(main())
