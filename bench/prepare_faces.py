"""The photo pipeline's speed: photos/s of ``photos.prepare`` by photo size, and where a photo's time goes.

    python bench/prepare_faces.py [--sizes small,lfw,12mp] [--photos N] [--workers K] [--device cpu|cuda]
                                  [--repeats R] [--json PATH]

For each photo size, ``--photos`` distinct JPEGs are made from scikit-image's astronaut (her face placed, scaled
and noised differently in each, so that no two files are alike): ``small`` 92x112 (an academic face set's size,
her face about 55 px), ``lfw`` 250x250 (her face about 110 px), ``12mp`` 4000x3000 (a phone's photo: a textured
scene, her face about 500 px, about 2.5 MB each). Then:

- **end to end**: ``photos.prepare.prepare`` over the photos into a fresh OUT_DIR (listing, reading, detection,
  alignment, the work folder, the report, the preview, the rec), ``--workers`` processes, on ``--device``:
  photos/s, the median of ``--repeats`` runs with (min-max). Interpreter start-up and imports are not counted
  (about 3 s), so a run of N photos takes about 3 s + N / rate. Beside it the CPU time per photo of all the
  processes, which a busy machine does not change much, and the rate it gives where ``--workers`` cores are
  free: workers / CPU time.
- **per photo**: the three stages of one photo in this process on one thread, CPU seconds (median over the
  photos): reading (``alignment.read_photo``), detection (``FaceDetector.detect``: the canvas, MTCNN, and the
  O-Net pass on the upright and mirrored views of each face), alignment (each face's crop and its JPEG). The
  detection is also timed the earlier way, every photo enlarged or shrunk onto the 640-pixel canvas (and there
  through float pixels, as before), as a reference measured in the same run.
"""
from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.common import markdown_table, write_json

SIZES = {"small": (112, 92), "lfw": (250, 250), "12mp": (3000, 4000)}  # (H, W)
TARGETS = {"small": 30.0, "lfw": 30.0, "12mp": 5.0}  # photos/s on the 2-core development CPU (bench/README.md)


def tool_settings(device: torch.device):
    """The tool's default settings on ``device``."""
    from photos.pipeline import Settings

    return Settings("match", 0.9, 40.0, 640, 16, device.type)


def make_photo(size: str, seed: int) -> bytes:
    """One distinct JPEG of ``size`` (``SIZES``) showing the astronaut's face."""
    from PIL import Image
    from skimage import data

    rng = np.random.default_rng(seed)
    face = Image.fromarray(data.astronaut())
    height, width = SIZES[size]
    if size == "12mp":
        scene = np.asarray(Image.fromarray(data.coffee()).resize((width, height), Image.Resampling.BILINEAR),
                           np.float32)
        side = int(rng.integers(1100, 1300))
        x, y = int(rng.integers(200, width - side - 200)), int(rng.integers(100, height - side - 100))
        scene[y:y + side, x:x + side] = np.asarray(face.resize((side, side), Image.Resampling.BILINEAR), np.float32)
        quality = 92
    else:
        # Her head (its box is about x 180-268, y 60-173 of the 512x512 photo), moved a little, filling the photo:
        # a 150-pixel-wide crop for the small size (her face about 55 px), 200 for lfw (about 110 px).
        dx, dy = (int(v) for v in rng.integers(-8, 9, 2))
        crop_w = 150 if size == "small" else 200
        crop_h = round(crop_w * height / width)
        x0, y0 = 225 - crop_w // 2 + dx, 117 - crop_h // 2 + dy
        scene = np.asarray(face.crop((x0, y0, x0 + crop_w, y0 + crop_h)).resize((width, height),
                                                                                Image.Resampling.BILINEAR), np.float32)
        quality = 90
    scene += rng.normal(0, 4, scene.shape).astype(np.float32)
    out = io.BytesIO()
    Image.fromarray(scene.clip(0, 255).astype(np.uint8)).save(out, "JPEG", quality=quality)
    return out.getvalue()


def write_photos(root: Path, size: str, count: int) -> Path:
    """``count`` photos of ``size`` as ``root/<identity>/<n>.jpg``, four identities."""
    for n in range(count):
        folder = root / f"id{n % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{n:05d}.jpg").write_bytes(make_photo(size, n))
    return root


