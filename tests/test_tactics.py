"""The head's device tactics, proven on CPU tensors.

``fixed_ops`` (what the head uses on accelerators) must make one head step (forward, backward, optimizer
update) a fixed number of operations whatever the batch size and class count, reading the device on the
host at most twice (the gathered batch sizes and label checks; the number of positives, only when they
can outnumber the sample); ``row_blocks`` (the CPU's) must give the same values. The counters run the accelerator tactic on CPU tensors: every aten operation is counted by a
``TorchDispatchMode``, and every call that would wait for an accelerator (``item``, ``tolist``,
``bool()``, ``nonzero``, ``unique``, boolean-mask indexing, a blocking copy to the host, ...) by a
``TorchFunctionMode`` and at the aten level, except inside ``utils.distributed.to_host``, the one named
host read, whose calls are counted separately. The same holds for every head variant (AdaFace, sub-centres,
arcface_torch's update of every row).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import partial_fc
import utils.distributed as du
from losses import AdaFace, ArcFace
from partial_fc import PartialFC, build_head_optimizer

pytestmark = pytest.mark.timeout(240)

D = 16
# Budget of aten operations for one head step (forward, backward, optimizer update, zero_grad) with the
# fixed_ops tactic (measured on torch 2.14: 220 sampled, 157 dense; kernels, views and small index ops).
OP_BUDGET = 240
# Head variants: the keyword arguments of PartialFC besides its sizes.
HEADS = {
    "arcface": lambda: dict(margin_loss=ArcFace(s=16.0, margin=0.3)),
    "adaface": lambda: dict(margin_loss=AdaFace(s=16.0, gradient="exact")),
    "sub_centers": lambda: dict(margin_loss=ArcFace(s=16.0, margin=0.3), sub_centers=3),
    "update_all": lambda: dict(margin_loss=ArcFace(s=16.0, margin=0.3), update="all"),
}
# Budget of the variants with SGD (measured on torch 2.14, sampled: AdaFace 261, sub-centres 222, update "all" 204).
VARIANT_OP_BUDGET = 270
_HOST_READ_METHODS = {
    Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__, Tensor.numpy,
    Tensor.cpu, Tensor.nonzero, torch.nonzero, Tensor.unique, torch.unique, Tensor.unique_consecutive,
    torch.unique_consecutive, Tensor.masked_select, torch.masked_select, torch.argwhere, Tensor.argwhere,
}
_HOST_READ_OPS = {"nonzero", "_local_scalar_dense", "_coalesce", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
                  "argwhere"}


class _Count(TorchDispatchMode):
    """Counts aten operations, and the ones that read the device on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.host_reads: list[str] = []
        self.muted = 0  # inside to_host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        bool_index = name == "index" and any(isinstance(i, Tensor) and i.dtype == torch.bool for i in args[1])
        if not self.muted and (name in _HOST_READ_OPS or bool_index):
            self.host_reads.append(f"aten.{name}")
        return func(*args, **kwargs)


