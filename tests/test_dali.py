"""dataset/dali.py: the DALI loader is fed by index, with FaceDataLoader's batches and its bad-data rules.

On the CPU, without DALI: ``RecordBatches`` (what the DALI pipeline is fed) holds, for world sizes 1, 2 and 3 and a
dataset size no batch or world size divides, the samples, labels, flips and record bytes of ``FaceDataLoader``'s
batches; resuming at a step reads no record of the batches before it; each record's header, length and label and
its image's kind and size (read from the JPEG or PNG header, ``header_size``) are checked before DALI sees it, a
problem naming the file and key; a batch that fails them is read as FaceDataLoader reads it (the same samples left
out, the same lines in ``take_problems``); the module imports without DALI. Where nvidia-dali is installed, with
DALI's CPU decoder (and, ``pytest -m cuda``, on a GPU): the loader's batches against FaceDataLoader's, resumed and
fresh, and a damaged rec's batches, lines and trainer run (skip_bad_images) as with FaceDataLoader, a JPEG damaged
after its header included (DALI's decoding error mapped back to the record).
"""
from __future__ import annotations

import io
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from dataset import MXFaceDataset, get_dataloader
from dataset.dali import DaliLoader, RecordBatches, header_size
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


@pytest.mark.process
def test_the_module_imports_without_importing_dali():
    code = ("import sys, dataset.dali; "
            "assert 'nvidia.dali' not in sys.modules, sorted(m for m in sys.modules if m.startswith('nvidia.dali'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------------------------ the checks, without DALI

def _resized(i: int, size: tuple[int, int], fmt: str, **save) -> bytes:
    """``_face(i)`` resized to ``size`` (H, W) and encoded as ``fmt``."""
    image = Image.open(io.BytesIO(_face(i))).resize((size[1], size[0]))
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


@pytest.mark.parametrize("size", [(112, 112), (96, 80), (250, 251)])
def test_header_size_is_the_size_the_image_decodes_to(size):
    kinds = [("JPEG", {}), ("JPEG", {"progressive": True, "optimize": True}), ("JPEG", {"subsampling": 0}),
             ("JPEG", {"exif": Image.Exif()}), ("PNG", {})]
    for fmt, save in kinds:
        data = _resized(3, size, fmt, **save)
        assert header_size(data) == tuple(decode(data, "x").shape[1:]) == size, (fmt, save)
    gray = io.BytesIO()
    Image.new("L", (size[1], size[0]), 90).save(gray, "JPEG")
    assert header_size(gray.getvalue()) == size


def test_header_size_is_none_for_what_is_not_a_readable_jpeg_or_png_header():
    jpeg, png = _face(0), _resized(0, (112, 112), "PNG")
    gif = io.BytesIO()
    Image.new("RGB", (112, 112)).save(gif, "GIF")
    sos = jpeg.index(b"\xff\xda")
    for data in (b"", b"\xff\xd8", b"\xff\xd8\xff", jpeg[:20], b"\xff\xd8" + jpeg[sos:], png[:20], gif.getvalue(),
                 b"hello, not an image", np.random.default_rng(0).bytes(300)):
        assert header_size(data) is None, data[:24]


# What RecordBatches says of each kind of damage (after "train.rec (key K): "), and how it is made.
CHECKS = {
    "magic": r"bad magic 0xced7230b at byte \d+",
    "label": r"label 7 is out of range for num_classes=5",
    "flag": r"IRHeader flag 100000 announces 100000 label floats",
    "bytes": r"not a JPEG or PNG image with a readable header \(19 bytes, starts with b'hello, n'\)",
    "jpeg_size": r"image is 96x112 \(HxW\) by its header, expected 112x112",
    "png_size": r"image is 112x100 \(HxW\) by its header, expected 112x112",
}
PASS_THE_CHECKS = ("scan", "png")  # a JPEG cut inside its scan (its header is whole), a 112x112 PNG


def _damaged_rec(folder, n: int, damage: dict[int, str]) -> None:
    """An insightface rec of ``n`` images (label ``i * CLASSES // n``) whose dataset index ``i`` is damaged as
    ``damage[i]`` says (a key of CHECKS or PASS_THE_CHECKS)."""
    def image(i: int) -> bytes:
        face = _face(i)
        return {"bytes": b"hello, not an image", "jpeg_size": _resized(i, (96, 112), "JPEG"),
                "png_size": _resized(i, (112, 100), "PNG"), "scan": face[: len(face) * 3 // 5],
                "png": _resized(i, (112, 112), "PNG")}.get(damage.get(i, ""), face)

    write_insightface_rec(folder, [(i * CLASSES // n, image(i)) for i in range(n)], CLASSES)
    with IndexedRecordIO(folder / "train.idx", folder / "train.rec", "r") as rec:
        offsets = {i: rec.offset(i + 1) for i in damage}  # insightface: dataset index i is key i + 1
    with open(folder / "train.rec", "r+b") as f:
        for i, kind in damage.items():
            # record = magic (4) | length (4) | IRHeader: flag uint32, label float32, ...
            at, data = {"magic": (0, b"\x0b\x23\xd7\xce"), "flag": (8, struct.pack("<I", 100000)),
                        "label": (12, struct.pack("<f", 7.0))}.get(kind, (None, b""))
            if at is not None:
                f.seek(offsets[i] + at)
                f.write(data)


def test_record_batches_check_each_record_and_its_image_header(tmp_path):
    """Before DALI sees a record: its magic, length, header and label (MXFaceDataset.raw's checks) and its image's
    kind and size from the JPEG or PNG header; a problem names the file and key, and reading the batch stops there.
    What only decoding finds (a JPEG cut inside its scan) passes, for DALI's decoder to find."""
    damage = {1: "magic", 3: "label", 4: "flag", 6: "bytes", 8: "jpeg_size", 9: "png_size", 11: "scan", 12: "png"}
    _damaged_rec(tmp_path, 14, damage)
    data = MXFaceDataset(tmp_path)
    batches = RecordBatches(data, 1, rank=0, world_size=1, seed=SEED)
    seen = set()
    for batch in batches:
        (index,) = batch.indices
        seen.add(index)
        kind = damage.get(index)
        if kind in CHECKS:
            assert re.fullmatch(rf".*train\.rec \(key {index + 1}\): {CHECKS[kind]}.*", batch.problem), batch.problem
            assert batch.data == [] and batch.labels.tolist() == []
        else:
            assert batch.problem is None, (index, batch.problem)
            assert [d.tobytes() for d in batch.data] == [data.raw(index)[0]]
    assert seen == set(range(14))
    three = RecordBatches(data, 3, rank=0, world_size=1, seed=SEED).read([0, 6, 2], [False, True, False])
    assert "(key 7): not a JPEG or PNG" in three.problem and len(three.data) == 1
    assert three.flips == [False, True, False]


def _every_batch_damaged(folder, n: int, batch_size: int, epoch: int) -> dict[int, str]:
    """A rec in which every batch of ``epoch`` (one rank) holds a record that fails the checks, and the last batch
    only such records; the damage by dataset index."""
    sampler = FaceSampler(n, batch_size, 0, 1, SEED)
    sampler.set_epoch(epoch)
    plan = [indices for indices, _ in sampler.batches()]
    kinds = list(CHECKS)
    damage = {indices[k % batch_size]: kinds[k % len(kinds)] for k, indices in enumerate(plan[:-1])}
    damage.update({i: kinds[-1 - j] for j, i in enumerate(plan[-1])})
    _damaged_rec(folder, n, damage)
    return damage


def test_a_batch_failing_the_checks_is_read_as_the_pytorch_loader_reads_it_without_dali(tmp_path, monkeypatch):
    """Such a batch never reaches DALI: ``read_leaving_out`` reads it as FaceDataLoader does, so the same samples
    are left out (all of them in the last batch: an empty batch) and take_problems() has the same lines, naming
    file and key, after each batch."""
    import dataset.dali as dali

    n, batch_size, epoch = 15, 3, 1
    _every_batch_damaged(tmp_path, n, batch_size, epoch)
    data = MXFaceDataset(tmp_path)
    monkeypatch.setattr(dali, "_import_dali", lambda: pytest.fail("a batch that fails the checks was given to DALI"))
    loader = DaliLoader(RecordBatches(data, batch_size, rank=0, world_size=1, seed=SEED), device_id=None)
    ref = get_dataloader(data, batch_size, rank=0, world_size=1, seed=SEED, num_workers=0, device="cpu")
    loader.set_epoch(epoch)
    ref.set_epoch(epoch)
    got = [(images, labels, loader.take_problems()) for images, labels in loader]
    want = [(images, labels, ref.take_problems()) for images, labels in ref]
    assert len(got) == len(want) == n // batch_size
    for (images, labels, problems), (ref_images, ref_labels, ref_problems) in zip(got, want):
        assert problems == ref_problems and problems, problems
        assert all(re.search(r"train\.rec \(key \d+\): ", line) for line in problems), problems
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)
    assert got[-1][0].shape == (0, 3, 112, 112) and len(got[-1][2]) == batch_size


# ------------------------------------------------------------------------------ with DALI, on the CPU and on a GPU

# DALI's CPU pipeline (its CPU decoder) where nvidia-dali is installed, and its GPU pipeline (nvJPEG) under make
# gpu-check. CI installs no DALI: these run where a developer or the GPU check has it.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check runs these)")])]


def _dali(folder, batch_size: int, rank: int, world_size: int, device: str) -> DaliLoader:
    """The DALI loader over ``folder``: the trainer's (``get_dali_dataloader``) on a GPU, a CPU pipeline on the CPU."""
    pytest.importorskip("nvidia.dali", reason="nvidia-dali is not installed (optional)")
    if device == "cuda":
        from dataset import get_dali_dataloader

        return get_dali_dataloader(folder, batch_size, rank=rank, world_size=world_size, seed=SEED,
                                   device=torch.device("cuda", 0))
    return DaliLoader(RecordBatches(MXFaceDataset(folder), batch_size, rank=rank, world_size=world_size, seed=SEED),
                      device_id=None)


def _close(images: torch.Tensor, ref_images: torch.Tensor) -> None:
    """DALI's decoder against libjpeg-turbo (torchvision), in pixel levels. A wrong image or flip differs by 2 levels
    on average at least (green 6 * i, the ramps)."""
    assert images.shape == ref_images.shape and images.dtype == torch.float32
    levels = (images.cpu() - ref_images).abs() * 127.5
    assert levels.numel() == 0 or (float(levels.mean()) < 1 and float(levels.max()) <= 8), (
        float(levels.mean()), float(levels.max()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2)])
def test_dali_loader_gives_the_pytorch_loaders_batches(tmp_path, monkeypatch, rank, world_size, device):
    """Shapes, dtypes, labels and (decoder rounding aside) images of FaceDataLoader's batches, held across
    iterations as gradient accumulation holds them; resumed at step k, batches k.. of the epoch, reading only
    their records; an epoch left early does not leak into the next."""
    n, batch_size, k = 40, 4, 2
    _write_rec(tmp_path, "insightface", n)
    data = MXFaceDataset(tmp_path)

    def dali():
        return _dali(tmp_path, batch_size, rank, world_size, device)

    def reference(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ref = get_dataloader(data, batch_size, rank=rank, world_size=world_size, seed=SEED, num_workers=0,
                             device="cpu")
        ref.set_epoch(epoch)
        return list(ref)

    def check(got, want):
        assert len(got) == len(want)
        for (images, labels), (ref_images, ref_labels) in zip(got, want):
            assert images.shape == (batch_size, 3, 112, 112) and images.device.type == device
            assert labels.shape == (batch_size,) and labels.dtype == torch.int64 and labels.device.type == device
            assert torch.equal(labels.cpu(), ref_labels)
            _close(images, ref_images)

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


# Epoch 1, one rank, batches of 4: clean, a JPEG cut inside its scan (which only DALI's decoder finds), clean, two
# records failing the checks, clean, every record bad, a 112x112 PNG (DALI decodes it).
DAMAGED = {1: ["scan"], 3: ["magic", "jpeg_size"], 5: ["label", "bytes", "png_size", "scan"], 6: ["png"]}


def _damaged_epoch(folder, n: int = 28, batch_size: int = 4, epoch: int = 1) -> dict[int, str]:
    """The rec of DAMAGED; the damage by dataset index."""
    sampler = FaceSampler(n, batch_size, 0, 1, SEED)
    sampler.set_epoch(epoch)
    plan = [indices for indices, _ in sampler.batches()]
    damage = {plan[k][j]: kind for k, kinds in DAMAGED.items() for j, kind in enumerate(kinds)}
    _damaged_rec(folder, n, damage)
    return damage


@pytest.mark.parametrize("device", DEVICES)
def test_dali_leaves_out_and_names_what_the_pytorch_loader_leaves_out(tmp_path, device):
    """Batch by batch, FaceDataLoader's samples and labels, its images (decoder rounding aside) and its lines in
    take_problems(): a record failing the checks, and a JPEG whose damage only decoding finds (DALI's error mapped
    back to its batch, read again on the host); DALI goes on after each, and a batch of which nothing reads is
    empty."""
    _damaged_epoch(tmp_path)
    loader = _dali(tmp_path, 4, 0, 1, device)
    ref = get_dataloader(MXFaceDataset(tmp_path), 4, rank=0, world_size=1, seed=SEED, num_workers=0, device="cpu")
    loader.set_epoch(1)
    ref.set_epoch(1)
    got = [(images, labels, loader.take_problems()) for images, labels in loader]
    want = [(images, labels, ref.take_problems()) for images, labels in ref]
    assert len(got) == len(want) == 7
    for k, ((images, labels, problems), (ref_images, ref_labels, ref_problems)) in enumerate(zip(got, want)):
        assert problems == ref_problems, (k, problems, ref_problems)
        assert len(problems) == len([kind for kind in DAMAGED.get(k, []) if kind != "png"]), (k, problems)
        assert images.device.type == labels.device.type == device
        assert torch.equal(labels.cpu(), ref_labels), k
        _close(images, ref_images)
    assert "cannot decode image" in got[1][2][0] and got[5][0].shape == (0, 3, 112, 112)


def _train_on_dali(tmp_path, skip: bool) -> list[str]:
    """train.train over the damaged epoch with the DALI loader (CPU pipeline): the warnings it logged."""
    import logging

    import train
    from trainer.build import build
    from utils.checkpoint import TrainState
    from utils.config import load_config

    cfg = load_config("configs/debug_cpu", [f"rec={tmp_path / 'rec'}", "num_classes=5", "num_image=28", "batch_size=4",
                                            "max_steps=7", f"skip_bad_images={skip}", "save_all_states=false",
                                            f"output={tmp_path / 'out'}"])
    logger = logging.getLogger(f"test.dali.{skip}")
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    job = build(cfg, 0, 1, torch.device("cpu"), logger)
    job.loader = DaliLoader(RecordBatches(MXFaceDataset(tmp_path / "rec"), 4, rank=0, world_size=1, seed=SEED),
                            device_id=None)
    job.output = tmp_path / "out"
    state = TrainState(epoch=1)
    train.train(job, state)
    return lines


def test_the_trainer_stops_on_or_skips_what_dali_cannot_read(tmp_path):
    """skip_bad_images with the DALI loader (CPU pipeline): the run trains to its end, listing every record left out
    (the scan-damaged JPEGs, which DALI's decoder refused, among them) and skipping the step whose batch kept none;
    without it the run stops at the first with the line naming it."""
    pytest.importorskip("nvidia.dali", reason="nvidia-dali is not installed (optional)")
    damage = _damaged_epoch(tmp_path / "rec")
    lines = _train_on_dali(tmp_path, skip=True)
    left_out = [line for line in lines if "skipped a sample that cannot be read (skip_bad_images)" in line]
    assert len(left_out) == 7, lines
    for key in [i + 1 for i, kind in damage.items() if kind == "scan"]:
        assert sum(f"train.rec (key {key}): cannot decode image" in line for line in left_out) == 1, (key, lines)
    assert any(line.startswith("step 5: a rank's batch kept fewer than 2 readable samples") for line in lines), lines
    assert (tmp_path / "out" / "model.pt").is_file()
    with pytest.raises(ValueError, match=r"train\.rec \(key \d+\): cannot decode image .*skip_bad_images = True"):
        _train_on_dali(tmp_path, skip=False)
