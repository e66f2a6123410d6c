"""utils.distributed: helpers without a process group, differentiable all_gather on 1-3 gloo ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import gather, on_ranks
from utils import distributed as du

pytestmark = pytest.mark.timeout(120)

_SIZES = (3, 1, 4)  # per-rank first dimensions (uneven)
_D = 5


def _rank_input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(_SIZES[rank], _D, generator=g, dtype=torch.float64)


def _coeffs(total: int) -> torch.Tensor:
    return torch.randn(total, _D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _objective(full: torch.Tensor, rank: int) -> torch.Tensor:
    """A rank-dependent non-linear function of the concatenated tensor (each rank contributes its term)."""
    return ((full.sin() * _coeffs(full.shape[0])).sum() * (rank + 1)) + (full[rank] ** 3).sum()


def _gather_worker(rank: int, world: int) -> dict:
    x = _rank_input(rank).requires_grad_()
    pieces = gather(x)
    full = torch.cat(pieces)
    _objective(full, rank).backward()
    grad_ours = x.grad.clone()

    x.grad = None
    full_cat = du.all_gather_cat(x, grad_scale=2.5)
    _objective(full_cat, rank).backward()
    grad_scaled = x.grad.clone()

    x.grad = None
    grad_torch = None
    if len(set(_SIZES[:world])) == 1 or world == 1:
        import torch.distributed.nn.functional as dnn
        _objective(torch.cat(dnn.all_gather(x, group=dist.group.WORLD)), rank).backward()
        grad_torch = x.grad.clone()
    even = _even_torch_check(rank)
    # numpy arrays: torch tensors would travel through shared memory that dies with the worker process
    return dict(rank=du.get_rank(), world=du.get_world_size(), full=full.detach().numpy(),
                full_cat=full_cat.detach().numpy(), grad=grad_ours.numpy(), grad_scaled=grad_scaled.numpy(),
                grad_torch=None if grad_torch is None else grad_torch.numpy(), **even)


def _even_torch_check(rank: int) -> dict:
    """Equal sizes so that torch.distributed.nn.functional.all_gather applies."""
    import torch.distributed.nn.functional as dnn
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).requires_grad_()
    (torch.cat(gather(x)).cos() * (rank + 1)).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    (torch.cat(dnn.all_gather(x, group=dist.group.WORLD)).cos() * (rank + 1)).sum().backward()
    return dict(ours=ours.numpy(), theirs=x.grad.numpy())


def test_helpers_without_process_group():
    assert du.get_rank() == 0 and du.get_world_size() == 1 and not du.is_distributed()
    du.barrier()
    x = torch.randn(3, 2, requires_grad=True)
    assert torch.equal(gather(x)[0], x)
    y = du.all_gather_cat(x, grad_scale=3.0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3, 2), 3.0))
    assert du.all_gather_sizes([4, 5], "cpu") == [[4, 5]]


@pytest.mark.process
@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_gather_forward_backward_against_single_process(world):
    results = on_ranks(_gather_worker, world, timeout=90)
    inputs = [_rank_input(r).requires_grad_() for r in range(world)]
    full = torch.cat(inputs)
    # Single-process reference: the total objective is the sum of every rank's objective.
    sum(_objective(full, r) for r in range(world)).backward()
    for r, res in enumerate(results):
        assert res["rank"] == r and res["world"] == world
        torch.testing.assert_close(torch.from_numpy(res["full"]), full.detach())
        torch.testing.assert_close(torch.from_numpy(res["full_cat"]), full.detach())
        torch.testing.assert_close(torch.from_numpy(res["grad"]), inputs[r].grad)
        torch.testing.assert_close(torch.from_numpy(res["grad_scaled"]), 2.5 * inputs[r].grad)
        if res["grad_torch"] is not None:
            torch.testing.assert_close(torch.from_numpy(res["grad"]), torch.from_numpy(res["grad_torch"]))
        # equal sizes: the same gradients as torch.distributed.nn.functional.all_gather
        torch.testing.assert_close(torch.from_numpy(res["ours"]), torch.from_numpy(res["theirs"]))



class _StartsEarly(torch.autograd.Function):
    """A consumer of the gathered tensor that starts its reduce-scatter before the rest of its backward."""

    @staticmethod
    def forward(ctx, full, early):
        ctx.save_for_backward(full)
        ctx.early = early
        return full.sin()

    @staticmethod
    def backward(ctx, grad):
        (full,) = ctx.saved_tensors
        grad_full = grad * full.cos()
        if ctx.early is not None:
            ctx.early.start(grad_full)
        return grad_full, None


def _early_worker(rank: int, world: int) -> dict:
    calls = []
    real = du._reduce_scatter_into
    du._reduce_scatter_into = lambda *a, **k: (calls.append(bool(k.get("async_op"))), real(*a, **k))[1]
    coeffs = _coeffs(sum(_SIZES[:world]))
    grads = {}
    for case in ("plain", "early", "early_and_elsewhere"):
        x = _rank_input(rank).requires_grad_()
        early = du.EarlyGradient() if case != "plain" else None
        full = du.all_gather_cat(x, grad_scale=2.5, early=early)
        loss = (_StartsEarly.apply(full, early) * coeffs).sum() * (rank + 1)
        if case == "early_and_elsewhere":
            loss = loss + (full ** 3).sum()  # a second consumer: autograd sums two gradients for the gather
        loss.backward()
        grads[case] = x.grad.numpy()
        grads[case + "_calls"] = list(calls)
        calls.clear()
        assert early is None or early.pending is None
    du._reduce_scatter_into = real
    return grads


@pytest.mark.process
@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_early_reduce_scatter_gives_the_gather_s_gradient(world):
    """The consumer's early start is used when it is the gather's whole gradient (one asynchronous collective,
    no other); with a second consumer the early one is completed and dropped, and the summed gradient is
    reduced instead. Uneven sizes; against one process."""
    results = on_ranks(_early_worker, world, timeout=90)
    inputs = [_rank_input(r).requires_grad_() for r in range(world)]
    full = torch.cat(inputs)
    sum(((full.sin() * _coeffs(full.shape[0])).sum() * (r + 1)) for r in range(world)).backward()
    one_consumer = [2.5 * t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    full = torch.cat(inputs)
    sum(((full.sin() * _coeffs(full.shape[0])).sum() * (r + 1)) + (full ** 3).sum() for r in range(world)).backward()
    two_consumers = [2.5 * t.grad for t in inputs]
    for r, res in enumerate(results):
        torch.testing.assert_close(torch.from_numpy(res["plain"]), one_consumer[r])
        torch.testing.assert_close(torch.from_numpy(res["early"]), one_consumer[r])
        torch.testing.assert_close(torch.from_numpy(res["early_and_elsewhere"]), two_consumers[r])
        if world == 1:
            assert res["plain_calls"] == res["early_calls"] == res["early_and_elsewhere_calls"] == []
        else:
            assert res["plain_calls"] == [False] and res["early_calls"] == [True]
            assert res["early_and_elsewhere_calls"] == [True, False]


def test_pick_device_auto_cpu_and_cuda(monkeypatch):
    # README (`device`): "auto" takes CUDA when there is one (this rank's GPU, LOCAL_RANK), else the CPU;
    # "cuda" without CUDA is one clear error.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert du.pick_device("auto") == du.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device = 'cuda' but torch.cuda.is_available\(\) is False .*'cpu' or 'auto'"):
        du.pick_device("cuda")
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert du.pick_device("auto") == du.pick_device("cuda") == torch.device("cuda", 3) and chosen == [3, 3]
    assert du.pick_device("cpu") == torch.device("cpu")


def test_pick_device_for_a_tool_takes_cuda_n_and_leaves_the_current_device(monkeypatch):
    # prepare_faces --device: auto, cpu, cuda or cuda:N, without binding LOCAL_RANK; errors name the flag.
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert du.pick_device("auto", bind_local_rank=False, name="--device") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^--device cuda:1 but torch.cuda.is_available\(\) is False on this machine; "
                                         r"use --device cpu or auto$"):
        du.pick_device("cuda:1", bind_local_rank=False, name="--device")
    with pytest.raises(ValueError, match=r"^--device tpu: expected auto, cpu, cuda or cuda:N$"):
        du.pick_device("tpu", bind_local_rank=False, name="--device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert du.pick_device("auto", bind_local_rank=False) == du.pick_device("cuda", bind_local_rank=False) \
        == torch.device("cuda")
    assert du.pick_device("cuda:1", bind_local_rank=False) == torch.device("cuda", 1) and chosen == []
    assert du.pick_device("cuda:1") == torch.device("cuda", 1) and chosen == [1]


def test_init_process_group_takes_the_configured_timeout(monkeypatch):
    # README (`dist_timeout_minutes`): how long a collective may wait before the job fails, passed to the group.
    import datetime

    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    du.init_process_group(torch.device("cpu"), 7)
    assert calls == []  # a plain `python train.py` launch: no process group
    monkeypatch.setenv("WORLD_SIZE", "1")
    du.init_process_group(torch.device("cpu"), 7)
    assert calls == [{"backend": "gloo", "init_method": "env://", "timeout": datetime.timedelta(minutes=7)}]
