"""Training loader throughput: decoded + flipped + normalised images/s from a RecordIO dataset.

    python bench/loader.py --rec DIR --workers K [--batch-size B] [--images N] [--repeats R] [--json PATH]

Times three pipelines on the same records, in each of ``--repeats`` rounds: the decode loop (read, decode, flip,
normalise on one core, in this process, no DataLoader: what a worker could reach if moving images cost nothing);
ours (``dataset.MXFaceDataset`` + ``dataset.get_dataloader``, K workers); a baseline built the usual way (PIL,
then torchvision transforms in a ``DataLoader`` with the same workers and batch size). ``/ decode loop`` is a
pipeline's images/s per worker over the decode loop's in the same round. Without ``--rec`` a temporary rec of
synthetic 112x112 JPEGs is written first. What each figure counts, and the figures: bench/README.md#data-loader.
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.data import DataLoader, Dataset

from bench.common import markdown_table, write_json

NUM_CLASSES = 50  # of a generated rec


def synthetic_items(num_images: int, seed: int = 0) -> Iterator[tuple[int, bytes]]:
    """``(label, 112x112 JPEG quality 90)`` grouped by ascending label: rendered synthetic faces
    (``dataset.synthetic_faces``)."""
    from dataset.synthetic_faces import encode_jpeg, identity_params, render_sample

    per_class = -(-num_images // NUM_CLASSES)
    for n in range(num_images):
        label, index = divmod(n, per_class)
        img, _ = render_sample(seed, "train", identity_params(seed, label), label, index)
        yield label, encode_jpeg(img, 90)


class BaselineDataset(Dataset):
    """The usual pipeline: record → PIL decode → RandomHorizontalFlip → ToTensor → Normalize."""

    def __init__(self, rec_dir: Path) -> None:
        from torchvision import transforms

        from dataset import MXFaceDataset

        self.records = MXFaceDataset(rec_dir)  # only for its record keys and raw bytes
        self.transform = transforms.Compose([
            transforms.RandomHorizontalFlip(), transforms.ToTensor(),
            transforms.Normalize(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5]),
        ])

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        data, label, _ = self.records.raw(index)
        image = Image.open(io.BytesIO(data)).convert("RGB")
        return self.transform(image), torch.tensor(label, dtype=torch.int64)


def _images_per_s(make_iter, batch_size: int, num_images: int) -> float:
    """Images/s over ``num_images`` images after the first batch, iterating fresh epochs as needed."""
    seen, start = 0, None
    while True:
        for images, _ in make_iter():
            assert images.dtype == torch.float32, images.dtype
            if start is None:  # first batch: workers are up now
                start = time.perf_counter()
                continue
            seen += images.shape[0]
            if seen >= num_images:
                return seen / (time.perf_counter() - start)


def _decode_loop_images_per_s(dataset, sampler, num_images: int) -> float:
    """The decode loop: ``num_images`` records in ``sampler``'s order and with its flips (epochs repeated as
    needed), each read, decoded, flipped and normalised here, one at a time."""
    from dataset.images import decode, normalise

    seen, start = 0, time.perf_counter()
    while True:
        indices, flips = sampler.epoch_plan()
        for index, flip in zip(indices.tolist(), flips.tolist()):
            data, _, where = dataset.raw(index)
            image = decode(data, where, dataset.image_size)  # (3, H, W) uint8, a view of (H, W, 3) storage
            image = image.flip(-1) if flip else image  # (3, H, W), same strides
            # Normalised in the decoder's (H, W, 3) layout, the cheapest for one image (the loop's images go
            # nowhere, so their layout does not matter): the loop is the fastest honest reference we know.
            normalise(image.permute(1, 2, 0))  # (H, W, 3) float32
            seen += 1
            if seen == num_images:
                return seen / (time.perf_counter() - start)
        sampler.set_epoch(sampler.epoch + 1)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(rec_dir: Path, workers: int, batch_size: int, num_images: int, repeats: int = 3) -> dict[str, Any]:
    """The decode loop's, our loader's and the baseline's images/s on the records of ``rec_dir``, ``repeats``
    rounds of all three; top-level figures are medians over the rounds, ``spread`` has their min and max."""
    from dataset import FaceSampler, build_dataset, get_dataloader

    ours_ds = build_dataset(str(rec_dir))
    if len(ours_ds) < 2 * batch_size:
        raise ValueError(f"bench/loader.py: {rec_dir} has {len(ours_ds)} images; need at least 2 batches of "
                         f"{batch_size}")
    ours = get_dataloader(ours_ds, batch_size, rank=0, world_size=1, seed=0, num_workers=workers, device="cpu")
    epoch = [0]

    def ours_iter():
        ours.set_epoch(epoch[0])
        epoch[0] += 1
        return iter(ours)

    # The loader's own sampler settings: the loop reads the records the loader reads, with the same flips.
    loop_sampler = FaceSampler(len(ours_ds), batch_size, 0, 1, seed=0)
    base = DataLoader(BaselineDataset(rec_dir), batch_size=batch_size, shuffle=True, num_workers=workers,
                      drop_last=True, persistent_workers=workers > 0)
    cores = max(workers, 1)
    _decode_loop_images_per_s(ours_ds, loop_sampler, batch_size)  # warm-up: page cache, decoder tables
    rounds = []
    for _ in range(repeats):
        loop_ips = _decode_loop_images_per_s(ours_ds, loop_sampler, num_images)
        ours_ips = _images_per_s(ours_iter, batch_size, num_images)
        base_ips = _images_per_s(lambda: iter(base), batch_size, num_images)
        rounds.append({"decode_loop_images_per_s": loop_ips, "ours_images_per_s": ours_ips,
                       "baseline_images_per_s": base_ips,
                       "ours_per_core_over_decode_loop": ours_ips / cores / loop_ips,
                       "baseline_per_core_over_decode_loop": base_ips / cores / loop_ips,
                       "speedup": ours_ips / base_ips})
    spread = {key: _spread([r[key] for r in rounds]) for key in rounds[0]}
    result: dict[str, Any] = {"images": num_images, "workers": workers, "batch_size": batch_size,
                              "dataset_images": len(ours_ds), "repeats": repeats}
    result.update({key: s["median"] for key, s in spread.items()})
    result["ours_images_per_s_per_core"] = result["ours_images_per_s"] / cores
    result["baseline_images_per_s_per_core"] = result["baseline_images_per_s"] / cores
    result["spread"], result["rounds"] = spread, rounds
    return result


def _cell(spread: dict[str, float], fmt: str, scale: float = 1.0) -> str:
    """``median (min-max)``."""
    m, lo, hi = (spread[k] / scale for k in ("median", "min", "max"))
    return f"{m:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"


def table(result: dict[str, Any]) -> str:
    """The markdown table ``main`` prints."""
    s, w, b, cores = result["spread"], result["workers"], result["batch_size"], max(result["workers"], 1)
    loop = s["decode_loop_images_per_s"]
    return markdown_table(
        ["pipeline", "workers", "batch", "images/s", "images/s per core", "per core / decode loop"],
        [["decode loop (read, decode, flip, normalise; 1 core, no DataLoader)", "-", "-",
          _cell(loop, ".0f"), _cell(loop, ".0f"), "1"],
         ["ours (MXFaceDataset + get_dataloader)", w, b, _cell(s["ours_images_per_s"], ".0f"),
          _cell(s["ours_images_per_s"], ".0f", cores), _cell(s["ours_per_core_over_decode_loop"], ".2f")],
         ["baseline (PIL + torchvision)", w, b, _cell(s["baseline_images_per_s"], ".0f"),
          _cell(s["baseline_images_per_s"], ".0f", cores), _cell(s["baseline_per_core_over_decode_loop"], ".2f")],
         ["speed-up ours / baseline", "", "", _cell(s["speedup"], ".2f") + "x", "", ""]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rec", help="dataset folder with train.rec/train.idx (default: a generated one)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--images", type=int, default=4096, help="images timed per pipeline (and generated)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three pipelines; medians reported")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.workers < 0 or args.batch_size < 1 or args.images < 1 or args.repeats < 1:
        parser.error(f"need --workers >= 0, --batch-size >= 1, --images >= 1, --repeats >= 1; got {args.workers}, "
                     f"{args.batch_size}, {args.images}, {args.repeats}")
    torch.set_num_threads(1)  # the decode loop's one core; the main process only collects batches
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        rec_dir = Path(args.rec) if args.rec else Path(tmp)
        if not args.rec:
            from dataset.recordio import write_insightface_rec

            write_insightface_rec(rec_dir, synthetic_items(max(args.images, 2 * args.batch_size)), NUM_CLASSES)
        result = run(rec_dir, args.workers, args.batch_size, args.images, args.repeats)
    result["rec"] = args.rec or "generated"
    print(table(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
