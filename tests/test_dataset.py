"""The dataset package: fixture reading, label checks, errors, sampler coverage/resumption, loader with workers,
the batch path (a worker decodes a whole batch per call) against the per-sample definition."""
from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from dataset import FaceSampler, ImageFolderDataset, MXFaceDataset, SyntheticDataset, build_dataset, get_dataloader
from dataset.images import decode, decode_many, normalise, stack_flipped
from dataset.recordio import IndexedRecordIO, IRHeader, RecordIOError, pack
from tests.helpers import FIXTURES

LAYOUTS = ["rec_insightface", "rec_insightface_vector_label", "rec_im2rec"]


def _jpeg(seed: int, size=(112, 112), fmt="JPEG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size[0], size[1], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, quality=90) if fmt == "JPEG" else Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fixture_through_dataset(layout):
    manifest = json.loads((FIXTURES / layout / "manifest.json").read_text())
    ds = MXFaceDataset(FIXTURES / layout)
    assert ds.layout == manifest["layout"]
    assert len(ds) == manifest["num_images"] and ds.num_classes == manifest["num_classes"]
    assert ds.keys.tolist() == [r["key"] for r in manifest["records"]]
    for i, entry in enumerate(manifest["records"]):
        payload, label, where = ds.raw(i)
        assert hashlib.sha256(payload).hexdigest() == entry["payload_sha256"] and label == entry["label"]
        img, lab = ds[i]
        assert img.dtype == torch.uint8 and img.shape == (3, 112, 112)
        assert lab.dtype == torch.int64 and int(lab) == entry["label"]


def test_num_classes_below_header_fails_at_open():
    with pytest.raises(ValueError, match=r"header record \(key 0\) says 6 classes .* num_classes=5"):
        MXFaceDataset(FIXTURES / "rec_insightface", num_classes=5)
    assert MXFaceDataset(FIXTURES / "rec_insightface", num_classes=8).num_classes == 8


def _im2rec(tmp_path, labels, images=None, prop=None):
    with IndexedRecordIO(tmp_path / "train.idx", tmp_path / "train.rec", "w") as w:
        for k, label in enumerate(labels):
            w.write_idx(k, pack(IRHeader(0, float(label), k, 0), images[k] if images else _jpeg(k)))
    if prop:
        (tmp_path / "property").write_text(prop)
    return tmp_path


def test_label_out_of_range_fails_when_read(tmp_path):
    ds = MXFaceDataset(_im2rec(tmp_path, [0, 1, 2], prop="2,112,112"))
    assert int(ds[1][1]) == 1
    with pytest.raises(ValueError, match=r"train.rec \(key 2\): label 2 is out of range for num_classes=2"):
        ds[2]


@pytest.mark.parametrize("content", [b"93431,112,1\xff2", b"\x80\x81", b"10,112"])
def test_a_property_file_that_is_not_three_numbers_names_the_file(tmp_path, content):
    """A corrupted byte (not text) or a wrong shape: one ValueError that starts with the property file's path."""
    root = _im2rec(tmp_path, [0, 1])
    (root / "property").write_bytes(content)
    with pytest.raises(ValueError) as err:
        MXFaceDataset(root)
    assert str(err.value).startswith(str(root / "property")), str(err.value)
    assert "num_classes,height,width" in str(err.value)


def test_undecodable_image_names_file_and_key(tmp_path):
    ds = MXFaceDataset(_im2rec(tmp_path, [0, 1], images=[_jpeg(0), b"\xff\xd8not a jpeg"]))
    with pytest.raises(ValueError, match=r"train.rec \(key 1\): cannot decode image"):
        ds[1]


def test_wrong_size_and_png(tmp_path):
    ds = MXFaceDataset(_im2rec(tmp_path, [0, 1], images=[_jpeg(0, fmt="PNG"), _jpeg(1, size=(64, 64))]))
    arr = np.array(Image.open(io.BytesIO(_jpeg(0, fmt="PNG"))))
    assert torch.equal(ds[0][0], torch.from_numpy(arr).permute(2, 0, 1))  # PNG is lossless
    with pytest.raises(ValueError, match=r"\(key 1\): image is 64x64 \(HxW\), expected 112x112"):
        ds[1]


def test_offsets_past_end_fail_at_open(tmp_path):
    _im2rec(tmp_path, [0, 1])
    with open(tmp_path / "train.idx", "a") as f:
        f.write("7\t123456789\n")
    with pytest.raises(RecordIOError, match=r"1 index offsets are past the end .*\(7, 123456789\)"):
        MXFaceDataset(tmp_path)


def test_build_dataset_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist; expected 'synthetic', a folder with "
                                                r"train.rec"):
        build_dataset(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is neither"):
        build_dataset(str(tmp_path / "empty"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "train.rec").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"half: missing train.idx"):
        build_dataset(str(tmp_path / "half"))
    (tmp_path / "half" / "train.idx").mkdir()  # a folder where the index should be: said so, not "missing"
    with pytest.raises(FileNotFoundError, match=r"half: train.idx is a folder, not a file; an MXNet RecordIO"):
        build_dataset(str(tmp_path / "half"))
    assert isinstance(build_dataset(str(FIXTURES / "rec_insightface")), MXFaceDataset)
    syn = build_dataset("synthetic", num_classes=3, image_size=(8, 8), seed=1)
    assert isinstance(syn, SyntheticDataset) and len(syn) == 30
    with pytest.raises(ValueError, match="needs num_classes"):
        build_dataset("synthetic")


def test_image_folder(tmp_path):
    for name, n in (("bob", 2), ("alice", 1)):
        (tmp_path / name).mkdir()
        for i in range(n):
            (tmp_path / name / f"{i}.jpg").write_bytes(_jpeg(i))
    (tmp_path / "alice" / "notes.txt").write_text("ignored")
    ds = build_dataset(str(tmp_path))
    assert isinstance(ds, ImageFolderDataset) and ds.classes == ["alice", "bob"] and ds.num_classes == 2
    assert [int(ds[i][1]) for i in range(len(ds))] == [0, 1, 1]


def test_synthetic_is_deterministic():
    a, b = SyntheticDataset(5, 20, (8, 8), seed=3), SyntheticDataset(5, 20, (8, 8), seed=3)
    assert torch.equal(a[7][0], b[7][0]) and int(a[7][1]) == 2
    assert not torch.equal(a[7][0], SyntheticDataset(5, 20, (8, 8), seed=4)[7][0])


def _epoch(n, bs, ws, seed, epoch, start_step=0):
    out = []
    for r in range(ws):
        s = FaceSampler(n, bs, r, ws, seed)
        s.set_epoch(epoch, start_step)
        out.append(list(s))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sampler_covers_each_index_once_and_equal_batches(world_size):
    n, bs = 47, 4
    per_rank = _epoch(n, bs, world_size, seed=5, epoch=2)
    assert len({len(p) for p in per_rank}) == 1  # every rank the same number of samples (whole batches)
    assert len(per_rank[0]) == (n // world_size) // bs * bs
    seen = [i for p in per_rank for i, _ in p]
    assert len(seen) == len(set(seen))  # no index twice within an epoch
    # Without drop_last every index is seen (padding wraps around) and the ranks stay equal.
    full = []
    for r in range(world_size):
        s = FaceSampler(n, bs, r, world_size, 5, drop_last=False)
        s.set_epoch(2)
        full.append([i for i, _ in s])
    assert len({len(p) for p in full}) == 1 and set(i for p in full for i in p) == set(range(n))
    # Flips are a function of (seed, epoch, index): the same whatever the world size.
    flips = {i: f for p in per_rank for i, f in p}
    ref = dict(_epoch(n, 1, 1, seed=5, epoch=2)[0])
    assert all(ref[i] == f for i, f in flips.items())


def test_sampler_reshuffles_per_epoch_and_resumes_exactly():
    a, b = _epoch(40, 4, 2, 0, 0), _epoch(40, 4, 2, 0, 1)
    assert a != b and a == _epoch(40, 4, 2, 0, 0)
    resumed = _epoch(40, 4, 2, 0, 1, start_step=3)
    assert all(r == full[3 * 4:] for r, full in zip(resumed, b))
    with pytest.raises(ValueError, match=r"start_step 6 outside \[0, 5\]"):
        FaceSampler(40, 4, 0, 2, 0).set_epoch(0, 6)
    with pytest.raises(ValueError, match="no full batch"):
        FaceSampler(5, 4, 0, 2, 0)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_loader_workers_resume_and_flips(tmp_path):
    """2 forked workers give the same normalised batches as none, resumed mid-epoch too."""
    ds = MXFaceDataset(FIXTURES / "rec_insightface")
    kw = dict(rank=1, world_size=2, seed=7, device="cpu")
    plain = get_dataloader(ds, 4, num_workers=0, **kw)
    workers = get_dataloader(ds, 4, num_workers=2, **kw)
    assert len(plain) == 3  # 30 // 2 // 4
    plain.set_epoch(1)
    ref = list(plain)
    workers.set_epoch(1, start_step=1)
    got = list(workers)
    assert len(ref) == 3 and len(got) == 2
    for (x0, y0), (x1, y1) in zip(ref[1:], got):
        assert x1.dtype == torch.float32 and x1.shape == (4, 3, 112, 112)
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    # The batch equals the dataset's images, normalised and flipped where the sampler said so.
    sampler = plain.sampler
    indices, flips = sampler.epoch_plan()
    for j in range(4):
        img = ds[int(indices[4 + j])][0]
        img = img.flip(-1) if flips[4 + j] else img
        assert torch.equal(ref[1][0][j], (img.float() - 127.5) * (1 / 127.5))
    assert int(flips.sum()) not in (0, len(flips))  # some flipped, some not


def test_dali_requested_without_dali_is_one_clear_error(tmp_path):
    """dali = True on a machine without nvidia.dali (or without CUDA) must say what is missing."""
    import importlib.util

    from dataset import get_dali_dataloader

    if importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None:
        pytest.skip("nvidia.dali is installed here")
    with pytest.raises(ValueError, match=r"nvidia\.dali is not installed"):
        get_dali_dataloader(tmp_path, 8, rank=0, world_size=1, seed=0, device="cpu")


def test_every_public_name_of_the_former_module_is_kept():
    """``dataset`` was one module; what users and train.py import from it still imports."""
    import dataset

    for name in ("MXFaceDataset", "ImageFolderDataset", "SyntheticDataset", "build_dataset", "FaceSampler",
                 "FaceDataLoader", "get_dataloader", "DaliLoader", "get_dali_dataloader", "decode", "normalise",
                 "detect_layout", "class_of", "IMAGE_EXTENSIONS", "Transform"):
        assert name in dataset.__all__ and getattr(dataset, name) is not None, name
    assert dataset.MXFaceDataset is dataset.faces.MXFaceDataset and dataset.normalise is dataset.images.normalise


def test_the_one_normalisation():
    from dataset.images import NORMALISATION, normalise
    from eval.model_card import model_card

    WRITTEN_BY_THE_TRAINER = model_card('tiny', {}, 16)['normalisation']

    images = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8).view(1, 1, 2, 3).expand(2, 3, 2, 3)
    out = normalise(images)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 2, 3) and images.dtype == torch.uint8
    assert torch.equal(out, (images.float() - 127.5) * (1 / 127.5)) and out.min() == -1 and out.max() == 1
    # Every pixel value as a multiplication by the fp32 reciprocal, the arithmetic CUDA uses for a division by a
    # scalar (a division differs in the last bit for 126 of the 256 values): the same batches on every device.
    every = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)
    assert torch.equal(normalise(every), (every.float() - 127.5) * torch.tensor(1 / 127.5, dtype=torch.float32))
    # Any strides in (a channels-last batch, a decoder's HWC view), contiguous NCHW out: the backbone's
    # memory format is the trainer's choice (channels_last), never an accident of the decoder.
    channels_last = torch.arange(2 * 4 * 5 * 3, dtype=torch.uint8).view(2, 4, 5, 3).permute(0, 3, 1, 2)
    out = normalise(channels_last)
    assert out.is_contiguous() and torch.equal(out, (channels_last.float() - 127.5) * (1 / 127.5))
    with pytest.raises(ValueError, match="normalise expects uint8 images"):
        normalise(out)  # already normalised: refused, not shifted twice
    assert NORMALISATION == WRITTEN_BY_THE_TRAINER  # what model.json promises is what the tools feed


