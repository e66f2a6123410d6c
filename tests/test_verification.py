"""eval.verification: reading `.bin` files safely (dataset.verification_set, re-exported), the published k-fold
protocol, test(), the callback."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torchvision.io import encode_jpeg

from eval import verification as V
from tests.helpers import FIXTURES, ROOT, subprocess_env

TINY_BIN = FIXTURES / "bins" / "tiny.bin"


def _jpegs(n: int, seed: int = 0, size: int = 112) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return [encode_jpeg(torch.randint(0, 256, (3, size, size), generator=g, dtype=torch.uint8), quality=90)
            .numpy().tobytes() for _ in range(n)]


# --- load_bin / save_bin -------------------------------------------------------------------------------

def test_tiny_bin_matches_its_manifest():
    manifest = json.loads((TINY_BIN.parent / "tiny.bin.json").read_text())
    data = V.load_bin(TINY_BIN)
    images, issame = data
    assert isinstance(data, V.BinData) and data.images is images and data.issame is issame
    assert issame == manifest["issame"] and len(issame) == manifest["pairs"]
    assert images.dtype == torch.uint8 and images.shape == (2 * manifest["pairs"], 3, 112, 112)
    raw, _ = V.unpickle_bin(TINY_BIN)
    assert [hashlib.sha256(bytes(b)).hexdigest() for b in raw] == manifest["sha256"]


def test_the_bin_reader_lives_with_the_data_and_eval_verification_still_exports_it():
    from dataset import verification_set

    for name in ("BinData", "BadBinError", "RefusedGlobal", "load_bin", "save_bin", "unpickle_bin"):
        assert getattr(V, name) is getattr(verification_set, name) and name in V.__all__, name


def test_save_bin_round_trip_and_resize(tmp_path):
    jpegs = _jpegs(4, size=96)
    V.save_bin(tmp_path / "x.bin", jpegs, [True, False])
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]  # no temporary left behind
    images, issame = V.load_bin(tmp_path / "x.bin", image_size=(112, 112))
    assert issame == [True, False] and images.shape == (4, 3, 112, 112)
    with pytest.raises(ValueError, match=r"3 images for 2 pairs"):
        V.save_bin(tmp_path / "y.bin", jpegs[:3], [True, False])


def _str(b: bytes) -> bytes:
    """A Python-2 ``str`` as Python 2's pickler wrote it at protocol 2."""
    return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b


