"""The compiled CPU row updates (utils/cpu_kernels): the torch operations' values, the build and its fallbacks."""
from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import textwrap
from contextlib import contextmanager

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


@contextmanager
def _num_threads(threads: int):
    """torch's intra-op threads (the kernels split rows over as many) set to ``threads`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
            p.grad = (torch.sparse_coo_tensor(rows[None], grad, p.shape, check_invariants=True).coalesce()
                      if rows is not None else grad.clone())
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
        p.grad = torch.sparse_coo_tensor(rows[None], grads[0], p.shape, check_invariants=True).coalesce()
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
    for threads in (1, 3):
        with _num_threads(threads):
            w, buf = weight.clone(), torch.zeros_like(weight)
            for grad in grads:
                cpu_kernels.sgd_rows(w, buf, grad, rows, 0.1, 0.9, 5e-4)
            results.append((w, buf))
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
    with pytest.raises(ValueError, match=r"step_size must be a contiguous torch.float32 CPU tensor of shape \(2,\)"):
        cpu_kernels.adamw_rows(weight, buf, buf.clone(), grad, torch.tensor([0, 1]), torch.ones(3), torch.ones(2),
                               0.1, (0.9, 0.999), 1e-8, 0.0)
    cos, four = torch.zeros(2, 5), torch.zeros(2)
    with pytest.raises(ValueError, match=r"cosines must be a contiguous \(B, C\) fp32 CPU tensor, got torch.float64"):
        cpu_kernels.softmax_forward(cos.double(), torch.ones(5), 1.0, four, torch.zeros(2, dtype=torch.long), four, four)
    with pytest.raises(ValueError, match=r"inv_w must be a contiguous torch.float32 CPU tensor of shape \(5,\)"):
        cpu_kernels.softmax_forward(cos, torch.ones(4), 1.0, four, torch.zeros(2, dtype=torch.long), four, four)
    with pytest.raises(ValueError, match=r"target must be a contiguous torch.int64 CPU tensor of shape \(2,\)"):
        cpu_kernels.softmax_backward(cos, torch.ones(5), 1.0, 0.5, four, four, four, four, four, torch.zeros(5), four)
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
    assert said == ["CPU kernels: no C compiler (no-such-compiler-here); the head, PReLU and narrow convolutions use torch operations"]
    assert not cpu_kernels.usable(torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="the kernels are unavailable"):
        cpu_kernels.sgd_rows(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), None, 0.1, 0.9, 0.0)
    weight, rows, grads = _case(300, 16, True, seed=2)
    p = torch.nn.Parameter(weight.clone())
    p.grad = torch.sparse_coo_tensor(rows[None], grads[0], p.shape, check_invariants=True).coalesce()
    RowSparseSGD([p], lr=0.1).step()  # the chunked torch operations
    expected, buf = weight.clone(), torch.zeros_like(weight)
    _torch_sgd(expected, buf, grads[0], rows, 0.1, 0.9, 5e-4)
    assert torch.equal(p.detach(), expected)
    assert not fresh_cache.exists()


def test_switched_off_by_the_environment_it_says_so_once(fresh_cache, monkeypatch, caplog):
    monkeypatch.setenv("PFC_CPU_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="utils.cpu_kernels"):
        assert cpu_kernels.library() is None and cpu_kernels.library() is None
        assert not cpu_kernels.usable(torch.zeros(2, 2))
    said = [r.getMessage() for r in caplog.records]
    assert said == ["CPU kernels: switched off (PFC_CPU_KERNELS=0); the head, PReLU and narrow convolutions use "
                    "torch operations"]
    assert not fresh_cache.exists()  # nothing built


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


def _margin_softmax_step(batch: int, classes: int, s: float, spread: float, seed: int):
    """Loss, embedding gradient and weight gradient of one fused margin-softmax step (CPU tactic), a third of the
    rows' classes elsewhere (target -1)."""
    from losses import ArcFace
    from partial_fc import _Buffer, _MarginSoftmax

    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(batch, 16, generator=g).requires_grad_()
    weight = (torch.randn(classes, 16, generator=g) * spread).requires_grad_()
    target = torch.randint(0, classes, (batch,), generator=g)
    target[::3] = -1
    loss = _MarginSoftmax.apply(emb, weight, None, target, ArcFace(s=s), "row_blocks", False, _Buffer())
    loss.backward()
    return loss.detach(), emb.grad, weight.grad