class _HostReads(TorchFunctionMode):
    """Python-level calls that would wait for an accelerator."""

    def __init__(self, count: _Count) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.count.muted:
            blocking_to_host = func is Tensor.to and not kwargs.get("non_blocking", False) and any(
                str(a) == "cpu" for a in list(args[1:]) + [kwargs.get("device")])
            if func in _HOST_READ_METHODS or blocking_to_host:
                self.count.host_reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def _step(batch: int, classes: int, rate: float, tactic: str, optimizer: str = "sgd",
          count: bool = False, monkeypatch=None, head_kind: str = "arcface"):
    """One head step from fixed seeds; returns (loss, embedding grad, weight after, optimizer state, counter)."""
    torch.manual_seed(0)
    head = PartialFC(embedding_size=D, num_classes=classes, sample_rate=rate, tactic=tactic, **HEADS[head_kind]())
    # AdamW's first update is about lr·sign(g): lr at the recipes' 1e-3 keeps its rounding near 1e-6 too.
    lr = 0.1 if optimizer == "sgd" else 1e-3
    opt = build_head_optimizer(head, optimizer, lr=lr, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(batch, D, generator=g).requires_grad_()
    labels = torch.randint(0, classes, (batch,), generator=g)
    counter = _Count()
    reads = [0]
    if count:
        real = du.to_host

        def counted(tensor: Tensor) -> list:
            reads[0] += 1
            counter.muted += 1
            try:
                return real(tensor)
            finally:
                counter.muted -= 1

        monkeypatch.setattr(du, "to_host", counted)
        monkeypatch.setattr(partial_fc, "to_host", counted)
        with _HostReads(counter), counter:
            loss = head(emb, labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        loss = head(emb, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {k: v.clone() for k, v in opt.state[head.weight].items()}
    return loss.detach(), emb.grad, head.weight.detach().clone(), state, counter, reads[0]


@pytest.mark.parametrize("rate", [0.1, 1.0])
def test_fixed_ops_step_is_a_fixed_number_of_operations_with_at_most_two_host_reads(rate, monkeypatch):
    counts = {}
    for batch in (64, 1024):
        for classes in (10_000, 100_000):
            *_, counter, reads = _step(batch, classes, rate, "fixed_ops", count=True, monkeypatch=monkeypatch)
            assert counter.host_reads == [], f"B={batch} C={classes}: host reads outside to_host: {counter.host_reads}"
            # The second read only where the positives can outnumber the sample (B=1024 > 0.1 * 10k).
            expected = 2 if rate < 1 and int(rate * classes) < batch else 1
            assert reads == expected, f"B={batch} C={classes}: {reads} host reads through to_host; expected {expected}"
            counts[batch, classes] = counter.ops
    totals = {key: sum(ops.values()) for key, ops in counts.items()}
    first = counts[64, 10_000]
    for key, ops in counts.items():
        assert ops == first, f"{key} differs from (64, 10000): {sorted((ops - first) + (first - ops))}"
    assert max(totals.values()) <= OP_BUDGET, totals


@pytest.mark.parametrize("rate", [0.1, 1.0])
@pytest.mark.parametrize("head_kind", ["adaface", "sub_centers", "update_all"])
def test_fixed_ops_head_variants_are_a_fixed_number_of_operations(head_kind, rate, monkeypatch):
    """Smaller sizes than the ArcFace test (sub-centres triple the cosines); (512, 2000) at 0.1 takes the
    second host read (the positives can outnumber the sample)."""
    counts = {}
    for batch, classes in ((64, 2000), (512, 2000), (512, 20_000)):
        *_, counter, reads = _step(batch, classes, rate, "fixed_ops", count=True, monkeypatch=monkeypatch,
                                   head_kind=head_kind)
        assert counter.host_reads == [], f"B={batch} C={classes}: host reads outside to_host: {counter.host_reads}"
        expected = 2 if rate < 1 and int(rate * classes) < batch else 1
        assert reads == expected, f"B={batch} C={classes}: {reads} host reads through to_host; expected {expected}"
        counts[batch, classes] = counter.ops
    first = counts[64, 2000]
    for key, ops in counts.items():
        assert ops == first, f"{key} differs from (64, 2000): {sorted((ops - first) + (first - ops))}"
    assert sum(first.values()) <= VARIANT_OP_BUDGET, sum(first.values())


def test_fixed_ops_adamw_count_does_not_depend_on_classes(monkeypatch):
    a = _step(64, 10_000, 0.1, "fixed_ops", "adamw", count=True, monkeypatch=monkeypatch)[4].ops
    b = _step(1024, 100_000, 0.1, "fixed_ops", "adamw", count=True, monkeypatch=monkeypatch)[4].ops
    assert a == b and sum(a.values()) <= OP_BUDGET + 20, (sum(a.values()), sorted((a - b) + (b - a)))


def test_row_blocks_uses_blocks_on_large_steps(monkeypatch):
    # The CPU tactic really is another computation: with torch's operations, more of them for a larger step;
    # with the compiled kernels (utils.cpu_kernels) the row loops leave torch, and far fewer operations remain.
    from utils import cpu_kernels

    compiled = _step(1024, 100_000, 1.0, "row_blocks", count=True, monkeypatch=monkeypatch)[4].ops
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    small = _step(64, 10_000, 1.0, "row_blocks", count=True, monkeypatch=monkeypatch)[4].ops
    large = _step(1024, 100_000, 1.0, "row_blocks", count=True, monkeypatch=monkeypatch)[4].ops
    assert sum(large.values()) > sum(small.values())
    assert sum(compiled.values()) < sum(small.values()) < sum(large.values())
    assert "exp_" in small and "exp_" not in compiled


@pytest.mark.parametrize("rate", [0.1, 1.0])
@pytest.mark.parametrize("head_kind, batch, classes", [("arcface", 1024, 30_000), ("adaface", 512, 10_000),
                                                       ("sub_centers", 512, 10_000), ("update_all", 512, 10_000)])
def test_fixed_ops_head_equals_row_blocks(head_kind, batch, classes, rate):
    """Loss to 2e-7 relative (a unit or two in its last place: on the CPU the fused margin-softmax's row passes
    are compiled, with their own exp and sums) and both gradients to 1e-6."""
    results = {}
    for tactic in ("fixed_ops", "row_blocks"):
        torch.manual_seed(0)
        head = PartialFC(embedding_size=D, num_classes=classes, sample_rate=rate, tactic=tactic, **HEADS[head_kind]())
        g = torch.Generator().manual_seed(1)
        emb = torch.randn(batch, D, generator=g).mul_(torch.rand(batch, 1, generator=g) * 10).requires_grad_()
        loss = head(emb, torch.randint(0, classes, (batch,), generator=g))
        loss.backward()
        grad = head.weight.grad.to_dense() if head.weight.grad.is_sparse else head.weight.grad
        results[tactic] = (loss.detach(), emb.grad, grad)
    fixed, blocks = results["fixed_ops"], results["row_blocks"]
    assert abs(float(fixed[0]) - float(blocks[0])) <= 2e-7 * abs(float(fixed[0]))
    torch.testing.assert_close(fixed[1], blocks[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fixed[2], blocks[2], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kernels", ["torch", "compiled"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("sparse", [True, False])
def test_fixed_ops_optimizer_equals_row_blocks(optimizer, sparse, kernels, monkeypatch):
    """The same gradient (3000 rows: several row chunks) gives the same update and state with both tactics:
    to the bit with row_blocks' chunked torch operations, and with its compiled kernels for SGD; AdamW's
    kernel rounds its square root correctly where torch's CPU sqrt may not, so it agrees to rounding."""
    from partial_fc import RowSparseAdamW, RowSparseSGD
    from utils import cpu_kernels

    if kernels == "torch":
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert (cpu_kernels.library() is not None) == (kernels == "compiled")

    make = {"sgd": lambda p, t: RowSparseSGD([p], lr=0.1, tactic=t),
            "adamw": lambda p, t: RowSparseAdamW([p], lr=0.01, tactic=t)}[optimizer]
    g = torch.Generator().manual_seed(2)
    start, grad = torch.randn(5000, D, generator=g), torch.randn(3000, D, generator=g)
    rows = torch.randperm(5000, generator=g)[:3000].sort().values
    out = {}
    for tactic in ("fixed_ops", "row_blocks"):
        weight = torch.nn.Parameter(start.clone())
        opt = make(weight, tactic)
        for _ in range(2):
            if sparse:
                weight.grad = torch.sparse_coo_tensor(rows[None], grad, weight.shape,
                                                          check_invariants=True).coalesce()
            else:
                weight.grad = torch.zeros_like(weight).index_copy_(0, rows, grad)
            opt.step()
        out[tactic] = (weight.detach(), opt.state[weight])
    if kernels == "compiled" and optimizer == "adamw":
        torch.testing.assert_close(out["fixed_ops"][0], out["row_blocks"][0], rtol=1e-6, atol=1e-7)
        for k in out["fixed_ops"][1]:
            torch.testing.assert_close(out["fixed_ops"][1][k], out["row_blocks"][1][k], rtol=1e-6, atol=1e-9)
        assert not torch.equal(out["fixed_ops"][0], out["row_blocks"][0])  # the kernel really ran
        return
    assert torch.equal(out["fixed_ops"][0], out["row_blocks"][0])
    assert all(torch.equal(out["fixed_ops"][1][k], out["row_blocks"][1][k]) for k in out["fixed_ops"][1])


def test_auto_tactic_follows_the_device():
    assert du.resolve_tactic("auto", "cpu") == "row_blocks"
    assert du.resolve_tactic("auto", "cuda") == "fixed_ops"
    assert du.resolve_tactic("auto", "meta") == "fixed_ops"
    with pytest.raises(ValueError, match="tactic='gpu' is unknown"):
        PartialFC(ArcFace(), D, 10, tactic="gpu")