def _py2_uint8_array(payload: bytes) -> bytes:
    """A numpy uint8 array as numpy under Python 2 pickled it (protocol 2, strings as BINSTRING)."""
    dtype = (b"cnumpy\ndtype\n" + _str(b"u1") + b"K\x00K\x01\x87R"
             + b"(K\x03" + _str(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
    return (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + _str(b"b") + b"\x87R"
            + b"(K\x01" + struct.pack("<BI", ord("J"), len(payload)) + b"\x85" + dtype + b"\x89"
            + _str(payload) + b"tb")


def test_python2_pickle_with_binstrings_and_numpy_arrays_loads(tmp_path):
    jpegs = _jpegs(4, seed=1)
    items = [_str(jpegs[0]), _py2_uint8_array(jpegs[1]), _str(jpegs[2]), _py2_uint8_array(jpegs[3])]
    data = b"\x80\x02(]q\x00(" + b"".join(items) + b"e]q\x01(\x88\x89et."
    path = tmp_path / "py2.bin"
    path.write_bytes(data)
    images, issame = V.load_bin(path)
    assert issame == [True, False]
    V.save_bin(tmp_path / "py3.bin", jpegs, [True, False])
    expected, _ = V.load_bin(tmp_path / "py3.bin")
    assert torch.equal(images, expected)


class _RunsCommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_that_would_run_a_command_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(([_RunsCommand(marker), b"x"], [True]), protocol=2))
    with pytest.raises(V.RefusedGlobal, match=r"evil\.bin: refused global (posix|nt)\.system"):
        V.load_bin(path)
    assert not marker.exists()


def test_codecs_encode_only_as_latin1(tmp_path):
    path = tmp_path / "codec.bin"
    # _codecs.encode("x", "rot13"): allowed global, but only as bytes' latin-1 spelling.
    path.write_bytes(b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x05\x00\x00\x00rot13\x86R.")
    with pytest.raises(pickle.UnpicklingError, match=r"rot13"):
        V.load_bin(path)


def test_malformed_files_name_the_problem(tmp_path):
    path = tmp_path / "bad.bin"
    path.write_bytes(pickle.dumps(([b"abc", b"def"], [True])))
    with pytest.raises(V.BadBinError, match=r"bad\.bin: image 0 cannot be decoded"):
        V.load_bin(path)
    path.write_bytes(pickle.dumps(([b"abc"], [True])))
    with pytest.raises(V.BadBinError, match=r"bad\.bin: 1 images for 1 pairs"):
        V.load_bin(path)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        V.load_bin(tmp_path / "missing.bin")


def test_truncated_file_says_so_wherever_it_is_cut(tmp_path):
    V.save_bin(tmp_path / "whole.bin", _jpegs(4), [True, False])
    data = (tmp_path / "whole.bin").read_bytes()
    # Every cut: inside the header, a length field, an image, the issame list, just before STOP.
    for cut in sorted({0, 1, 2, 5, 11, 20, 40, len(data) // 3, len(data) // 2, len(data) - 12, len(data) - 2,
                       len(data) - 1}):
        path = tmp_path / "x.bin"
        path.write_bytes(data[:cut])
        with pytest.raises(V.BadBinError, match=r"^\S*x\.bin: truncated pickle"):
            V.load_bin(path)


@pytest.mark.parametrize("content", [
    pytest.param(lambda: _jpegs(1)[0], id="a JPEG"),
    pytest.param(lambda: b"lfw pairs\n1 2 3\n", id="text"),
    pytest.param(lambda: pickle.dumps({"bins": [], "issame": []}), id="a pickled dict"),
    pytest.param(lambda: pickle.dumps(([b"x", b"y"], [True], 3)), id="a 3-tuple"),
    pytest.param(lambda: pickle.dumps((b"xy", [True])), id="bytes instead of a list"),
    pytest.param(lambda: pickle.dumps(([1, 2], [True])), id="ints instead of images"),
])
def test_other_files_are_not_verification_files(tmp_path, content):
    path = tmp_path / "x.bin"
    path.write_bytes(content())
    with pytest.raises(V.BadBinError, match=r"^\S*x\.bin: not a verification file"):
        V.load_bin(path)


def test_a_torch_checkpoint_is_not_a_verification_file(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "x.bin")  # a zip archive: 'P' reads as a pickle opcode
    with pytest.raises(V.BadBinError, match=r"^\S*x\.bin: not a verification file"):
        V.load_bin(tmp_path / "x.bin")


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_save_bin_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        V.save_bin(tmp_path / "x.bin", _jpegs(2), [True])
        (tmp_path / "plain").write_bytes(b"")  # what any other new file gets
    finally:
        os.umask(old)
    assert (tmp_path / "x.bin").stat().st_mode & 0o777 == 0o666 & ~umask == (tmp_path / "plain").stat().st_mode & 0o777
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "x.bin"]


# --- evaluate against a brute-force reference ----------------------------------------------------------

def _brute_force(embeddings: np.ndarray, issame: list[bool], k: int = 10) -> tuple[list, float, float]:
    """The published protocol written out with loops: fold bounds, per-pair distances, per-threshold counts."""
    n = len(issame)
    sizes = [n // k + (1 if f < n % k else 0) for f in range(k)]
    bounds = np.cumsum([0] + sizes)
    dist = []
    for i in range(n):
        a, b = embeddings[2 * i], embeddings[2 * i + 1]
        a = a / np.sqrt(sum(x * x for x in a))
        b = b / np.sqrt(sum(x * x for x in b))
        dist.append(sum((x - y) ** 2 for x, y in zip(a, b)))

    def counts(t, idx):
        tp = sum(1 for i in idx if dist[i] < t and issame[i])
        fp = sum(1 for i in idx if dist[i] < t and not issame[i])
        pos = sum(1 for i in idx if issame[i])
        return tp, fp, pos, len(idx) - pos

    accuracies, vals, fars = [], [], []
    for f in range(k):
        test_idx = list(range(bounds[f], bounds[f + 1]))
        train_idx = [i for i in range(n) if not bounds[f] <= i < bounds[f + 1]]
        best_acc, best_t = -1.0, None
        for t in np.arange(0, 4, 0.01):
            tp, fp, pos, neg = counts(t, train_idx)
            acc = (tp + neg - fp) / len(train_idx)
            if acc > best_acc:
                best_acc, best_t = acc, t
        tp, fp, pos, neg = counts(best_t, test_idx)
        accuracies.append((tp + neg - fp) / len(test_idx))
        grid = np.arange(0, 4, 0.001)
        far_train = []
        for t in grid:
            tp, fp, pos, neg = counts(t, train_idx)
            far_train.append(fp / neg)
        if max(far_train) >= 1e-3:
            j = max(i for i in range(len(grid)) if far_train[i] <= 1e-3)  # last knot at or below the target
            slope = (grid[j + 1] - grid[j]) / (far_train[j + 1] - far_train[j])
            threshold = slope * (1e-3 - far_train[j]) + grid[j]
        else:
            threshold = 0.0
        tp, fp, pos, neg = counts(threshold, test_idx)
        vals.append(tp / pos)
        fars.append(fp / neg)
    return accuracies, float(np.mean(vals)), float(np.mean(fars))


@pytest.mark.parametrize("seed", [0, 1])
def test_evaluate_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    pairs = 73  # folds of 8 and 7 pairs: the uneven split has to match too
    issame = list(rng.random(pairs) < 0.5)
    emb = rng.normal(size=(2 * pairs, 6))
    for i, same in enumerate(issame):
        if same:
            emb[2 * i + 1] = emb[2 * i] + 0.6 * rng.normal(size=6)
    tpr, fpr, accuracy, val, val_std, far = V.evaluate(emb, issame)
    ref_acc, ref_val, ref_far = _brute_force(emb, issame)
    assert list(accuracy) == ref_acc
    assert (val, far) == (ref_val, ref_far)
    assert 0.5 < np.mean(accuracy) < 1.0  # the data is neither trivial nor random
    assert tpr.shape == fpr.shape == (400,)


def test_evaluate_with_pca_and_bad_shapes():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(40, 8))
    _, _, accuracy, *_ = V.evaluate(emb, [True, False] * 10, nrof_folds=5, pca=3)
    assert accuracy.shape == (5,) and np.all((0 <= accuracy) & (accuracy <= 1))
    with pytest.raises(ValueError, match=r"shape \(40, 8\) for 21 pairs"):
        V.evaluate(emb, [True] * 21)
    with pytest.raises(ValueError, match=r"nrof_folds=10 for 8 pairs"):
        V.evaluate(emb[:16], [True] * 8)


# --- test() --------------------------------------------------------------------------------------------

class _Recorder(nn.Module):
    """Embeds by average pooling; records what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * 4 * 4, 5)
        self.inputs: list[tuple[torch.dtype, float, float, int, bool]] = []
        self.output_dtypes: list[torch.dtype] = []  # bfloat16 under bf16 autocast (a Linear's output)

    def forward(self, x):
        self.inputs.append((x.dtype, float(x.min()), float(x.max()), x.shape[0], torch.is_grad_enabled()))
        out = self.proj(nn.functional.adaptive_avg_pool2d(x, 4).flatten(1))
        self.output_dtypes.append(out.dtype)
        return out


@pytest.mark.parametrize("training", [True, False])
def test_test_restores_mode_and_feeds_normalised_batches(training):
    data = V.load_bin(TINY_BIN)
    net = _Recorder().train(training)
    result = V.test(data, net, batch_size=6, nfolds=2)
    assert net.training is training
    assert [b for *_, b, _ in net.inputs] == [6, 6, 4, 6, 6, 4]  # batch by batch, both copies
    assert all(dtype == torch.float32 and -1 <= lo and hi <= 1 and not grad
               for dtype, lo, hi, _, grad in net.inputs)
    assert result["pairs"] == 8
    for key in ("acc", "acc_std", "acc_noflip", "val", "val_std", "far", "xnorm", "threshold"):
        assert isinstance(result[key], float), key
    # flip: the sum of both copies' embeddings; no-flip: the original only
    orig = V.embed(data.images, net, 4, flip=False)
    _, _, acc_noflip, *_ = V.evaluate(orig, data[1], nrof_folds=2)
    assert result["acc_noflip"] == float(acc_noflip.mean())


def _stored_flip_reference(images: torch.Tensor, issame: list[bool], net: nn.Module, batch_size: int,
                           nfolds: int) -> dict:
    """test()'s numbers computed the way they were before the flip became lazy: a whole mirrored copy of
    the set, each copy embedded batch by batch, the flip embedding the sum of both."""
    mirrored = torch.flip(images, dims=[3]).contiguous()  # (2P, 3, H, W)
    outs = []
    with torch.no_grad():
        for copy in (images, mirrored):
            feats = [net((copy[s:s + batch_size].float() - 127.5) * (1 / 127.5)).numpy()
                     for s in range(0, copy.shape[0], batch_size)]
            outs.append(np.concatenate(feats).astype(np.float64))  # (2P, D)
    original, flipped = outs
    tpr, fpr, accuracy, thresholds = V.calculate_roc(original + flipped, issame, nrof_folds=nfolds)
    val, val_std, far = V.calculate_val(original + flipped, issame, 1e-3, nrof_folds=nfolds)
    _, _, acc_noflip, *_ = V.evaluate(original, issame, nrof_folds=nfolds)
    return {"acc": float(accuracy.mean()), "acc_std": float(accuracy.std()), "acc_noflip": float(acc_noflip.mean()),
            "val": val, "val_std": val_std, "far": far, "threshold": float(thresholds.mean()), "fpr": fpr, "tpr": tpr,
            "xnorm": float(np.mean(np.linalg.norm(np.concatenate([original, flipped]), axis=1)))}


@pytest.mark.parametrize("batch_size", [3, 16])
def test_lazy_flip_gives_the_numbers_of_a_stored_mirrored_copy(batch_size):
    data = V.load_bin(TINY_BIN)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 5, stride=4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(6))
    net(torch.zeros(1, 3, 112, 112))  # materialise the lazy layer
    net.eval()
    expected = _stored_flip_reference(data.images, data.issame, net, batch_size, nfolds=2)
    result = V.test(data, net, batch_size, nfolds=2)
    for key, value in expected.items():
        assert np.array_equal(result[key], value), key  # exactly: the same pixels reach the network
    # The mirrored pixels really are mirrored: the network is not symmetric, so the copies differ; embed's flip
    # embedding is test()'s, the sum of the crop's and the mirror image's.
    original = V.embed(data.images, net, batch_size, flip=False)
    mirrored = V.embed(data.images.flip(3), net, batch_size, flip=False)
    assert not np.array_equal(original, mirrored)
    assert np.array_equal(V.embed(data.images, net, batch_size, flip=True), original + mirrored)


def test_embed_restores_the_mode_runs_without_grad_and_counts_both_copies():
    data = V.load_bin(TINY_BIN)
    net = _Recorder().train(True)
    counted = []
    flip = V.embed(data.images, net, 6, flip=True, progress=counted.append)
    assert net.training and not any(grad for *_, grad in net.inputs)
    assert sum(counted) == 2 * len(data.images) and flip.shape == (len(data.images), 5) and flip.dtype == np.float64
    assert V.embed(data.images, net, 6, flip=False).shape == flip.shape and net.training
    with pytest.raises(ValueError, match="0 rows"):
        V.embed(data.images[:0], net, 6, flip=True)


def test_test_refuses_the_old_two_copy_layout():
    data = V.load_bin(TINY_BIN)
    with pytest.raises(ValueError, match=r"BinData\(images, issame\)"):
        V.test(([data.images, data.images.flip(3)], data.issame), _Recorder(), 4, nfolds=2)


# --- CallbackVerification ------------------------------------------------------------------------------

class _Writer:
    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (value, step)


class _Wrapper(nn.Module):
    """Holds the backbone as ``.module`` like DDP; calling it would be an error (DDP's forward runs
    collectives, which rank 0 alone must not start)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x):
        raise AssertionError("the callback must evaluate .module, not the wrapper")


