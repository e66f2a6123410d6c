"""dataset/dali.py: the DALI loader is fed by index, with FaceDataLoader's batches.

On the CPU: ``RecordBatches`` (what the DALI pipeline is fed) holds, for world sizes 1, 2 and 3 and a dataset
size no batch or world size divides, the samples, labels, flips and record bytes of ``FaceDataLoader``'s
batches; resuming at a step reads no record of the batches before it; the module imports without DALI.
Where DALI and CUDA are installed (``pytest -m cuda``): the loader's batches against FaceDataLoader's, resumed
and fresh.
"""
from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from dataset import MXFaceDataset, get_dataloader
from dataset.dali import DaliLoader, RecordBatches
from dataset.images import decode, normalise, stack_flipped
from dataset.loader import FaceSampler
from dataset.recordio import IndexedRecordIO, IRHeader, pack, write_insightface_rec
from tests.helpers import ROOT

N, CLASSES, SEED = 23, 5, 7  # 23: no batch size or world size below divides it


def _face(i: int) -> bytes:
    """JPEG of a 112x112 image that differs from every other ``i`` and from its own mirror image: a left-right
    ramp in red, a top-down ramp in blue, green 6 * i. 4:4:4 at quality 95, so decoders differ by rounding."""
    ramp = np.linspace(0, 200, 112).round().astype(np.uint8)  # (112,)
    img = np.empty((112, 112, 3), np.uint8)
    img[..., 0] = ramp[None, :]
    img[..., 1] = 6 * i % 240
    img[..., 2] = ramp[:, None]
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=95, subsampling=0)
    return buf.getvalue()