@pytest.mark.parametrize("batch, classes, s", [(7, 37, 64.0), (64, 3001, 64.0), (33, 1000, 16.0)])
def test_margin_softmax_kernels_agree_with_the_torch_operations(batch, classes, s, monkeypatch):
    """Classes not a multiple of the 16 lanes; s = 64 sends many logits below e^-87 (clamped there, not 0)."""
    out = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, mode)
        out[mode] = _margin_softmax_step(batch, classes, s, spread=1.0, seed=batch)
    torch.testing.assert_close(out["1"][0], out["0"][0], rtol=2e-7, atol=0)
    torch.testing.assert_close(out["1"][1], out["0"][1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out["1"][2], out["0"][2], rtol=1e-5, atol=1e-7)
    assert out["1"][2].abs().sum() > 0


def test_softmax_forward_row_statistics_and_threads():
    g = torch.Generator().manual_seed(4)
    batch, classes = 300, 517
    products = torch.randn(batch, classes, generator=g)
    inv_w = torch.rand(classes, generator=g) + 0.5
    target = torch.randint(-1, classes, (batch,), generator=g)
    target_logit = torch.randn(batch, generator=g) * 10
    results = []
    for threads in (1, 3):
        with _num_threads(threads):
            cos, row_max, row_sum = products.clone(), torch.empty(batch), torch.empty(batch)
            cpu_kernels.softmax_forward(cos, inv_w, 30.0, target_logit, target, row_max, row_sum)
            results.append((cos, row_max, row_sum))
    cos, row_max, row_sum = results[0]
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))  # rows split over threads: same bits
    assert torch.equal(cos, products * inv_w)
    logits = 30.0 * cos
    rows = torch.nonzero(target >= 0)[:, 0]
    logits[rows, target[rows]] = target_logit[rows]
    assert torch.equal(row_max, logits.amax(dim=1))
    torch.testing.assert_close(row_sum, (logits - row_max[:, None]).double().exp().sum(dim=1).float(), rtol=3e-7,
                               atol=0)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="flush-to-zero is set on x86 only")
def test_softmax_backward_flushes_subnormal_softmax_values_and_restores_the_callers_mode():
    """Logits 87 or more below their row's largest give softmax values below FLT_MIN: the backward loop makes them
    0 (flush-to-zero), where the same arithmetic would leave subnormal numbers (microcode on x86, 2x to 35x slower);
    the thread's floating-point mode is the caller's again afterwards."""
    g = torch.Generator().manual_seed(7)
    batch, classes, s = 8, 100, 64.0
    products = torch.rand(batch, classes, generator=g) * 2 - 1  # logits ±64: many 87+ below the row's largest
    inv_w, target = torch.ones(classes), torch.randint(0, classes, (batch,), generator=g)
    target_logit, slope = torch.full((batch,), 60.0), torch.ones(batch)
    cos, row_max, row_sum = products.clone(), torch.empty(batch), torch.empty(batch)
    with _num_threads(1):  # the loop runs on this thread
        cpu_kernels.softmax_forward(cos, inv_w, s, target_logit, target, row_max, row_sum)
        coef = (1.0 / batch) / row_sum
        dot_w, dot_e = torch.zeros(classes), torch.empty(batch)
        cpu_kernels.softmax_backward(cos, inv_w, s, 1.0 / batch, target_logit, slope, target, row_max, coef, dot_w,
                                     dot_e)
    logits = (s * products).scatter(1, target[:, None], target_logit[:, None])
    far = (logits - row_max[:, None] < -88.0)  # exp clamped at e^-87, then times coef < 1: below FLT_MIN
    assert far.sum() > 100
    tiny = torch.finfo(torch.float32).tiny
    assert not ((cos != 0) & (cos.abs() < tiny)).any()  # no subnormal G
    assert (cos[far] == 0).all()
    near = logits - row_max[:, None] > -40.0
    assert (cos[near] != 0).all()
    half = torch.tensor([tiny]) * 0.5  # torch's own arithmetic on this thread still makes subnormal numbers
    assert half.item() != 0.0 and half.item() < tiny


def test_softmax_kernels_keep_a_nan_a_nan():
    """A non-finite step must stay visible in the loss: the trainer's skip-or-step decision reads it."""
    cos = torch.zeros(3, 40)
    cos[1, 7] = float("nan")
    inv_w, target = torch.ones(40), torch.tensor([0, 5, -1])
    row_max, row_sum = torch.empty(3), torch.empty(3)
    cpu_kernels.softmax_forward(cos, inv_w, 64.0, torch.zeros(3), target, row_max, row_sum)
    assert torch.isfinite(row_sum[[0, 2]]).all() and torch.isnan(row_sum[1])
    dot_w, dot_e = torch.zeros(40), torch.empty(3)
    cpu_kernels.softmax_backward(cos, inv_w, 64.0, 1 / 3, torch.zeros(3), torch.ones(3), target, row_max,
                                 torch.full((3,), 0.01), dot_w, dot_e)
    assert torch.isnan(dot_e[1]) and torch.isfinite(dot_e[[0, 2]]).all() and torch.isnan(dot_w).any()


# ---------------------------------------------------------------------------------------- PReLU backward
def _prelu_reference(x: torch.Tensor, grad: torch.Tensor, slopes: torch.Tensor):
    """torch's own backward (the input's gradient, bits to match) and the slopes' gradient in float64."""
    xx = x.clone().requires_grad_()
    w = slopes.to(x.dtype).clone().requires_grad_()
    torch.prelu(xx, w).backward(grad)
    x64, g64 = x.double(), grad.double()
    dims = [d for d in range(x.dim()) if d != 1]
    terms = torch.where(x64 > 0, 0.0, x64 * g64)
    gw64, size = terms.sum(dims), terms.abs().sum(dims)  # the sum, and the sum of its terms' magnitudes
    if slopes.numel() == 1:
        return xx.grad, gw64.sum().reshape(slopes.shape), size.sum().reshape(slopes.shape)
    return xx.grad, gw64, size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, slopes", [((5, 3, 17, 19), 3), ((4, 16, 56, 56), 16), ((6, 7), 7), ((3, 5, 9), 1)])
