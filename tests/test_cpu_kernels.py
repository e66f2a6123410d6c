"""The compiled CPU row updates (utils/cpu_kernels): the torch operations' values, the build and its fallbacks."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from optimizers import RowSparseAdamW, RowSparseSGD
from tests.helpers import ROOT
from utils import cpu_kernels


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache of this test's own, and no library loaded from it yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    return tmp_path / "cache" / "partial_fc" / "cpu_kernels"


def _case(n_rows: int, d: int, sparse: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_rows, d, generator=g)
    rows = torch.randperm(n_rows, generator=g)[: n_rows // 3].sort().values if sparse else None
    grads = [torch.randn(n_rows if rows is None else rows.numel(), d, generator=g) for _ in range(3)]
    return weight, rows, grads


def _torch_sgd(weight, buf, grad, rows, lr, mu, wd):
    """The update as torch operations on gathered rows (RowSparseSGD's fixed_ops arithmetic)."""
    idx = torch.arange(weight.shape[0]) if rows is None else rows
    w, m = weight[idx], buf[idx]
    d = torch.add(grad, w, alpha=wd) if wd != 0 else grad
    m = m.mul(mu).add_(d)
    buf[idx] = m
    weight[idx] = w.add(m, alpha=-lr)


@pytest.mark.parametrize("d", [8, 13, 512])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("wd", [5e-4, 0.0])
def test_sgd_rows_equals_the_torch_operations_bit_for_bit(d, sparse, wd):
    weight, rows, grads = _case(600, d, sparse, seed=d)
    ours, theirs = weight.clone(), weight.clone()
    buf_ours, buf_theirs = torch.zeros_like(weight), torch.zeros_like(weight)
    for grad in grads:
        cpu_kernels.sgd_rows(ours, buf_ours, grad, rows, 0.1, 0.9, wd)
        _torch_sgd(theirs, buf_theirs, grad, rows, 0.1, 0.9, wd)
    assert torch.equal(ours, theirs) and torch.equal(buf_ours, buf_theirs)
    if rows is not None:  # rows outside the update keep their values
        untouched = torch.ones(weight.shape[0], dtype=torch.bool).index_fill_(0, rows, False)
        assert torch.equal(ours[untouched], weight[untouched]) and not buf_ours[untouched].any()


@pytest.mark.parametrize("sparse", [True, False])
def test_adamw_rows_agrees_with_the_torch_operations(sparse, monkeypatch):
    """RowSparseAdamW with and without the kernels: the same values but for the rounding of the square root."""
    weight, rows, grads = _case(900, 64, sparse, seed=3)
    out = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, mode)
        p = torch.nn.Parameter(weight.clone())
        opt = RowSparseAdamW([p], lr=0.01, weight_decay=0.1, tactic="row_blocks")
        for grad in grads:
            p.grad = (torch.sparse_coo_tensor(rows[None], grad, p.shape).coalesce() if rows is not None
                      else grad.clone())
            opt.step()
        out[mode] = (p.detach(), opt.state[p])
    torch.testing.assert_close(out["1"][0], out["0"][0], rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(out["1"][1][key], out["0"][1][key]), key  # only the weight sees the square root
    assert not torch.equal(out["1"][0], out["0"][0])  # torch's CPU sqrt is not always correctly rounded


def test_the_cpu_tactic_runs_the_kernels_and_fixed_ops_does_not(monkeypatch):
    calls = []
    real = cpu_kernels.sgd_rows
    monkeypatch.setattr(cpu_kernels, "sgd_rows", lambda *a, **k: (calls.append(a[3] is None), real(*a, **k))[1])
    for tactic in ("row_blocks", "auto", "fixed_ops"):
        weight, rows, grads = _case(300, 16, True, seed=1)
        p = torch.nn.Parameter(weight)
        opt = RowSparseSGD([p], lr=0.1, tactic=tactic)
        p.grad = torch.sparse_coo_tensor(rows[None], grads[0], p.shape).coalesce()
        opt.step()
        p.grad = grads[1].new_zeros(p.shape).index_add_(0, rows, grads[1])  # dense
        opt.step()
    assert calls == [False, True, False, True]  # row_blocks and auto (CPU): sparse then dense; fixed_ops: none
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    p = torch.nn.Parameter(weight.clone())
    p.grad = grads[0].new_zeros(p.shape)
    RowSparseSGD([p], lr=0.1).step()
    assert len(calls) == 4  # switched off: the torch operations ran


def test_several_threads_split_the_rows_and_give_the_same_bits():
    weight, rows, grads = _case(3000, 32, True, seed=5)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            w, buf = weight.clone(), torch.zeros_like(weight)
            for grad in grads:
                cpu_kernels.sgd_rows(w, buf, grad, rows, 0.1, 0.9, 5e-4)
            results.append((w, buf))
    finally:
        torch.set_num_threads(before)
    assert cpu_kernels._pool is not None and cpu_kernels._pool[1] >= 3
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_bad_arguments_name_what_is_wrong():
    weight, buf, grad = torch.zeros(10, 4), torch.zeros(10, 4), torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"row indices in \[3, 10\] outside \[0, 10\)"):
        cpu_kernels.sgd_rows(weight, buf, grad, torch.tensor([3, 10]), 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match=r"row indices in \[-1, 2\]"):
        cpu_kernels.sgd_rows(weight, buf, grad, torch.tensor([-1, 2]), 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match="expected contiguous fp32 CPU tensors, got torch.float64"):
        cpu_kernels.sgd_rows(weight.double(), buf, grad, torch.tensor([0, 1]), 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match=r"state \(10, 3\) must have the weight's shape \(10, 4\)"):
        cpu_kernels.sgd_rows(weight, torch.zeros(10, 3), grad, torch.tensor([0, 1]), 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match="a dense gradient of 2 rows for a weight of 10"):
        cpu_kernels.sgd_rows(weight, buf, grad, None, 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match=r"step_size must be a contiguous fp32 CPU tensor of shape \(2,\)"):
        cpu_kernels.adamw_rows(weight, buf, buf.clone(), grad, torch.tensor([0, 1]), torch.ones(3), torch.ones(2),
                               0.1, (0.9, 0.999), 1e-8, 0.0)
    assert not cpu_kernels.usable(weight.double()) and not cpu_kernels.usable(weight.t())
    assert cpu_kernels.usable(weight, grad)
    assert torch.equal(weight, torch.zeros(10, 4))  # nothing was written


