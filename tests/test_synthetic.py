"""Synthetic identities: determinism, image format, nuisance variation, disjoint splits, real-format output."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from dataset import MXFaceDataset
from dataset import synthetic_faces as S
from scripts import make_synthetic


def _decode(jpeg: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))


def test_identity_params_are_deterministic_and_independent_of_the_count():
    assert S.identity_params(0, 7) == S.identity_params(0, 7)
    assert S.identity_params(0, 7) != S.identity_params(1, 7)
    assert S.identity_params(0, 7) != S.identity_params(0, 8)
    # Identity 3's images do not depend on which identities were rendered before it (or how many).
    alone = S.train_identity_images(0, 3, 2)
    for other in (0, 1, 2, 4):
        S.train_identity_images(0, other, 2)
    assert S.train_identity_images(0, 3, 2) == alone
    with pytest.raises(ValueError, match="identity must be >= 0, got -1"):
        S.identity_params(0, -1)


def test_same_seed_gives_identical_bytes_and_another_seed_does_not():
    a = S.train_identity_images(5, 2, 3)
    assert a == S.train_identity_images(5, 2, 3)
    assert a != S.train_identity_images(6, 2, 3)
    assert len(set(a)) == 3  # every image of an identity is a different draw


def test_images_are_112_rgb_uint8_and_vary_with_nuisance():
    p = S.identity_params(0, 1)
    arrays = [S.render_sample(0, "train", p, 1, i)[0] for i in range(6)]
    for img in arrays:
        assert img.shape == (112, 112, 3) and img.dtype == np.uint8
    decoded = _decode(S.train_identity_images(0, 1, 1)[0])
    assert decoded.shape == (112, 112, 3) and decoded.dtype == np.uint8
    diffs = [np.abs(arrays[0].astype(int) - a.astype(int)).mean() for a in arrays[1:]]
    assert min(diffs) > 5.0, diffs
    # Pixels vary too within an image (a face, not a flat colour).
    assert arrays[0].std() > 10.0


def test_nuisance_strength_orders_easy_hard_train():
    """syn_hard's nuisances are at least syn_easy's, and training covers both (field by field)."""
    import dataclasses

    def bounds(split):
        cfg = S.NUISANCE[split]
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "jpeg_quality"}

    easy, hard, train = bounds("easy"), bounds("hard"), bounds("train")
    assert all(hard[k] >= easy[k] for k in easy), (easy, hard)
    assert any(hard[k] > easy[k] for k in easy)
    assert all(train[k] >= hard[k] for k in hard), (hard, train)
    # Lower JPEG quality is the stronger nuisance.
    quality = {split: S.NUISANCE[split].jpeg_quality[0] for split in ("train", "hard", "easy")}
    assert quality["train"] <= quality["hard"] <= quality["easy"]


@pytest.mark.parametrize("kind", ["easy", "hard"])
def test_pairs_are_half_same_and_disjoint_from_training_ids(kind):
    specs = S.pair_specs(0, kind, 40)
    assert [s.issame for s in specs] == [i % 2 == 0 for i in range(40)]
    for s in specs:
        assert s.a >= S.EVAL_ID_BASE[kind] and s.b >= S.EVAL_ID_BASE[kind]
        assert (s.a == s.b) == s.issame
    with pytest.raises(ValueError, match="kind must be one of"):
        S.pair_specs(0, "medium", 40)


def test_write_dataset_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError, match="images_per_class must be >= 1, got 0"):
        S.write_dataset(tmp_path, num_classes=2, images_per_class=0)
    with pytest.raises(ValueError, match="num_classes must be < 10000000"):
        S.write_dataset(tmp_path, num_classes=10_000_000)


@pytest.mark.timeout(120)
def test_script_writes_real_formats_that_our_readers_read_back(tmp_path):
    from dataset import recordio, verification_set

    out, preview = tmp_path / "syn", tmp_path / "preview.png"
    args = ["--out", str(out), "--num-classes", "4", "--images-per-class", "3", "--pairs", "8", "--workers", "1"]
    assert make_synthetic.main(args + ["--preview", str(preview)]) == 0

    assert (out / "property").read_text().strip() == "4,112,112"
    with recordio.IndexedRecordIO(out / "train.idx", out / "train.rec", "r") as rec:
        header, _ = recordio.unpack(rec.read_idx(0))
        assert [int(x) for x in np.atleast_1d(header.label)] == [13, 17]  # 12 images, then 4 identity records
        labels = []
        for key in range(1, 13):
            h, jpeg = recordio.unpack(rec.read_idx(key))
            labels.append(int(np.atleast_1d(h.label)[0]))
            assert _decode(jpeg).shape == (112, 112, 3)
        assert labels == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        # Training images are exactly what the generator renders for those identities.
        assert recordio.unpack(rec.read_idx(4))[1] == S.train_identity_images(0, 1, 3)[0]

    for target in ("syn_easy", "syn_hard"):
        images, issame = verification_set.load_bin(out / f"{target}.bin")
        assert tuple(images.shape) == (16, 3, 112, 112) and issame == [i % 2 == 0 for i in range(8)]
    stamp = json.loads((out / S.STAMP_NAME).read_text())
    assert stamp["train_ids"][1] <= min(v[0] for v in stamp["eval_ids"].values())

    png = Image.open(preview)
    assert png.format == "PNG" and png.size == (8 * 112, 6 * 112)

    ds = MXFaceDataset(str(out))
    assert len(ds) == 12
    img, label = ds[4]
    assert tuple(img.shape) == (3, 112, 112) and int(label) == 1


@pytest.mark.process
@pytest.mark.timeout(120)
def test_cache_skips_a_complete_dataset_and_rebuilds_on_other_parameters(tmp_path):
    kw = dict(num_classes=2, images_per_class=2, pairs=4, seed=0)
    assert S.write_dataset(tmp_path, **kw) is True
    rec = (tmp_path / "train.rec").read_bytes()
    assert S.write_dataset(tmp_path, **kw) is False
    # Two worker processes give the same bytes as one.
    assert S.write_dataset(tmp_path, **{**kw, "seed": 1}, workers=2) is True
    assert (tmp_path / "train.rec").read_bytes() != rec
    other = tmp_path / "other"
    assert S.write_dataset(other, **{**kw, "seed": 1}, workers=1) is True
    for name in ("train.rec", "train.idx", "syn_easy.bin", "syn_hard.bin"):
        assert (other / name).read_bytes() == (tmp_path / name).read_bytes(), name
    # An interrupted build (stamp missing) is not taken for a complete one.
    (other / S.STAMP_NAME).unlink()
    assert S.write_dataset(other, **{**kw, "seed": 1}) is True


@pytest.mark.timeout(120)
def test_a_build_that_fails_leaves_no_half_dataset(tmp_path, monkeypatch):
    """The files are staged (utils.files.staged) and the stamp moves in last: a build that fails after the rec
    leaves no new folder, and in an existing one the old files without their stamp (rebuilt next time)."""
    kw = dict(num_classes=2, images_per_class=2, pairs=4, seed=0)
    assert S.write_dataset(tmp_path / "old", **kw) is True
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(S, "save_bin", broken)
    for out in (tmp_path / "new", tmp_path / "old"):
        with pytest.raises(OSError, match="disk full"):
            S.write_dataset(out, **{**kw, "seed": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    after = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}
    assert after == {k: v for k, v in before.items() if k != S.STAMP_NAME}
    assert not S.is_complete(tmp_path / "old", S.dataset_stamp(**kw))