def test_prelu_backward_is_torch_s_for_the_input_and_exact_sums_for_the_slopes(dtype, shape, slopes):
    """Spatial sizes not a multiple of the 16 lanes or the 256-value chunks; a 2-d input; one shared slope."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    x.view(-1)[::7] = 0.0  # x = 0 takes the slope's branch: gradient w·g, and 0 towards the slope
    grad = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(slopes, generator=g) * 0.5).to(dtype).float()  # the values a forward in `dtype` used
    gx, gw = cpu_kernels.prelu_backward(x, grad, w)
    want_gx, want_gw, size = _prelu_reference(x, grad, w)
    assert gx.dtype == dtype and torch.equal(gx, want_gx)
    assert gw.dtype == torch.float32 and gw.shape == w.shape
    # fp32 lanes of 256 values, then double: within 1e-6 of the terms' magnitudes (cancellation can leave a
    # small sum, so a relative bound on the sum itself would be meaningless)
    assert ((gw.double() - want_gw).abs() <= 1e-6 * size).all(), (gw, want_gw)


def test_prelu_backward_threads_and_nan():
    g = torch.Generator().manual_seed(9)
    x, grad, w = torch.randn(12, 4, 30, 30, generator=g), torch.randn(12, 4, 30, 30, generator=g), torch.rand(4)
    results = []
    for threads in (1, 3):  # images split over threads: the same input gradient, sums to rounding
        with _num_threads(threads):
            results.append(cpu_kernels.prelu_backward(x, grad, w))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=0)
    x[3, 2, 5, 5] = float("nan")  # a NaN input reaches both gradients, as in torch
    gx, gw = cpu_kernels.prelu_backward(x, grad, w)
    assert torch.isnan(gx[3, 2, 5, 5]) == torch.isnan(w[2] * grad[3, 2, 5, 5]) and torch.isnan(gw[2])
    assert torch.isfinite(gw[[0, 1, 3]]).all()


def test_prelu_backward_bad_arguments_name_what_is_wrong():
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(ValueError, match=r"gradient torch.float32 \(2, 3, 4, 5\) must match the input"):
        cpu_kernels.prelu_backward(x, torch.randn(2, 3, 4, 5), torch.rand(3))
    with pytest.raises(ValueError, match=r"2 PReLU slopes for 3 channels \(1 or 3 allowed\)"):
        cpu_kernels.prelu_backward(x, torch.randn_like(x), torch.rand(2))
    with pytest.raises(ValueError, match=r"the PReLU input must be a contiguous CPU tensor"):
        cpu_kernels.prelu_backward(x.transpose(2, 3), torch.randn_like(x), torch.rand(3))
    with pytest.raises(ValueError, match=r"fp32 or bf16, got torch.float64"):
        cpu_kernels.prelu_backward(x.double(), torch.randn_like(x).double(), torch.rand(3))


def _torch_and_kernel_samples(num_local, rate, class_start, local, in_shard, seed):
    """``PartialFC._sample``'s rows by the torch operations (``fixed_ops``) and by the kernel (``row_blocks``)
    for the same RNG state."""
    from losses import ArcFace
    from partial_fc import PartialFC

    head = PartialFC(ArcFace(), 4, num_local, sample_rate=rate)
    head.class_start = class_start  # a later rank's shard: only the class ids change
    out = []
    for tactic in ("fixed_ops", "row_blocks"):
        torch.manual_seed(seed)
        out.append(head._sample(local, in_shard, tactic))
    return out


@pytest.mark.parametrize("num_local, rate, class_start, batch", [
    (1000, 0.1, 0, 64), (1000, 0.5, 123_457, 300), (70_001, 0.1, 0, 256), (70_001, 0.9, 2**31 - 70_001, 40),
    (9, 0.3, 5, 40), (1, 0.5, 7, 3), (500, 1e-4, 0, 40), (300, 0.05, 2**32 - 300, 1000), (2000, 0.999, 11, 0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_rows_are_the_torch_operations_rows(num_local, rate, class_start, batch, seed):
    """The same rows as the keys, lift, topk and sort in torch: few and many classes, more positives than the
    sample (positive-only sampling, rate 1e-4), every class a positive, repeated positives, ids near 2^31 and
    2^32, an empty batch."""
    g = torch.Generator().manual_seed(seed)
    local = torch.randint(-5, num_local + 5, (batch,), generator=g)  # a few on other ranks' shards
    local[: batch // 4] = local[batch // 4: 2 * (batch // 4)]  # repeats
    in_shard = (local >= 0) & (local < num_local)
    expected, got = _torch_and_kernel_samples(num_local, rate, class_start, local, in_shard, seed)
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert set(local[in_shard].tolist()) <= set(got.tolist())


def test_sample_rows_bad_arguments_name_what_is_wrong():
    none = torch.zeros(0, dtype=torch.int64)
    for args in ((-1, 4, 0, none, 1), (0, 0, 0, none, 1), (0, 4, 2**31, none, 1), (2**32 - 1, 4, 0, none, 1),
                 (0, 4, 0, none, -1)):
        with pytest.raises(ValueError, match=r"sampling needs 0 <= class_start, 1 <= num_local, class ids below "
                                             r"2\^32, a seed in \[0, 2\^31\) and k_base >= 0; got "):
            cpu_kernels.sample_rows(*args)
    with pytest.raises(ValueError, match=r"positive rows in \[2, 4\] outside \[0, 4\)"):
        cpu_kernels.sample_rows(0, 4, 0, torch.tensor([2, 4]), 2)
    with pytest.raises(ValueError, match="positives must be a contiguous torch.int64"):
        cpu_kernels.sample_rows(0, 4, 0, torch.tensor([2.0]), 2)


def test_the_head_samples_with_the_kernel_only_with_the_cpu_tactic(monkeypatch):
    from losses import ArcFace
    from partial_fc import PartialFC

    head = PartialFC(ArcFace(), 8, 5003, sample_rate=0.1)
    g = torch.Generator().manual_seed(3)
    local = torch.randint(0, head.num_local, (40,), generator=g)
    in_shard = torch.rand(40, generator=g) < 0.7
    calls = []
    real = cpu_kernels.sample_rows
    monkeypatch.setattr(cpu_kernels, "sample_rows", lambda *a: (calls.append(a), real(*a))[1])
    chosen = []
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, switch)
        for tactic in ("row_blocks", "fixed_ops"):
            torch.manual_seed(11)
            chosen.append([head._sample(local, in_shard, tactic) for _ in range(3)])
    assert len(calls) == 3  # the kernel ran with the CPU tactic while switched on, and only then
    assert all(torch.equal(a, b) for other in chosen[1:] for a, b in zip(chosen[0], other))
    assert all(rows.shape == (500,) for rows in chosen[0])
    assert set(local[in_shard].tolist()) <= set(chosen[0][0].tolist())  # every positive is sampled


def _rows_at(rows: int, width: int, offset: int) -> torch.Tensor:
    """A NaN-filled (rows, width) fp32 tensor whose data starts ``offset`` floats into its storage: 0 keeps torch's
    alignment (the streaming stores' path where width is a multiple of 4), 1 puts it 4 bytes off (plain stores)."""
    return torch.full((rows * width + offset,), float("nan"))[offset:].view(rows, width)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("rows, width", [(700, 512), (33, 13), (40, 72), (1, 1), (0, 8)])
def test_gather_rows_is_index_select(rows, width, offset):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(rows * 3 + 1, width, generator=g)
    index = torch.randperm(rows * 3 + 1, generator=g)[:rows].sort().values
    out = _rows_at(rows, width, offset)
    cpu_kernels.gather_rows(weight, index, out)
    assert torch.equal(out, torch.index_select(weight, 0, index))


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("rows, width", [(700, 512), (33, 13), (40, 72), (1, 1), (0, 8)])
def test_scale_rows_is_torch_mul(rows, width, offset):
    """The same bits as torch.mul, NaN and infinities included, on the streaming and the plain path."""
    g = torch.Generator().manual_seed(rows + width)
    src = torch.randn(rows, width, generator=g)
    src.view(-1)[3::17] = float("inf")
    src.view(-1)[5::19] = float("nan")
    coef = torch.randn(rows, generator=g)
    coef[1::7] = 0.0
    out = _rows_at(rows, width, offset)
    cpu_kernels.scale_rows(src, coef, out)
    want = torch.mul(src, coef[:, None])
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(_bits(out[~out.isnan()]), _bits(want[~want.isnan()]))


def test_scale_rows_threads_in_place_and_bad_arguments():
    src, coef = torch.randn(5000, 64), torch.randn(5000)
    want = src * coef[:, None]
    out = torch.empty(5000, 64)
    with _num_threads(3):
        cpu_kernels.scale_rows(src, coef, out)
    assert torch.equal(out, want)
    cpu_kernels.scale_rows(src, coef, src)  # in place: each value is read before it is written
    assert torch.equal(src, want)
    with pytest.raises(ValueError, match=r"scaling the rows of \(5000, 64\) into \(2, 64\)"):
        cpu_kernels.scale_rows(src, coef, torch.empty(2, 64))
    with pytest.raises(ValueError, match=r"coef must be a contiguous torch.float32 CPU tensor of shape \(5000,\)"):
        cpu_kernels.scale_rows(src, coef[:10], out)
    with pytest.raises(ValueError, match="expected contiguous fp32 CPU tensors, got torch.float64"):
        cpu_kernels.scale_rows(src.double(), coef, out)


def _norm_probe(rows: int, width: int, seed: int) -> torch.Tensor:
    """(rows, width) values of magnitudes 1e-3 to 1e3, with a zero row, NaN, an infinity and squares that overflow."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[rows // 2] = 0.0
    x.view(-1)[7::997] = float("nan")
    x.view(-1)[11::1009] = float("inf")
    x[-1] = 4e19
    return x


@pytest.mark.parametrize("rows, width, threads", [(3000, 512, 1), (3000, 512, 3), (37, 8, 1), (600, 1024, 2),
                                                  (1, 64, 1), (0, 16, 1)])
def test_row_norms_are_torch_s_norms(rows, width, threads):
    """The norms of fp32 rows to the bit as torch.linalg.vector_norm sums them, on this CPU and torch, whatever the
    thread count; norms_like_torch says so for every width the probe checks."""
    x = _norm_probe(max(rows, 2), width, rows + width)[:rows]
    out = torch.full((rows,), -1.0)
    with _num_threads(threads):
        cpu_kernels.row_norms(x, out)
    assert torch.equal(_bits(out), _bits(torch.linalg.vector_norm(x, dim=1)))
    assert cpu_kernels.norms_like_torch(width)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("pieces, width", [(1, 512), (3, 48), (2, 16)])
def test_gather_rows_with_norms_gives_torch_s_norms(pieces, width, offset):
    """The gather's norms of each row's K pieces (a class's centres) are torch's bits, on the streaming and the
    plain path, and the rows are still index_select's."""
    weight = _norm_probe(901, width, width)
    index = torch.randperm(901, generator=torch.Generator().manual_seed(pieces))[:300].sort().values
    out, norms = _rows_at(300, width, offset), torch.full((300, pieces), -1.0)
    cpu_kernels.gather_rows(weight, index, out, norms)
    want = torch.index_select(weight, 0, index)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[~out.isnan()], want[~want.isnan()])
    assert torch.equal(_bits(norms.view(-1)), _bits(torch.linalg.vector_norm(want.view(-1, width // pieces), dim=1)))


def test_norms_like_torch_is_false_where_the_sums_differ(monkeypatch):
    """Widths that are no multiple of 8, kernels switched off, and a torch that sums a row's squares in another
    order all say False, and then the head takes torch's norms (the gather copies only)."""
    from losses import ArcFace
    from partial_fc import PartialFC

    assert not cpu_kernels.norms_like_torch(13) and not cpu_kernels.norms_like_torch(4)
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert not cpu_kernels.norms_like_torch(512)
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "1")
    monkeypatch.setattr(cpu_kernels, "_norms_checked", {})
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda x, dim: x.mul(x).sum(dim).sqrt())  # another order
    assert not cpu_kernels.norms_like_torch(16)
    calls = []
    real = cpu_kernels.gather_rows
    monkeypatch.setattr(cpu_kernels, "gather_rows",
                        lambda *a: (calls.append(len(a) > 3 and a[3] is not None), real(*a))[1])
    head = PartialFC(ArcFace(), 16, 301, sample_rate=0.3, tactic="row_blocks")
    head(torch.randn(12, 16), torch.randint(0, 301, (12,)))
    assert calls == [False]  # one gather, no norms asked of it


def test_gather_rows_threads_and_bad_arguments():
    weight = torch.randn(5000, 64)
    index = torch.arange(0, 5000, 2)
    out = torch.empty(2500, 64)
    with _num_threads(3):
        cpu_kernels.gather_rows(weight, index, out)
    assert torch.equal(out, weight[index])
    out = torch.empty(2, 64)
    with pytest.raises(ValueError, match=r"row indices in \[4, 5000\] outside \[0, 5000\)"):
        cpu_kernels.gather_rows(weight, torch.tensor([4, 5000]), out)
    with pytest.raises(ValueError, match=r"gathering 3 rows of a \(5000, 64\) weight into \(2, 64\)"):
        cpu_kernels.gather_rows(weight, torch.tensor([1, 2, 3]), out)
    with pytest.raises(ValueError, match="expected contiguous fp32 CPU tensors, got torch.float64"):
        cpu_kernels.gather_rows(weight.double(), torch.tensor([1, 2]), out)
    with pytest.raises(ValueError, match="index must be a contiguous torch.int64"):
        cpu_kernels.gather_rows(weight, torch.tensor([1, 2], dtype=torch.int32), out)
    for norms in (torch.empty(2, 3), torch.empty(2, 16), torch.empty(3, 1), torch.empty(2), torch.empty(2, 1).double()):
        with pytest.raises(ValueError, match=r"norms .* of 2 gathered rows of 64 values: expected a contiguous fp32"):
            cpu_kernels.gather_rows(weight, torch.tensor([1, 2]), out, norms)
    with pytest.raises(ValueError, match=r"row norms of \(5000, 12\): expected \(n, d\) with d a multiple of 8"):
        cpu_kernels.row_norms(torch.randn(5000, 12), torch.empty(5000))
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 CPU tensor of shape \(5000,\)"):
        cpu_kernels.row_norms(weight, torch.empty(4999))


@pytest.mark.parametrize("sub_centers", [1, 3])
def test_the_cpu_tactic_gathers_the_sampled_rows_with_the_kernel(sub_centers, monkeypatch):
    """The head's step gathers through the kernel with the CPU tactic only, and both tactics agree."""
    from losses import ArcFace
    from partial_fc import PartialFC

    calls = []
    real = cpu_kernels.gather_rows
    monkeypatch.setattr(cpu_kernels, "gather_rows",
                        lambda *a: (calls.append((a[2].shape, a[3].shape if len(a) > 3 else None)), real(*a))[1])
    results = []
    for tactic in ("row_blocks", "fixed_ops"):
        torch.manual_seed(0)
        head = PartialFC(ArcFace(), 16, 301, sample_rate=0.3, sub_centers=sub_centers, tactic=tactic)
        emb = torch.randn(12, 16, requires_grad=True)
        loss = head(emb, torch.randint(0, 301, (12,)))
        loss.backward()
        results.append((loss.detach(), emb.grad, head.weight.grad.to_dense()))
    # once, with the CPU tactic: int(0.3 · 301) rows, and the norms of their centres (torch's bits: 16 values)
    assert calls == [((90, 16 * sub_centers), (90, sub_centers))]
    for a, b in zip(*results):  # to rounding (ArcFace's s = 64 makes the weight gradient's values ~100)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


@pytest.mark.parametrize("sub_centers", [1, 3])
def test_the_cpu_tactic_scales_a_whole_shard_with_the_kernel(sub_centers, monkeypatch):
    """Without sampling, the weight gradient's −coef·W over the whole shard goes through scale_rows with the CPU
    tactic only (into the head's kept gradient memory from the second step), the shard's centres' norms through
    row_norms, and both tactics agree."""
    from losses import ArcFace
    from partial_fc import PartialFC

    calls, norm_calls = [], []
    real, real_norms = cpu_kernels.scale_rows, cpu_kernels.row_norms
    monkeypatch.setattr(cpu_kernels, "scale_rows",
                        lambda *a: (calls.append((a[2].shape, a[2].data_ptr())), real(*a))[1])
    monkeypatch.setattr(cpu_kernels, "row_norms", lambda *a: (norm_calls.append(a[0].shape), real_norms(*a))[1])
    results = []
    for tactic in ("row_blocks", "fixed_ops"):
        torch.manual_seed(0)
        head = PartialFC(ArcFace(), 16, 301, sample_rate=1.0, sub_centers=sub_centers, tactic=tactic)
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        for _ in range(2):
            emb = torch.randn(12, 16, requires_grad=True)
            loss = head(emb, torch.randint(0, 301, (12,)))
            loss.backward()
            grad = head.weight.grad.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
        results.append((loss.detach(), emb.grad, grad, head.weight.detach()))
    assert [shape for shape, _ in calls] == [(301 * sub_centers, 16)] * 2  # each step, with the CPU tactic only
    assert calls[0][1] == calls[1][1]  # the second step writes into the first step's gradient memory
    assert norm_calls == [(301 * sub_centers, 16)] * 2  # one centre a row
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


# ---------------------------------------------------------------------------------------- narrow convolution backward
def _conv_reference(x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, stride: int, padding: int):
    """The gradients in float64, and the sums of their terms' magnitudes (the scale of their rounding)."""
    def grads(x64, g64, w64):
        return torch.ops.aten.convolution_backward(g64, x64, w64, None, [stride] * 2, [padding] * 2, [1, 1], False,
                                                   [0, 0], 1, [True, True, False])[:2]
    want = grads(x.double(), grad.double(), weight.double())
    size = grads(x.double().abs(), grad.double().abs(), weight.double().abs())
    return want, size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, ci, co, k, stride, padding, h, w", [
    (4, 2, 2, 3, 1, 1, 20, 37),   # rows not a multiple of the 16 lanes, h != w
    (3, 3, 2, 3, 1, 1, 17, 16),   # the stem: 3 -> 2
    (2, 2, 2, 3, 2, 1, 19, 22),   # stride 2, odd and even sizes
    (2, 2, 3, 1, 2, 0, 15, 18),   # the strided 1x1 shortcut
    (1, 3, 4, 3, 2, 0, 9, 11),    # no padding
    (2, 1, 3, 3, 1, 2, 6, 5),     # padding k - 1
    (1, 2, 1, 1, 1, 0, 1, 1),     # one pixel
])
def test_conv2d_loops_match_float64_torch(dtype, n, ci, co, k, stride, padding, h, w):
    g = torch.Generator().manual_seed(n * 100 + ci * 10 + co + h)
    x = torch.randn(n, ci, h, w, generator=g).to(dtype)
    weight = torch.randn(co, ci, k, k, generator=g).to(dtype)  # the values a forward in `dtype` used
    out = torch.nn.functional.conv2d(x.float(), weight.float(), stride=stride, padding=padding)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    gx, gw = cpu_kernels.conv2d_backward(x, grad, weight, stride, padding)
    (want_gx, want_gw), (size_gx, size_gw) = _conv_reference(x, grad, weight, stride, padding)
    assert gx.dtype == dtype and gx.shape == x.shape and gw.dtype == torch.float32 and gw.shape == weight.shape
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0  # the input's gradient is rounded once to bf16
    assert ((gx.double() - want_gx).abs() <= rounding * want_gx.abs() + 1e-6 * size_gx).all()
    assert ((gw.double() - want_gw).abs() <= 1e-6 * size_gw).all()
    gx_none, gw_alone = cpu_kernels.conv2d_backward(x, grad, weight, stride, padding, input_grad=False)
    assert gx_none is None and torch.equal(gw_alone, gw)
    # the forward: a float sum per output value, rounded once
    y = cpu_kernels.conv2d_forward(x, weight, stride, padding)
    want_y = torch.nn.functional.conv2d(x.double(), weight.double(), stride=stride, padding=padding)
    size_y = torch.nn.functional.conv2d(x.double().abs(), weight.double().abs(), stride=stride, padding=padding)
    assert y.dtype == dtype and y.shape == want_y.shape
    assert ((y.double() - want_y).abs() <= rounding * want_y.abs() + 1e-6 * size_y).all()


def test_conv2d_loops_are_the_same_on_any_number_of_threads():
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(7, 2, 24, 24, generator=g).bfloat16(), torch.randn(2, 2, 3, 3, generator=g)
    grad = torch.randn(7, 2, 24, 24, generator=g).bfloat16()
    results = []
    for threads in (1, 3):  # images split over threads: the same input gradient, the weight's to rounding
        with _num_threads(threads):
            results.append((*cpu_kernels.conv2d_backward(x, grad, weight, 1, 1),
                            cpu_kernels.conv2d_forward(x, weight, 1, 1)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][2], results[1][2])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-6)