def test_decode_many_is_decode_of_each(tmp_path):
    """One decoder call for a batch's JPEGs gives decode()'s images, PNGs included, and its errors."""
    data = [_jpeg(0), _jpeg(1, fmt="PNG"), _jpeg(2), _jpeg(3)]
    where = [f"img{i}" for i in range(4)]
    got = decode_many(data, where, (112, 112))
    assert len(got) == 4 and all(torch.equal(g, decode(d, w)) for g, d, w in zip(got, data, where))
    bad = data[:2] + [b"\xff\xd8not a jpeg"] + data[3:]
    with pytest.raises(ValueError, match=r"img2: cannot decode image \(12 bytes"):
        decode_many(bad, where)
    with pytest.raises(ValueError, match=r"img3: image is 64x64 \(HxW\), expected 112x112"):
        decode_many(data[:3] + [_jpeg(3, size=(64, 64))], where, (112, 112))
    with pytest.raises(ValueError, match=r"^img0: cannot decode image \(0 bytes"):
        decode_many([b""], where[:1])
    with pytest.raises(ValueError, match="2 images but 1 names"):
        decode_many(data[:2], where[:1])


def test_stack_flipped():
    images = [torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
              for i in range(3)]
    flips = [True, False, True]
    batch = stack_flipped(images, flips)
    assert batch.shape == (3, 3, 4, 5) and batch.dtype == torch.uint8
    assert batch.permute(0, 2, 3, 1).is_contiguous()  # channels-last storage: one memcpy per decoded image
    assert torch.equal(batch, torch.stack([im.flip(-1) if f else im for im, f in zip(images, flips)]))
    with pytest.raises(ValueError, match=r"image 1 is \(3, 4, 4\), image 0 is \(3, 4, 5\)"):
        stack_flipped([images[0], images[1][..., :4]], [False, False])
    with pytest.raises(ValueError, match="2 images and 1 flips"):
        stack_flipped(images[:2], [True])


