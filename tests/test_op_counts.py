"""The head's step is a fixed number of operations with at most two host reads, proven on CPU tensors.

One head step (forward, backward, optimizer update, zero_grad) must be the same aten operations whatever the
batch size and class count, reading the device on the host at most twice (the gathered batch sizes and label
checks; the number of positives, only when they can outnumber the sample). Every aten operation is counted by a
``TorchDispatchMode``, and every call that would wait for an accelerator (``item``, ``tolist``, ``bool()``,
``nonzero``, ``unique``, boolean-mask indexing, a blocking copy to the host, ...) by a ``TorchFunctionMode`` and at
the aten level, except inside ``utils.distributed.to_host``, the one named host read, whose calls are counted
separately. The same holds for every head variant (AdaFace, sub-centres, arcface_torch's update of every row).
The counts are those of torch 2.14 (``requirements.txt``); a release that splits or merges an operation changes
them, which is the time to look at the step again.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import partial_fc.sharding
import utils.distributed as du
from losses import AdaFace, ArcFace
from partial_fc import PartialFC, build_head_optimizer

pytestmark = pytest.mark.timeout(240)

D = 16
# Head variants: the keyword arguments of PartialFC besides its sizes.
HEADS = {
    "arcface": lambda: dict(margin_loss=ArcFace(s=16.0, margin=0.3)),
    "adaface": lambda: dict(margin_loss=AdaFace(s=16.0, gradient="exact")),
    "sub_centers": lambda: dict(margin_loss=ArcFace(s=16.0, margin=0.3), sub_centers=3),
    "update_all": lambda: dict(margin_loss=ArcFace(s=16.0, margin=0.3), update="all"),
}
# Aten operations of one head step (forward, backward, optimizer update, zero_grad; kernels, views and small index
# operations), measured on torch 2.14: {(head, optimizer, sampled): count}.
OPS = {
    ("arcface", "sgd", True): 190, ("arcface", "sgd", False): 125, ("arcface", "adamw", True): 210,
    ("arcface", "adamw", False): 140, ("adaface", "sgd", True): 241, ("adaface", "sgd", False): 176,
    ("sub_centers", "sgd", True): 202, ("sub_centers", "sgd", False): 137, ("update_all", "sgd", True): 173,
    ("update_all", "sgd", False): 125,
}
_HOST_READ_METHODS = {
    Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__, Tensor.numpy,
    Tensor.cpu, Tensor.nonzero, torch.nonzero, Tensor.unique, torch.unique, Tensor.unique_consecutive,
    torch.unique_consecutive, Tensor.masked_select, torch.masked_select, torch.argwhere, Tensor.argwhere,
}
_HOST_READ_OPS = {"nonzero", "_local_scalar_dense", "_coalesce", "masked_select", "_unique2", "unique_dim",
                  "unique_consecutive", "argwhere"}


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


def _step(batch: int, classes: int, rate: float, optimizer: str = "sgd", monkeypatch=None,
          head_kind: str = "arcface"):
    """One head step from fixed seeds, counted; returns (counter, host reads through to_host)."""
    torch.manual_seed(0)
    head = PartialFC(embedding_size=D, num_classes=classes, sample_rate=rate, **HEADS[head_kind]())
    # AdamW's first update is about lr·sign(g): lr at the recipes' 1e-3 keeps its rounding near 1e-6 too.
    lr = 0.1 if optimizer == "sgd" else 1e-3
    opt = build_head_optimizer(head, optimizer, lr=lr, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(batch, D, generator=g).requires_grad_()
    labels = torch.randint(0, classes, (batch,), generator=g)
    counter = _Count()
    reads = [0]
    real = du.to_host

    def counted(tensor: Tensor) -> list:
        reads[0] += 1
        counter.muted += 1
        try:
            return real(tensor)
        finally:
            counter.muted -= 1

    monkeypatch.setattr(du, "to_host", counted)
    monkeypatch.setattr(partial_fc.sharding, "to_host", counted)
    with _HostReads(counter), counter:
        loss = head(emb, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return counter, reads[0]


SIZES = ((64, 10_000), (1024, 10_000), (64, 100_000), (1024, 100_000))


@pytest.mark.parametrize("rate", [0.1, 1.0])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_head_step_is_a_fixed_number_of_operations_with_at_most_two_host_reads(rate, optimizer, monkeypatch):
    """ArcFace (the fused head) at 64 and 1,024 samples and 10k and 100k classes: the same operations, exactly the
    counts measured, no host read outside to_host, and the second read only where the positives can outnumber
    the sample (B = 1,024 > 0.1 · 10k)."""
    counts = {}
    for batch, classes in SIZES:
        counter, reads = _step(batch, classes, rate, optimizer, monkeypatch=monkeypatch)
        assert counter.host_reads == [], f"B={batch} C={classes}: host reads outside to_host: {counter.host_reads}"
        expected = 2 if rate < 1 and int(rate * classes) < batch else 1
        assert reads == expected, f"B={batch} C={classes}: {reads} host reads through to_host; expected {expected}"
        counts[batch, classes] = counter.ops
    first = counts[SIZES[0]]
    for key, ops in counts.items():
        assert ops == first, f"{key} differs from {SIZES[0]}: {sorted((ops - first) + (first - ops))}"
    assert sum(first.values()) == OPS["arcface", optimizer, rate < 1], sorted(first.items())


@pytest.mark.parametrize("rate", [0.1, 1.0])
@pytest.mark.parametrize("head_kind", ["adaface", "sub_centers", "update_all"])
def test_head_variants_are_a_fixed_number_of_operations(head_kind, rate, monkeypatch):
    """Smaller sizes than the ArcFace test (sub-centres triple the cosines); (512, 2000) at 0.1 takes the
    second host read (the positives can outnumber the sample)."""
    counts = {}
    for batch, classes in ((64, 2000), (512, 2000), (512, 20_000)):
        counter, reads = _step(batch, classes, rate, monkeypatch=monkeypatch, head_kind=head_kind)
        assert counter.host_reads == [], f"B={batch} C={classes}: host reads outside to_host: {counter.host_reads}"
        expected = 2 if rate < 1 and int(rate * classes) < batch else 1
        assert reads == expected, f"B={batch} C={classes}: {reads} host reads through to_host; expected {expected}"
        counts[batch, classes] = counter.ops
    first = counts[64, 2000]
    for key, ops in counts.items():
        assert ops == first, f"{key} differs from (64, 2000): {sorted((ops - first) + (first - ops))}"
    assert sum(first.values()) == OPS[head_kind, "sgd", rate < 1], sorted(first.items())