def test_callback_single_process_logs_and_tracks_best(caplog):
    pytest.importorskip("utils.distributed")
    from eval.callback import CallbackVerification

    writer = _Writer()
    callback = CallbackVerification(["tiny"], TINY_BIN.parent, summary_writer=writer, batch_size=8, nfolds=2)
    net = _Wrapper(_Recorder())
    with caplog.at_level("INFO", logger="eval.callback"):
        results = callback(7, net)
    assert set(results) == {"tiny"} and results["tiny"]["pairs"] == 8
    assert callback.best["tiny"] == results["tiny"]["acc"]
    assert set(writer.scalars) == {f"val/tiny/{k}" for k in ("acc", "acc_noflip", "val", "xnorm")}
    assert writer.scalars["val/tiny/acc"] == (results["tiny"]["acc"], 7)
    assert "verification at step 7" in caplog.text and "tiny" in caplog.text
    # A missing file is skipped with one warning naming it (configs/base.py's promise), not an error.
    with caplog.at_level("WARNING", logger="eval.callback"):
        partial = CallbackVerification(["tiny", "lfw"], TINY_BIN.parent)
    assert partial.targets == ["tiny"]
    assert f"verification target lfw: {TINY_BIN.parent / 'lfw.bin'} does not exist; skipped" in caplog.text


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_callback_verifies_in_the_training_precision(dtype):
    # The trainer passes its autocast dtype (bf16 = True in a config): the backbone's forward runs under it.
    pytest.importorskip("utils.distributed")
    from eval.callback import CallbackVerification

    callback = CallbackVerification(["tiny"], TINY_BIN.parent, batch_size=8, nfolds=2, autocast_dtype=dtype)
    net = _Recorder()
    results = callback(1, _Wrapper(net))
    assert results["tiny"]["pairs"] == 8 and isinstance(results["tiny"]["acc"], float)
    assert set(net.output_dtypes) == {dtype or torch.float32}
    assert net.training  # the wrapper passes train()/eval() through; test() restored the mode