def end_to_end(photos: Path, workers: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """photos/s of ``prepare`` over ``photos`` into a fresh OUT_DIR each time (median, min, max)."""
    from photos.prepare import prepare

    count = sum(1 for _ in photos.rglob("*.jpg"))
    settings = tool_settings(device)
    rates, cpu, summary = [], [], ""
    for _ in range(repeats):
        out = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
        try:
            start, used = time.perf_counter(), _cpu_used()
            summary = prepare(photos, out / "out", settings, device, workers=workers)
            rates.append(count / (time.perf_counter() - start))
            cpu.append((_cpu_used() - used) / count)
        finally:
            shutil.rmtree(out)
    return {"photos": count, "photos_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
            "cpu_s_per_photo": statistics.median(cpu), "summary": summary}


def _cpu_used() -> float:
    """CPU seconds of this process and of its children that have ended (the DataLoader workers)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _earlier(detector_class):
    """The detector with the earlier canvas: every photo enlarged or shrunk to fit the 640-pixel square, resized
    through float pixels (the reference of the per-photo table)."""
    import torch.nn.functional as F

    class Earlier(detector_class):
        def _canvas(self, image):
            height, width = image.shape[1:]
            scale = self.detect_size / max(height, width)
            h, w = max(1, round(height * scale)), max(1, round(width * scale))
            canvas = F.interpolate(image[None].to(self.device, torch.float32), size=(h, w), mode="bilinear",
                                   antialias=scale < 1, align_corners=False)[0]
            return canvas.clamp_(0, 255).permute(1, 2, 0), (w / width, h / height)

    return Earlier


def _cpu_seconds(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """CPU seconds of ``fn(*args)`` in this process, and its result."""
    start = time.process_time()
    result = fn(*args)
    return time.process_time() - start, result


def per_photo(photos: Path, device: torch.device) -> dict[str, float]:
    """CPU seconds per photo (median) of reading, detection (now and the earlier way) and alignment, one thread."""
    from alignment import read_photo
    from alignment.detect import FaceDetector
    from photos.pipeline import crop, make_detector

    torch.set_num_threads(1)
    detector = make_detector(tool_settings(device), device)  # as the pipeline detects
    earlier = _earlier(FaceDetector)(device, min_score=0.0, min_face_size=0.0, smallest_face=0.0)
    times: dict[str, list[float]] = {"read_s": [], "detect_s": [], "align_s": [], "detect_640_canvas_s": []}
    files = sorted(photos.rglob("*.jpg"))
    detector.detect([read_photo(files[0])])  # warm-up
    for path in files:
        seconds, image = _cpu_seconds(read_photo, path)
        times["read_s"].append(seconds)
        seconds, faces = _cpu_seconds(detector.detect, [image])
        times["detect_s"].append(seconds)
        times["align_s"].append(_cpu_seconds(lambda im, found: [crop(im, f.points) for f in found], image, faces[0])[0])
        times["detect_640_canvas_s"].append(_cpu_seconds(earlier.detect, [image])[0])
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,lfw,12mp", help=f"photo sizes, of {', '.join(SIZES)}")
    parser.add_argument("--photos", type=int, nargs="+", default=[200, 200, 32], metavar="N",
                        help="photos of each size, in --sizes' order (default 200 200 32)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes {','.join(unknown)}: expected some of {', '.join(SIZES)}")
    counts = (args.photos + args.photos[-1:] * len(sizes))[:len(sizes)]
    device = torch.device(args.device)
    results: dict[str, Any] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-photos-") as tmp:
        for size, count in zip(sizes, counts):
            photos = write_photos(Path(tmp) / size, size, count)
            threads = torch.get_num_threads()
            e2e = end_to_end(photos, args.workers, device, args.repeats)
            stages = per_photo(photos, device)
            torch.set_num_threads(threads)
            results[size] = {"size": SIZES[size], **e2e, **stages, "target_photos_per_s": TARGETS[size]}
            height, width = SIZES[size]
            rows.append([f"{size} {width}x{height}", count, f"{e2e['photos_per_s']:.1f} ({e2e['min']:.1f}-"
                         f"{e2e['max']:.1f})", f"{e2e['cpu_s_per_photo'] * 1e3:.0f}",
                         f"{max(args.workers, 1) / e2e['cpu_s_per_photo']:.1f}", f"{stages['read_s'] * 1e3:.1f}",
                         f"{stages['detect_s'] * 1e3:.1f}", f"{stages['align_s'] * 1e3:.1f}",
                         f"{stages['detect_640_canvas_s'] * 1e3:.1f}", f">= {TARGETS[size]:g}"])
    print(markdown_table(["photos", "count", f"photos/s, {args.workers} workers, {device.type} (min-max)",
                          "CPU ms/photo", "photos/s, free cores", "read ms", "detect ms", "align ms",
                          "detect ms, 640 canvas (before)", "target"], rows))
    write_json(args.json, {"config": {"workers": args.workers, "device": device.type, "repeats": args.repeats,
                                      "load_average": os.getloadavg()}, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