def _per_sample_batch(ds, items):
    """The loader's definition: sample i is ds[i], mirrored where the sampler says, stacked in order."""
    images = [ds[i][0].flip(-1) if f else ds[i][0] for i, f in items]
    return torch.stack(images), torch.stack([ds[i][1] for i, _ in items])


def test_read_batch_is_the_per_sample_batch(tmp_path):
    """MXFaceDataset / ImageFolderDataset read a batch in one call: bit-identical to sample by sample."""
    for name, n in (("a", 3), ("b", 2)):
        (tmp_path / name).mkdir()
        for i in range(n):
            (tmp_path / name / f"{i}.{'png' if i == 1 else 'jpg'}").write_bytes(
                _jpeg(10 * len(name) + i, fmt="PNG" if i == 1 else "JPEG"))
    datasets = [MXFaceDataset(FIXTURES / "rec_insightface"), ImageFolderDataset(tmp_path),
                MXFaceDataset(FIXTURES / "rec_im2rec", transform=lambda im: im[:, 8:-8, 8:-8])]
    for ds in datasets:
        items = [(4, True), (0, False), (1, True), (4, False), (2, False)]
        images, labels = ds.read_batch([i for i, _ in items], [f for _, f in items])
        ref_images, ref_labels = _per_sample_batch(ds, items)
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)
    assert images.shape == (5, 3, 96, 96)  # the transform's crop