def test_callback_other_ranks_load_nothing_and_wait_at_the_barrier(monkeypatch):
    # The process-group side (a real gloo barrier) is utils.distributed's; here: who loads, who waits.
    pytest.importorskip("utils.distributed")
    import eval.callback as C

    calls = []
    monkeypatch.setattr(C, "barrier", lambda: calls.append("barrier"))
    # What rank 0 broadcasts in a real group: the target was found and loaded.
    monkeypatch.setattr(C, "broadcast_ints", lambda values, device: [C._LOADED] * len(values))
    for rank, expected in ((1, None), (0, 8)):
        monkeypatch.setattr(C, "get_rank", lambda rank=rank: rank)
        callback = C.CallbackVerification(["tiny"], TINY_BIN.parent, batch_size=8, nfolds=2)
        assert len(callback.sets) == (rank == 0)
        result = callback(1, _Recorder())
        assert (None if result is None else result["tiny"]["pairs"]) == expected
    assert calls == ["barrier", "barrier"]


def _callback_error(rank: int, world_size: int, folder: str) -> str:
    """On a rank of a real group: build the callback on ``folder``/evil.bin and return the ValueError it raised."""
    from eval.callback import CallbackVerification

    try:
        CallbackVerification(["evil"], folder)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.process
@pytest.mark.timeout(120)
def test_callback_a_refused_bin_is_an_error_on_every_rank_not_a_hang(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "evil.bin").write_bytes(pickle.dumps(([_RunsCommand(marker), b"x"], [True]), protocol=2))
    from tests.helpers import on_ranks

    said = on_ranks(_callback_error, 2, str(tmp_path), timeout=100)
    assert re.search(r"evil\.bin: refused global (posix|nt)\.system", said[0]), said
    assert said[1] == f"{tmp_path / 'evil.bin'}: rank 0 could not read this verification file", said
    assert not marker.exists()


@pytest.mark.parametrize("n, k", [(6000, 10), (1200, 10), (1203, 10), (7, 2), (10, 10), (11, 3)])
def test_folds_are_sklearn_s_unshuffled_kfold(n, k):
    from sklearn.model_selection import KFold

    ours = V._folds(n, k)
    theirs = list(KFold(n_splits=k, shuffle=False).split(np.arange(n)))
    assert len(ours) == len(theirs) == k
    for (train, test_), (want_train, want_test) in zip(ours, theirs):
        assert np.array_equal(train, want_train) and np.array_equal(test_, want_test)


@pytest.mark.process
def test_importing_the_trainer_does_not_import_sklearn():
    """sklearn costs a training process ~1.7 s of start-up: only the PCA option of the verification imports it."""
    code = "import sys, train; print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
