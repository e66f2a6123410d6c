"""Resident memory of ``dataset.verification_set.load_bin`` against one uint8 copy of the images.

    python bench/bin_memory.py [--images N] [--bin PATH] [--json PATH]

Without ``--bin``, writes a temporary `.bin` of ``N`` synthetic 112x112 JPEGs first (``save_bin``). ``load_bin``
runs in a fresh spawned process, after a 2-pair load has loaded the decoders, so that no heap freed earlier hides
its growth. ``ratio = growth / (N · 3 · 112 · 112)``, one uint8 copy of the images (target <= 1.15);
``peak_ratio`` is the high-water mark during the call against the same copy (informative).
bench/README.md#verification-sets-in-memory.
"""
from __future__ import annotations

import argparse
import gc
import multiprocessing
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import current_rss_bytes, markdown_table, peak_rss_bytes, write_json

TARGET = 1.15
IMAGE_SIZE = (112, 112)


def synthetic_jpegs(num_images: int, seed: int = 0, quality: int = 90) -> list[bytes]:
    """``num_images`` 112x112 JPEGs of upsampled 8x8 random colour grids: smooth, so they compress to a
    few KB like real aligned faces (random noise would compress far worse and overstate the file)."""
    from torchvision.io import encode_jpeg

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_images):
        grid = torch.randint(0, 256, (1, 3, 8, 8), generator=g, dtype=torch.uint8).float()  # (1, 3, 8, 8)
        image = torch.nn.functional.interpolate(grid, size=IMAGE_SIZE, mode="bilinear", align_corners=False)
        out.append(encode_jpeg(image[0].round().to(torch.uint8), quality=quality).numpy().tobytes())
    return out


def write_synthetic_bin(path: Path, num_images: int) -> None:
    """A `.bin` of ``num_images`` (even) synthetic JPEGs, pairs alternately same and different."""
    from dataset.verification_set import save_bin

    save_bin(path, synthetic_jpegs(num_images), [i % 2 == 0 for i in range(num_images // 2)])


def measure(path: str, warmup_path: str) -> dict[str, Any]:
    """Run in a fresh process: resident-set growth and peak of ``load_bin(path)``."""
    torch.set_num_threads(1)
    from dataset.verification_set import load_bin

    load_bin(warmup_path)  # first use of the decoders and allocator pools is not load_bin's cost
    gc.collect()
    before = current_rss_bytes()
    data = load_bin(path)
    gc.collect()
    after = current_rss_bytes()
    peak = peak_rss_bytes()
    images = sum(t.numel() * t.element_size() for t in _tensors(data))
    return {"rss_before_bytes": before, "rss_after_bytes": after, "peak_rss_bytes": peak,
            "tensor_bytes": images, "pairs": len(data[-1])}


def _tensors(data: Any) -> list[torch.Tensor]:
    """The tensors ``load_bin`` returned, whatever its structure (a tensor or a list of them first)."""
    first = data[0]
    return list(first) if isinstance(first, (list, tuple)) else [first]


def run(bin_path: Path, num_images: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench_bin_memory_") as tmp:
        warmup = Path(tmp) / "warmup.bin"
        write_synthetic_bin(warmup, 4)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            m = pool.apply(measure, (str(bin_path), str(warmup)))
    copy = num_images * 3 * IMAGE_SIZE[0] * IMAGE_SIZE[1]
    growth = m["rss_after_bytes"] - m["rss_before_bytes"]
    return {"images": num_images, "pairs": m["pairs"], "file_bytes": bin_path.stat().st_size,
            "copy_bytes": copy, "resident_growth_bytes": growth, "ratio": growth / copy,
            "peak_growth_bytes": m["peak_rss_bytes"] - m["rss_before_bytes"],
            "peak_ratio": (m["peak_rss_bytes"] - m["rss_before_bytes"]) / copy,
            "tensor_bytes": m["tensor_bytes"], "target": TARGET, **{k: m[k] for k in ("rss_before_bytes",
                                                                                        "rss_after_bytes")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=12000, help="images in the generated .bin (even; "
                        "LFW and AgeDB-30 have 12000)")
    parser.add_argument("--bin", type=Path, help="measure this .bin instead of a generated one")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.bin is None and (args.images < 4 or args.images % 2):
        parser.error(f"--images must be even and >= 4 (two images per pair), got {args.images}")
    with tempfile.TemporaryDirectory(prefix="bench_bin_memory_") as tmp:
        path = args.bin
        if path is None:
            path = Path(tmp) / "synthetic.bin"
            write_synthetic_bin(path, args.images)
        elif not path.is_file():
            parser.error(f"--bin {path}: file not found")
        from dataset.verification_set import unpickle_bin

        num_images = args.images if args.bin is None else len(unpickle_bin(path)[0])
        result = run(path, num_images)
    result["bin"] = str(args.bin) if args.bin else "generated"
    mib = 2 ** 20
    print(markdown_table(
        ["images", "file MiB", "one uint8 copy MiB", "resident growth MiB", "resident / copy", "target",
         "peak / copy"],
        [[result["images"], f"{result['file_bytes'] / mib:.1f}", f"{result['copy_bytes'] / mib:.1f}",
          f"{result['resident_growth_bytes'] / mib:.1f}", f"**{result['ratio']:.3f}**", f"<= {TARGET}",
          f"{result['peak_ratio']:.3f}"]]))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