def test_read_batch_names_the_bad_record(tmp_path):
    ds = MXFaceDataset(_im2rec(tmp_path, [0, 1, 0], images=[_jpeg(0), _jpeg(1), b"\xff\xd8not a jpeg"]))
    with pytest.raises(ValueError, match=r"train.rec \(key 2\): cannot decode image"):
        ds.read_batch([0, 2, 1], [False, True, False])


@pytest.mark.process
@pytest.mark.timeout(60)
def test_the_loader_leaves_out_a_bad_image_and_names_it(tmp_path):
    """A record that does not decode is left out of its batch, the others keep their order, and take_problems()
    names it once (with workers too); the trainer then stops the run, or skips it with skip_bad_images."""
    images = [_jpeg(i) for i in range(8)]
    images[5] = b"\xff\xd8not a jpeg"
    ds = MXFaceDataset(_im2rec(tmp_path, [i % 4 for i in range(8)], images=images))
    for workers in (0, 2):
        loader = get_dataloader(ds, 4, rank=0, world_size=1, seed=0, num_workers=workers, device="cpu")
        loader.set_epoch(0)
        seen, problems = [], []
        for _batch, labels in loader:
            seen.append(len(labels))
            problems += loader.take_problems()
        assert sorted(seen) == [3, 4] and sum(seen) == 7, seen
        assert len(problems) == 1 and "train.rec (key 5): cannot decode image" in problems[0], problems
        assert loader.take_problems() == []


