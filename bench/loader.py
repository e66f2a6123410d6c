"""Training loader throughput: decoded + flipped + normalised images/s from a RecordIO dataset.

    python bench/loader.py --rec DIR --workers K [--batch-size B] [--images N] [--json PATH]

Times our pipeline (``dataset.MXFaceDataset`` + ``dataset.get_dataloader``, rank 0 of 1, CPU) beside a
baseline built here the usual way on the same records: PIL decode, then torchvision
``RandomHorizontalFlip`` / ``ToTensor`` / ``Normalize(0.5, 0.5)`` in a ``DataLoader`` with the same
workers and batch size. Each pipeline delivers ``--images`` images (whole epochs repeated as needed);
the clock starts after the first batch, so worker start-up is not counted. ``per core`` divides by
``max(K, 1)``: the K workers decode, the main process only collects batches.

Without ``--rec`` a temporary insightface-layout rec of ``--images`` synthetic 112x112 JPEGs (quality
90) is written first, so the benchmark runs on a fresh machine.
"""
from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from bench.common import markdown_table, write_json  # noqa: E402

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


def run(rec_dir: Path, workers: int, batch_size: int, num_images: int) -> dict[str, Any]:
    """Both pipelines' images/s on the records of ``rec_dir``."""
    from dataset import build_dataset, get_dataloader

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

    base = DataLoader(BaselineDataset(rec_dir), batch_size=batch_size, shuffle=True, num_workers=workers,
                      drop_last=True, persistent_workers=workers > 0)
    cores = max(workers, 1)
    ours_ips = _images_per_s(ours_iter, batch_size, num_images)
    base_ips = _images_per_s(lambda: iter(base), batch_size, num_images)
    return {"images": num_images, "workers": workers, "batch_size": batch_size, "dataset_images": len(ours_ds),
            "ours_images_per_s": ours_ips, "ours_images_per_s_per_core": ours_ips / cores,
            "baseline_images_per_s": base_ips, "baseline_images_per_s_per_core": base_ips / cores,
            "speedup": ours_ips / base_ips}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rec", help="dataset folder with train.rec/train.idx (default: a generated one)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--images", type=int, default=4096, help="images timed per pipeline (and generated)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.workers < 0 or args.batch_size < 1 or args.images < 1:
        parser.error(f"need --workers >= 0, --batch-size >= 1, --images >= 1; got {args.workers}, "
                     f"{args.batch_size}, {args.images}")
    torch.set_num_threads(1)  # the main process only collects batches
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        rec_dir = Path(args.rec) if args.rec else Path(tmp)
        if not args.rec:
            from dataset.recordio import write_insightface_rec

            write_insightface_rec(rec_dir, synthetic_items(max(args.images, 2 * args.batch_size)), NUM_CLASSES)
        result = run(rec_dir, args.workers, args.batch_size, args.images)
    result["rec"] = args.rec or "generated"
    print(markdown_table(
        ["pipeline", "workers", "batch", "images/s", "images/s per core"],
        [["ours (MXFaceDataset + get_dataloader)", args.workers, args.batch_size,
          f"{result['ours_images_per_s']:.0f}", f"{result['ours_images_per_s_per_core']:.0f}"],
         ["baseline (PIL + torchvision)", args.workers, args.batch_size,
          f"{result['baseline_images_per_s']:.0f}", f"{result['baseline_images_per_s_per_core']:.0f}"],
         ["speed-up", "", "", f"{result['speedup']:.2f}x", ""]]))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