def test_built_once_into_the_cache_and_loaded_from_it(fresh_cache):
    lib = cpu_kernels.library()
    assert lib is not None
    built = sorted(fresh_cache.glob("cpu_kernels_*.so"))
    assert len(built) == 1 and not list(fresh_cache.glob("*.tmp"))
    assert cpu_kernels.library() is lib
    # A new process finds the library in the cache and does not build it again.
    mtime = built[0].stat().st_mtime_ns
    code = "from utils import cpu_kernels; assert cpu_kernels.library() is not None"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120, env=dict(os.environ))
    assert built[0].stat().st_mtime_ns == mtime and len(list(fresh_cache.iterdir())) == 1


def test_ranks_that_start_together_build_it_side_by_side(fresh_cache):
    code = textwrap.dedent("""
        import torch
        from utils import cpu_kernels
        w, buf = torch.zeros(4, 8), torch.zeros(4, 8)
        cpu_kernels.sgd_rows(w, buf, torch.ones(4, 8), None, 0.5, 0.9, 0.0)
        assert torch.equal(w, torch.full((4, 8), -0.5)), w
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ)) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert len(list(fresh_cache.glob("cpu_kernels_*.so"))) == 1 and not list(fresh_cache.glob("*.tmp"))


def test_without_a_compiler_the_torch_operations_run(fresh_cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.INFO, logger="utils.cpu_kernels"):
        assert cpu_kernels.library() is None and cpu_kernels.library() is None
    said = [r.getMessage() for r in caplog.records]
    assert said == ["CPU kernels: no C compiler (no-such-compiler-here); the head optimizers use torch operations"]
    assert not cpu_kernels.usable(torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="the kernels are unavailable"):
        cpu_kernels.sgd_rows(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), None, 0.1, 0.9, 0.0)
    weight, rows, grads = _case(300, 16, True, seed=2)
    p = torch.nn.Parameter(weight.clone())
    p.grad = torch.sparse_coo_tensor(rows[None], grads[0], p.shape).coalesce()
    RowSparseSGD([p], lr=0.1).step()  # the chunked torch operations
    expected, buf = weight.clone(), torch.zeros_like(weight)
    _torch_sgd(expected, buf, grads[0], rows, 0.1, 0.9, 5e-4)
    assert torch.equal(p.detach(), expected)
    assert not fresh_cache.exists()


def test_a_failing_build_is_reported_and_falls_back(fresh_cache, tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: fatal error: out of cheese' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level(logging.WARNING, logger="utils.cpu_kernels"):
        assert cpu_kernels.library() is None
    assert "exited with 3: cc: fatal error: out of cheese" in caplog.text
    assert not list(fresh_cache.iterdir())  # no half-written library left behind


def test_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert cpu_kernels.library() is None and not cpu_kernels.usable(torch.zeros(2, 2))
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "1")
    assert cpu_kernels.library() is not None