def test_sampler_batches_cut_the_samples_in_order():
    for drop_last, last in ((True, 5), (False, 1)):  # 47 on 3 ranks: 15 or 16 samples per rank, batches of 5
        s = FaceSampler(47, 5, 1, 3, seed=2, drop_last=drop_last)
        s.set_epoch(3, start_step=1)
        samples, batches = list(s), list(s.batches())
        assert len(batches) == s.num_batches - 1 == -(-len(samples) // 5)
        assert [(i, f) for b in batches for i, f in zip(*b)] == samples
        assert [len(b[0]) for b in batches] == [5] * (len(batches) - 1) + [last]


@pytest.mark.process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", ["rec", "synthetic"])
def test_loader_batches_are_the_per_sample_batches(source):
    """Whole batches per worker call (read_batch, or sample by sample for other datasets) give exactly the
    normalised per-sample batches, contiguous, with workers, resumed mid-epoch, short last batch included."""
    ds = MXFaceDataset(FIXTURES / "rec_insightface") if source == "rec" else SyntheticDataset(3, 21, (8, 8), seed=1)
    kw = dict(rank=1, world_size=2, seed=4, device="cpu", drop_last=False)
    for workers in (0, 2):
        loader = get_dataloader(ds, 4, num_workers=workers, **kw)
        loader.set_epoch(2, start_step=1)
        got = list(loader)
        plan = list(loader.sampler)  # (index, flip) per sample from batch 1 on
        assert len(got) == len(loader) - 1 == -(-len(plan) // 4)
        for k, (x, y) in enumerate(got):
            ref_x, ref_y = _per_sample_batch(ds, plan[4 * k:4 * k + 4])
            assert x.is_contiguous() and x.dtype == torch.float32
            assert torch.equal(x, normalise(ref_x)) and torch.equal(y, ref_y)
        assert got[-1][0].shape[0] == len(plan) - 4 * (len(got) - 1)