def test_conv2d_backward_bad_arguments_name_what_is_wrong():
    x, w = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 3, 3)
    with pytest.raises(ValueError, match=r"gradient torch.float32 \(2, 2, 8, 7\) must be torch.float32 \(2, 2, 8, 8\)"):
        cpu_kernels.conv2d_backward(x, torch.randn(2, 2, 8, 7), w, 1, 1)
    with pytest.raises(ValueError, match=r"weight \(2, 4, 3, 3\) must be \(Co, 3, k, k\)"):
        cpu_kernels.conv2d_backward(x, torch.randn(2, 2, 8, 8), torch.randn(2, 4, 3, 3), 1, 1)
    with pytest.raises(ValueError, match=r"stride 3 \(1 or 2 allowed\) or padding 1"):
        cpu_kernels.conv2d_backward(x, torch.randn(2, 2, 3, 3), w, 3, 1)
    with pytest.raises(ValueError, match=r"padding 3 \(0 to 2 allowed for a 3x3 kernel, leaving an output\) on a 8x8"):
        cpu_kernels.conv2d_backward(x, torch.randn(2, 2, 12, 12), w, 1, 3)
    with pytest.raises(ValueError, match=r"the convolution input must be a contiguous CPU tensor"):
        cpu_kernels.conv2d_backward(x.transpose(2, 3), torch.randn(2, 2, 8, 8), w, 1, 1)
    with pytest.raises(ValueError, match=r"fp32 or bf16, got torch.float64"):
        cpu_kernels.conv2d_backward(x.double(), torch.randn(2, 2, 8, 8).double(), w, 1, 1)
    with pytest.raises(ValueError, match=r"gradient torch.bfloat16 \(2, 2, 8, 8\) must be torch.float32"):
        cpu_kernels.conv2d_backward(x, torch.randn(2, 2, 8, 8).bfloat16(), w, 1, 1)
    with pytest.raises(ValueError, match=r"weight \(2, 4, 3, 3\) must be \(Co, 3, k, k\)"):
        cpu_kernels.conv2d_forward(x, torch.randn(2, 4, 3, 3), 1, 1)
    with pytest.raises(ValueError, match=r"stride 2 \(1 or 2 allowed\) or padding 0 \(0 to 2 allowed for a 3x3 kernel, "
                                         r"leaving an output\) on a 2x2 input"):
        cpu_kernels.conv2d_forward(torch.randn(1, 3, 2, 2), w, 2, 0)
    with pytest.raises(ValueError, match=r"the convolution input must be a contiguous CPU tensor"):
        cpu_kernels.conv2d_forward(x.transpose(2, 3), w, 1, 1)