def _write_rec(folder, layout: str, n: int = N) -> tuple[list[int], list[bytes]]:
    """A rec of ``n`` images in ``layout``; returns the label and image bytes of each dataset index."""
    images = [_face(i) for i in range(n)]
    if layout == "insightface":  # header record 0, images 1..n grouped by label, identity-range records after
        labels = [i * CLASSES // n for i in range(n)]
        write_insightface_rec(folder, zip(labels, images), CLASSES)
    else:  # im2rec: every record an image, keys neither contiguous nor from 0, labels in no order
        labels = [3 * i % CLASSES for i in range(n)]
        with IndexedRecordIO(folder / "train.idx", folder / "train.rec", "w") as rec:
            for i, (label, image) in enumerate(zip(labels, images)):
                rec.write_idx(100 + 7 * (n - i), pack(IRHeader(0, float(label), i, 0), image))
        (folder / "property").write_text(f"{CLASSES},112,112")
    return labels, images


# (world_size, rank, batch_size, epoch, start_step); per rank: 23 | 11 | 7 samples, 5 | 3 | 3 batches
CASES = [(1, 0, 4, 0, 0), (1, 0, 4, 2, 3), (2, 0, 3, 1, 0), (2, 1, 3, 1, 2), (3, 1, 2, 0, 1), (3, 2, 2, 4, 2)]


@pytest.mark.parametrize("layout", ["insightface", "im2rec"])
@pytest.mark.parametrize("world_size, rank, batch_size, epoch, start_step", CASES)
def test_record_batches_are_the_pytorch_loaders_batches(tmp_path, layout, world_size, rank, batch_size, epoch,
                                                         start_step):
    """Batch by batch: FaceSampler's indices and flips, the labels and image bytes written for those indices,
    and, decoded and mirrored on the CPU, FaceDataLoader's images to the bit."""
    labels, images = _write_rec(tmp_path, layout)
    data = MXFaceDataset(tmp_path)
    batches = RecordBatches(data, batch_size, rank=rank, world_size=world_size, seed=SEED)
    batches.set_epoch(epoch, start_step)
    sampler = FaceSampler(N, batch_size, rank, world_size, SEED)
    sampler.set_epoch(epoch, start_step)
    loader = get_dataloader(data, batch_size, rank=rank, world_size=world_size, seed=SEED, num_workers=0,
                            device="cpu")
    loader.set_epoch(epoch, start_step)
    got, plan, want = list(batches), list(sampler.batches()), list(loader)
    assert len(batches) == len(loader) and len(got) == len(plan) == len(want) == len(loader) - start_step > 0
    for batch, (indices, flips), (ref_images, ref_labels) in zip(got, plan, want):
        assert batch.indices == indices
        assert batch.mirror.dtype == np.int32 and batch.mirror.tolist() == [int(f) for f in flips]
        assert batch.labels.dtype == np.int64
        assert batch.labels.tolist() == [labels[i] for i in indices] == ref_labels.tolist()
        assert all(d.dtype == np.uint8 and d.ndim == 1 for d in batch.data)
        assert [d.tobytes() for d in batch.data] == [images[i] for i in indices]
        decoded = [decode(d.tobytes(), f"index {i}") for d, i in zip(batch.data, indices)]  # [(3, H, W) uint8]
        assert torch.equal(normalise(stack_flipped(decoded, batch.mirror.astype(bool).tolist())), ref_images)


def test_an_epoch_flips_some_images_and_not_others(tmp_path):
    """The flip comparisons above can fail only if both flip values occur."""
    _write_rec(tmp_path, "insightface")
    batches = RecordBatches(MXFaceDataset(tmp_path), 4, rank=0, world_size=1, seed=SEED)
    batches.set_epoch(1)
    mirror = np.concatenate([b.mirror for b in batches])
    assert 0 < int(mirror.sum()) < len(mirror)


def test_resume_reads_no_record_of_the_skipped_batches(tmp_path, monkeypatch):
    """Started at batch k, iteration reads the records of batches k.. of the epoch, once each and in order,
    and nothing else: no skipped batch's record, no header or identity-range record."""
    _write_rec(tmp_path, "insightface")
    data = MXFaceDataset(tmp_path)
    assert data.keys.tolist() == list(range(1, N + 1))  # record 0 is the header, N + 1.. the identity ranges
    whole = RecordBatches(data, 2, rank=1, world_size=3, seed=SEED)
    whole.set_epoch(3)
    epoch = list(whole)
    assert len(epoch) == len(whole) == 3
    reads: list[int] = []
    read_idx = IndexedRecordIO.read_idx
    monkeypatch.setattr(IndexedRecordIO, "read_idx", lambda self, key: reads.append(int(key)) or read_idx(self, key))
    for k in range(len(whole) + 1):
        reads.clear()
        resumed = RecordBatches(data, 2, rank=1, world_size=3, seed=SEED)
        resumed.set_epoch(3, k)
        got = list(resumed)
        assert [b.indices for b in got] == [b.indices for b in epoch[k:]]
        assert [[d.tobytes() for d in b.data] for b in got] == [[d.tobytes() for d in b.data] for b in epoch[k:]]
        assert reads == [int(data.keys[i]) for b in epoch[k:] for i in b.indices], k


def test_dali_loader_length_and_an_epoch_resumed_at_its_end_need_no_dali(tmp_path, monkeypatch):
    """``len()`` is FaceDataLoader's; resumed at the last step there is nothing to read (and no pipeline)."""
    _write_rec(tmp_path, "im2rec")
    data = MXFaceDataset(tmp_path)
    loader = DaliLoader(RecordBatches(data, 3, rank=1, world_size=2, seed=SEED), device_id=0)
    ref = get_dataloader(data, 3, rank=1, world_size=2, seed=SEED, num_workers=0, device="cpu")
    assert len(loader) == len(ref) == 3 and loader.num_images == N
    monkeypatch.setattr(IndexedRecordIO, "read_idx", lambda self, key: pytest.fail(f"read key {key}"))
    loader.set_epoch(2, len(loader))
    assert list(loader) == []


def test_the_module_imports_without_importing_dali():
    code = ("import sys, dataset.dali; "
            "assert 'nvidia.dali' not in sys.modules, sorted(m for m in sys.modules if m.startswith('nvidia.dali'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------------------------ with DALI and CUDA

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check runs these)")
@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2)])
def test_dali_loader_gives_the_pytorch_loaders_batches(tmp_path, monkeypatch, rank, world_size):
    """Shapes, dtypes, labels and (decoder rounding aside) images of FaceDataLoader's batches, held across
    iterations as gradient accumulation holds them; resumed at step k, batches k.. of the epoch, reading only
    their records; an epoch left early does not leak into the next."""
    pytest.importorskip("nvidia.dali", reason="nvidia-dali is not installed (optional)")
    from dataset import get_dali_dataloader

    n, batch_size, k = 40, 4, 2
    _write_rec(tmp_path, "insightface", n)
    data = MXFaceDataset(tmp_path)

    def dali():
        return get_dali_dataloader(tmp_path, batch_size, rank=rank, world_size=world_size, seed=SEED,
                                   device=torch.device("cuda", 0))

    def reference(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ref = get_dataloader(data, batch_size, rank=rank, world_size=world_size, seed=SEED, num_workers=0,
                             device="cpu")
        ref.set_epoch(epoch)
        return list(ref)

    def check(got, want):
        assert len(got) == len(want)
        for (images, labels), (ref_images, ref_labels) in zip(got, want):
            assert images.shape == (batch_size, 3, 112, 112) and images.dtype == torch.float32 and images.is_cuda
            assert labels.shape == (batch_size,) and labels.dtype == torch.int64 and labels.is_cuda
            assert torch.equal(labels.cpu(), ref_labels)
            levels = (images.cpu() - ref_images).abs() * 127.5  # nvJPEG against libjpeg-turbo, in pixel levels
            # A wrong image or flip differs by 2 levels on average at least (green 6 * i, the ramps).
            assert float(levels.mean()) < 1 and float(levels.max()) <= 8, (float(levels.mean()), float(levels.max()))

    loader = dali()
    loader.set_epoch(1)
    want = reference(1)
    assert len(loader) == len(want) == n // world_size // batch_size
    check(list(loader), want)

    reads: list[int] = []
    read_idx = IndexedRecordIO.read_idx
    monkeypatch.setattr(IndexedRecordIO, "read_idx", lambda self, key: reads.append(int(key)) or read_idx(self, key))
    resumed = dali()
    reads.clear()  # opening the rec reads its header and last record
    resumed.set_epoch(1, k)
    check(list(resumed), want[k:])
    plan = FaceSampler(n, batch_size, rank, world_size, SEED)
    plan.set_epoch(1, k)
    assert sorted(reads) == sorted(int(data.keys[i]) for indices, _ in plan.batches() for i in indices)
    monkeypatch.undo()

    next(iter(loader))  # the trainer leaves an epoch after its last step
    loader.set_epoch(2)
    check(list(loader), reference(2))
