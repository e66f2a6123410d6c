"""utils.checkpoint, the generic step store: atomic writes, crash leftovers, pruning, head re-partition,
weights-only loading. What the trainer puts in it: tests/test_run_state.py.

Ranks are simulated with threads meeting at a ``threading.Barrier`` (the same ordering as real ranks meeting
at ``dist.barrier``); one test runs the real thing on 2 gloo ranks.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch

from partial_fc import head_shard, load_head_rows, restore_head
from tests.helpers import on_ranks
from utils.checkpoint import (
    MANIFEST,
    clean_partial,
    find_latest,
    is_complete,
    list_checkpoints,
    load_common,
    load_optimizer_state,
    load_rng,
    recover_replaced,
    rng_state,
    save_checkpoint,
    set_rng_state,
    step_dir,
)
from utils.files import load_tensors, save_atomic

D = 4  # embedding size of the fake heads


def partition(num_classes: int, world_size: int, rank: int) -> tuple[int, int]:
    """The contract's split: the first num_classes % world_size ranks own one class more."""
    base, extra = divmod(num_classes, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def full_head(num_classes: int, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_classes, D, generator=g)  # (C, D)
    state = {"exp_avg": torch.randn(num_classes, D, generator=g), "step": torch.arange(num_classes).float()}
    return weight, state


def make_common_for(step: int, world_size: int, num_classes: int) -> dict:
    """A rank-0 part as a caller writes one: the store's keys and whatever else (tensors, optimizer state, tuples)."""
    model = torch.nn.Linear(3, D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return {"step": step, "world_size": world_size, "num_classes": num_classes, "backbone": model.state_dict(),
            "backbone_optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
            "config": {"lr": 0.1, "margin_list": (1.0, 0.5, 0.0), "output": None}}


def save_world(output: Path, step: int, world_size: int, num_classes: int = 7, keep: int = 5, seed: int = 0,
               fail_rank0_at_barrier: int | None = None) -> Path:
    """Save one checkpoint from ``world_size`` simulated ranks; returns the directory."""
    weight, state = full_head(num_classes, seed)
    barrier = threading.Barrier(world_size)
    results: dict[int, object] = {}

    def rank_main(rank: int) -> None:
        calls = [0]

        def wait() -> None:
            calls[0] += 1
            if rank == 0 and calls[0] == fail_rank0_at_barrier:
                barrier.abort()
                raise KeyboardInterrupt("simulated crash")
            barrier.wait(timeout=30)

        start, n = partition(num_classes, world_size, rank)
        shard = head_shard(weight[start:start + n], {k: v[start:start + n] for k, v in state.items()}, start,
                           num_classes)
        common = make_common_for(step, world_size, num_classes) if rank == 0 else None
        try:
            results[rank] = save_checkpoint(output, step, rank=rank, world_size=world_size, head=shard,
                                            common=common, keep=keep, barrier=wait)
        except (KeyboardInterrupt, threading.BrokenBarrierError) as exc:
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if fail_rank0_at_barrier is None:
        assert all(isinstance(results[r], Path) for r in range(world_size)), results
    return step_dir(output, step)


# ------------------------------------------------------------------------------ single files

def test_save_atomic_roundtrip(tmp_path):
    path = tmp_path / "sub" / "model.pt"
    save_atomic({"w": torch.ones(2)}, path)
    assert torch.equal(load_tensors(path)["w"], torch.ones(2))
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]


def test_save_atomic_failure_keeps_previous_file(tmp_path):
    path = tmp_path / "model.pt"
    save_atomic({"w": torch.zeros(3)}, path)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        save_atomic({"w": torch.ones(3), "bad": lambda: 0}, path)  # cannot be pickled: fails mid-write
    assert torch.equal(load_tensors(path)["w"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_save_atomic_flushes_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    # README (Reliability): files are written to a temporary name, fsynced, renamed, and the folder fsynced, so a
    # power loss leaves the old file or the new one, never a torn one.
    import utils.files as files

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(files.os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(files.os, "replace", lambda a, b: events.append(("replace", str(b))) or replace(a, b))
    path = tmp_path / "model.pt"
    save_atomic({"w": torch.ones(2)}, path)
    assert events == [("fsync", f"{path}.tmp"), ("replace", str(path)), ("fsync", str(tmp_path))], events
    # A checkpoint: every file flushed inside step_N.tmp/, then the folder renamed, then checkpoints/ flushed.
    events.clear()
    ckpt = save_world(tmp_path / "run", 12, world_size=2)
    renamed = events.index(("replace", str(ckpt)))
    assert events[renamed + 1:] == [("fsync", str(ckpt.parent))], events
    flushed = {Path(p).name.removesuffix(".tmp") for kind, p in events[:renamed]
               if kind == "fsync" and Path(p).parent.name == f"{ckpt.name}.tmp"}
    assert flushed == {p.name for p in ckpt.iterdir()}, (flushed, events)


# ------------------------------------------------------------------------------ layout and contents

def test_layout_contents_and_weights_only(tmp_path):
    ckpt = save_world(tmp_path, 12, world_size=2)
    assert ckpt == tmp_path / "checkpoints" / "step_000000012"
    names = {"common.pt", "head_rank0.pt", "head_rank1.pt", "rng_rank0.pt", "rng_rank1.pt", MANIFEST}
    assert {p.name for p in ckpt.iterdir()} == names
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 12
    assert manifest["files"] == {n: (ckpt / n).stat().st_size for n in names - {MANIFEST}}
    for name in names - {MANIFEST}:  # everything loads with the restricted unpickler
        torch.load(ckpt / name, map_location="cpu", weights_only=True)
    common = load_common(ckpt)
    assert (common["step"], common["world_size"]) == (12, 2)
    assert common["num_classes"] == 7
    assert common["config"]["margin_list"] == (1.0, 0.5, 0.0) and common["scaler"]["scale"] == 1024.0
    assert "momentum_buffer" in common["backbone_optimizer"]["state"][0]
    assert set(load_rng(ckpt, 1)) >= {"cpu"} and load_rng(ckpt, 2) is None
    assert list(tmp_path.joinpath("checkpoints").iterdir()) == [ckpt]  # no .tmp left behind


def test_every_saved_tensor_is_a_cpu_tensor_at_any_depth():
    """``on_cpu`` (what save_checkpoint applies to every file): tensors detached and on the CPU inside dicts, lists,
    tuples and named tuples, everything else as it was (a GPU's tensors: tests/test_cuda.py)."""
    from utils.checkpoint import on_cpu

    leaf = torch.ones(3, requires_grad=True) * 2
    where = torch.nn.Linear(2, 2)  # an object that is no container: left as it is
    payload = {"state": {0: {"momentum_buffer": leaf, "step": torch.tensor(4.0)}},
               "param_groups": [{"lr": 0.1, "betas": (0.9, leaf), "params": [0, 1]}], "where": where,
               "pair": torch.return_types.max((leaf, torch.zeros(3, dtype=torch.long)))}
    out = on_cpu(payload)
    tensors = [out["state"][0]["momentum_buffer"], out["param_groups"][0]["betas"][1], out["pair"].values]
    assert all(t.device.type == "cpu" and not t.requires_grad and torch.equal(t, leaf.detach()) for t in tensors)
    assert out["param_groups"][0]["params"] == [0, 1] and out["where"] is where
    assert type(out["param_groups"][0]["betas"]) is tuple and type(out["pair"]) is torch.return_types.max


def test_rng_roundtrip():
    state = rng_state()
    a = torch.rand(5)
    set_rng_state(state)
    assert torch.equal(torch.rand(5), a)


def test_head_shard_rejects_non_row_state():
    with pytest.raises(ValueError, match=r"'step' is \(\); expected a tensor with first dimension num_local = 3"):
        head_shard(torch.zeros(3, D), {"step": torch.tensor(1.0)}, 0, 3)


def test_common_required_on_rank0(tmp_path):
    with pytest.raises(ValueError, match="rank 0 must pass common"):
        save_checkpoint(tmp_path, 1, rank=0, world_size=1, head={}, barrier=lambda: None)


# ------------------------------------------------------------------------------ crashes and leftovers

def test_tmp_dir_is_ignored_and_cleaned(tmp_path):
    save_world(tmp_path, 5, 2)
    good = save_world(tmp_path, 10, 2)
    leftover = tmp_path / "checkpoints" / "step_000000015.tmp"
    leftover.mkdir()
    (leftover / "head_rank0.pt").write_bytes(b"partial")
    assert find_latest(tmp_path) == good
    assert clean_partial(tmp_path) == [leftover]
    assert not leftover.exists() and find_latest(tmp_path) == good


def test_dir_without_manifest_is_ignored(tmp_path):
    good = save_world(tmp_path, 10, 2)
    fake = save_world(tmp_path, 20, 2)
    (fake / MANIFEST).unlink()
    assert find_latest(tmp_path) == good
    assert clean_partial(tmp_path) == [fake] and list_checkpoints(tmp_path) == [good]


def test_truncated_file_is_detected(tmp_path):
    good = save_world(tmp_path, 5, 2)
    bad = save_world(tmp_path, 10, 2)
    shard = bad / "head_rank1.pt"
    shard.write_bytes(shard.read_bytes()[:50])
    assert find_latest(tmp_path) == good
    clean_partial(tmp_path)
    assert not bad.exists() and good.exists()


def test_a_resave_stopped_between_its_renames_keeps_the_replaced_copy(tmp_path):
    save_world(tmp_path, 5, 2)
    first = save_world(tmp_path, 10, 2)
    # Saving step 10 again stopped after moving the complete copy aside, before renaming the new one in.
    old, partial = first.with_name(first.name + ".old"), first.with_name(first.name + ".tmp")
    os.replace(first, old)
    partial.mkdir()
    (partial / "head_rank0.pt").write_bytes(b"partial")
    assert find_latest(tmp_path) == step_dir(tmp_path, 5)  # before the next run looks: only .old holds step 10
    assert recover_replaced(tmp_path) == [first] and recover_replaced(tmp_path) == []
    assert clean_partial(tmp_path) == [partial]
    assert find_latest(tmp_path) == first and is_complete(first) and not old.exists()


def test_a_resave_stopped_after_its_renames_drops_the_old_copy(tmp_path):
    first = save_world(tmp_path, 10, 2)
    old = first.with_name(first.name + ".old")
    shutil.copytree(first, old)  # both complete: the new copy was renamed in, the old one not yet removed
    assert recover_replaced(tmp_path) == [] and clean_partial(tmp_path) == [old]
    assert find_latest(tmp_path) == first and not old.exists()


@pytest.mark.parametrize("barrier_call", [1, 2, 3])
def test_crash_during_save_leaves_previous_newest(tmp_path, barrier_call):
    good = save_world(tmp_path, 5, 2)
    save_world(tmp_path, 10, 2, fail_rank0_at_barrier=barrier_call)
    # barrier 1: files not yet written; 2: files in .tmp, no manifest; 3: renamed and complete.
    expected = step_dir(tmp_path, 10) if barrier_call == 3 else good
    assert find_latest(tmp_path) == expected
    clean_partial(tmp_path)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".tmp")] == []
    assert find_latest(tmp_path) == expected


def test_pruning_keeps_newest(tmp_path):
    for step in range(1, 6):
        save_world(tmp_path, step, 2, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000000004", "step_000000005"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000000004", "step_000000005"]


def test_resave_same_step_replaces(tmp_path):
    save_world(tmp_path, 3, 2, seed=0)
    ckpt = save_world(tmp_path, 3, 1, seed=1)
    assert json.loads((ckpt / MANIFEST).read_text())["world_size"] == 1
    assert torch.equal(load_head_rows(ckpt, 0, 7)["weight"], full_head(7, seed=1)[0])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000000003"]


# ------------------------------------------------------------------------------ re-partition

@pytest.mark.parametrize("old_world,new_world,num_classes", [(2, 1, 7), (2, 3, 7), (3, 2, 7), (3, 3, 8), (1, 3, 5)])
def test_repartition_exact(tmp_path, old_world, new_world, num_classes):
    ckpt = save_world(tmp_path, 1, old_world, num_classes=num_classes)
    weight, state = full_head(num_classes)
    parts = []
    for rank in range(new_world):
        start, n = partition(num_classes, new_world, rank)
        rows = load_head_rows(ckpt, start, n, num_classes=num_classes)
        assert rows["weight"].shape == (n, D) and (rows["class_start"], rows["num_local"]) == (start, n)
        parts.append(rows)
    assert torch.equal(torch.cat([p["weight"] for p in parts]), weight)
    for key in state:
        assert torch.equal(torch.cat([p["state"][key] for p in parts]), state[key])


def test_restore_head_into_parameter_and_optimizer(tmp_path):
    ckpt = save_world(tmp_path, 1, 2)
    weight = torch.nn.Parameter(torch.zeros(3, D))
    opt = torch.optim.SGD([weight], lr=0.1)
    restore_head(weight, opt, load_head_rows(ckpt, 4, 3))
    full_w, full_s = full_head(7)
    assert torch.equal(weight.detach(), full_w[4:7])
    assert torch.equal(opt.state[weight]["exp_avg"], full_s["exp_avg"][4:7])
    with pytest.raises(ValueError, match=r"shape \(2, 4\).*\(3, 4\)"):
        restore_head(weight, opt, load_head_rows(ckpt, 0, 2))


def test_repartition_errors_name_the_file(tmp_path):
    ckpt = save_world(tmp_path, 1, 2)
    with pytest.raises(ValueError, match=r"head_rank0.pt: checkpoint was trained with num_classes = 7"
                                         r".*num_classes = 9"):
        load_head_rows(ckpt, 0, 3, num_classes=9)
    with pytest.raises(ValueError, match=r"outside the checkpoint's \[0, 7\)"):
        load_head_rows(ckpt, 5, 3)
    bad = load_tensors(ckpt / "head_rank1.pt")
    bad["weight"] = torch.zeros(3, D + 1)
    save_atomic(bad, ckpt / "head_rank1.pt")
    with pytest.raises(ValueError, match=r"head_rank1.pt: embedding size 5 but other shards have 4"):
        load_head_rows(ckpt, 0, 7)
    bad["weight"] = torch.zeros(2, D)
    save_atomic(bad, ckpt / "head_rank1.pt")
    with pytest.raises(ValueError, match=r"head_rank1.pt: weight has shape \(2, 4\); "
                                         r"expected \(3, K·D\): one row per class"):
        load_head_rows(ckpt, 0, 7)
    (ckpt / "head_rank1.pt").unlink()
    with pytest.raises(ValueError, match=r"head_rank1.pt: missing head shard of rank 1"):
        load_head_rows(ckpt, 0, 7)


# ------------------------------------------------------------------------------ hostile files

class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # would create the marker file when unpickled


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_hostile_pickle_is_refused(tmp_path, writer):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    marker = tmp_path / "pwned"
    with open(ckpt / "common.pt", "wb") as f:
        if writer == "pickle":
            pickle.dump({"step": _Evil(marker)}, f)
        else:
            torch.save({"step": _Evil(marker)}, f)
    with pytest.raises(ValueError, match=r"common.pt: refused"):
        load_common(ckpt)
    assert not marker.exists()


# ------------------------------------------------------------------------------ real ranks

def _dist_save(rank: int, world_size: int, output: str) -> str:
    weight, state = full_head(7)
    start, n = partition(7, world_size, rank)
    shard = head_shard(weight[start:start + n], {k: v[start:start + n] for k, v in state.items()}, start, 7)
    common = make_common_for(4, world_size, 7) if rank == 0 else None
    return str(save_checkpoint(output, 4, rank=rank, world_size=world_size, head=shard, common=common, keep=2))


@pytest.mark.process
@pytest.mark.timeout(120)
def test_two_gloo_ranks_default_barrier(tmp_path):
    pytest.importorskip("utils.distributed")
    paths = on_ranks(_dist_save, 2, str(tmp_path), timeout=90)
    assert paths == [str(step_dir(tmp_path, 4))] * 2
    assert find_latest(tmp_path) == step_dir(tmp_path, 4)
    rows = load_head_rows(paths[0], 0, 7, num_classes=7)
    assert torch.equal(rows["weight"], full_head(7)[0])


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_an_older_checkpoint_does_not_switch_the_optimizer_off_foreach(kind):
    """A backbone optimizer state saved with foreach unset (earlier releases) is loaded, every value restored,
    but the optimizer keeps running foreach, as it was built."""
    def build(**kw):
        p = torch.nn.Parameter(torch.ones(3))
        if kind == "sgd":
            return p, torch.optim.SGD([p], lr=0.1, momentum=0.9, **kw)
        return p, torch.optim.AdamW([p], lr=0.1, **kw)

    p, old = build()  # foreach=None, as earlier releases built it
    p.grad = torch.full((3,), 0.5)
    old.step()
    old.param_groups[0]["lr"] = 0.03
    saved = old.state_dict()
    assert saved["param_groups"][0]["foreach"] is None
    q, new = build(foreach=True)
    load_optimizer_state(new, saved)
    assert new.param_groups[0]["foreach"] is True and new.param_groups[0]["lr"] == 0.03
    for key, value in old.state[p].items():
        assert torch.equal(new.state[q][key], value)
    plain = build(foreach=True)[1]
    plain.load_state_dict(saved)
    assert plain.param_groups[0]["foreach"] is None  # what torch alone would have done