# ---------------------------------------------------------------------------------------- versions (ISA)
def _supported_versions() -> list[str]:
    top = cpu_kernels.limit_isa("avx512")
    return list(cpu_kernels.ISA_VERSIONS[: cpu_kernels.ISA_VERSIONS.index(top) + 1])


def _every_loop_once(seed: int) -> list[torch.Tensor]:
    """Every exported loop on odd sizes (tails of the 16 lanes and of the 8-float vectors), with NaN, infinities,
    -0 and values at 0 among the inputs; the outputs in a list."""
    g = torch.Generator().manual_seed(seed)

    def special(t: torch.Tensor) -> torch.Tensor:
        flat = t.view(-1)
        flat[:: 37] = 0.0
        flat[5:: 53] = -0.0
        flat[11:: 97] = float("nan")
        flat[13:: 101] = float("inf")
        flat[17:: 103] = float("-inf")
        return t

    out = []
    weight, rows = torch.randn(300, 45, generator=g), torch.randperm(300, generator=g)[:101].sort().values
    grad = torch.randn(101, 45, generator=g)
    buf = torch.randn(300, 45, generator=g)
    cpu_kernels.sgd_rows(weight, buf, grad, rows, 0.1, 0.9, 5e-4)
    exp_avg, exp_avg_sq = torch.randn(300, 45, generator=g), torch.rand(300, 45, generator=g)
    cpu_kernels.adamw_rows(weight, exp_avg, exp_avg_sq, grad, rows, torch.full((101,), -0.01),
                           torch.full((101,), 0.3), 0.01, (0.9, 0.999), 1e-8, 0.1)
    gathered, streamed = torch.empty(101, 45), torch.empty(101, 48)
    cpu_kernels.gather_rows(weight, rows, gathered)
    cpu_kernels.gather_rows(torch.randn(300, 48, generator=g), rows, streamed)
    normed, norms = torch.empty(101, 48), torch.empty(101, 2)
    cpu_kernels.gather_rows(special(torch.randn(300, 48, generator=g)), rows, normed, norms)
    row_norms = torch.empty(300)
    cpu_kernels.row_norms(special(torch.randn(300, 24, generator=g)), row_norms)
    out += [normed, norms, row_norms]
    scaled, scaled_streamed = torch.empty(101, 45), torch.empty(101, 48)
    cpu_kernels.scale_rows(special(torch.randn(101, 45, generator=g)), torch.randn(101, generator=g), scaled)
    cpu_kernels.scale_rows(special(torch.randn(101, 48, generator=g)), torch.randn(101, generator=g), scaled_streamed)
    out += [weight, buf, exp_avg, exp_avg_sq, gathered, streamed, scaled, scaled_streamed]

    batch, classes = 23, 301
    cos = special(torch.randn(batch, classes, generator=g))
    cos[3].fill_(float("nan"))  # one row wholly NaN, the others with a few
    inv_w, target = torch.rand(classes, generator=g) + 0.5, torch.randint(-1, classes, (batch,), generator=g)
    target_logit, row_max, row_sum = torch.randn(batch, generator=g) * 10, torch.empty(batch), torch.empty(batch)
    cpu_kernels.softmax_forward(cos, inv_w, 30.0, target_logit, target, row_max, row_sum)
    out += [cos.clone(), row_max, row_sum]
    dot_w, dot_e = torch.randn(classes, generator=g), torch.empty(batch)
    cpu_kernels.softmax_backward(cos, inv_w, 30.0, 1 / 3, target_logit, torch.rand(batch, generator=g), target,
                                 row_max, torch.full((batch,), 0.01), dot_w, dot_e)
    out += [cos, dot_w, dot_e]

    for dtype in (torch.float32, torch.bfloat16):
        x = special(torch.randn(3, 5, 11, 29, generator=g)).to(dtype)
        upstream = special(torch.randn(3, 5, 11, 29, generator=g)).to(dtype)
        out += list(cpu_kernels.prelu_backward(x, upstream, torch.rand(5, generator=g)))
        for k, stride in ((3, 1), (3, 2), (1, 2)):
            x = torch.randn(3, 2, 23, 37, generator=g).to(dtype)
            w = torch.randn(3, 2, k, k, generator=g)
            y = cpu_kernels.conv2d_forward(x, w, stride, k // 2)
            out += [y, *cpu_kernels.conv2d_backward(x, torch.randn(y.shape, generator=g).to(dtype), w, stride,
                                                    k // 2)]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def test_every_version_of_the_loops_gives_the_same_bits():
    """The AVX-512, AVX2 and baseline builds of each loop (those this CPU runs) agree bit for bit (NaN where NaN): a
    version that vectorises differently, or that a compiler builds wrong, fails here on any CPU that runs it."""
    versions = _supported_versions()
    if len(versions) < 2:
        pytest.skip(f"this CPU runs only the {versions[0]} loops: no other version to compare")
    try:
        results = {}
        for version in versions:
            assert cpu_kernels.limit_isa(version) == version and cpu_kernels.isa() == version
            results[version] = _every_loop_once(seed=8)
    finally:
        cpu_kernels.limit_isa("avx512")
    base = results["baseline"]
    assert any(t.isnan().any() for t in base) and all(t.numel() for t in base)
    for version in versions[1:]:
        for i, (a, b) in enumerate(zip(base, results[version])):
            assert a.dtype == b.dtype and a.shape == b.shape, i
            nan = a.isnan()  # a NaN's sign and payload are the CPU's (vector and scalar arithmetic differ)
            same = torch.equal(nan, b.isnan()) and torch.equal(_bits(a[~nan]), _bits(b[~nan]))
            assert same, f"output {i} of the {version} loops differs from the baseline's"


def test_the_version_is_capped_from_the_environment_and_a_bad_name_is_refused(fresh_cache, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_ISA, "baseline")
    assert cpu_kernels.isa() == "baseline"
    with pytest.raises(ValueError, match=r"limit_isa='sse9': the CPU loops' versions are baseline, avx2, avx512"):
        cpu_kernels.limit_isa("sse9")
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv(cpu_kernels.ENV_ISA, "avx3")
    with pytest.raises(ValueError, match=r"PFC_CPU_KERNELS_ISA='avx3': the CPU loops' versions are baseline"):
        cpu_kernels.library()
