"""The process group, every collective of the project, and the autograd Functions built on them.

``pick_device`` and ``init_process_group`` set up a rank as torchrun describes it (``bench.local_ranks`` starts
local ranks for the benchmarks and tests). Without a process group every helper is the one-process identity
(``get_rank() == 0``, ``get_world_size() == 1``, gathers return their input), so the same code runs in one
process, under torchrun with gloo on CPUs, and with NCCL on GPUs (tensors stay on their device).

Gradient convention of the head (``partial_fc``): every rank computes the same loss, the mean over the global
batch, through its own shard of class centres. The gradient of rank r's local embeddings is the sum over ranks of
their partial gradients for the gathered batch: a reduce-scatter(sum). DDP then averages the backbone's gradients
over the W ranks where the true gradient is their sum (each rank back-propagates a disjoint slice of the batch),
so the head multiplies its embeddings' gradient by W (``all_gather_cat(..., grad_scale=W)``). Dividing by W
instead, as a widely copied "differentiable all_gather" does, makes every gradient W² too small after DDP.
"""
from __future__ import annotations

import datetime
import inspect
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "EarlyGradient", "all_gather_cat", "all_gather_sizes", "all_reduce", "barrier", "broadcast_ints",
    "collective_device", "gather_lines", "get_rank", "get_world_size", "init_process_group", "is_distributed",
    "pick_device", "to_host", "wrap_ddp",
]

logger = logging.getLogger(__name__)

# torch 2.14 renamed these collectives (the old names warn); earlier releases have only the old ones.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ------------------------------------------------------------------------------------------------ set-up

def pick_device(requested: str, bind_local_rank: bool = True, name: str = "device") -> torch.device:
    """The device ``requested`` names: "auto" (CUDA when available, else the CPU), "cpu", "cuda" or "cuda:N".

    ``bind_local_rank`` (a training rank): "auto" and "cuda" mean ``cuda:LOCAL_RANK`` (torchrun's GPU for this
    rank, 0 without torchrun), made the current device; without it (a tool) they mean the current CUDA device,
    and nothing is changed. ``name`` is how errors name the setting: ``device`` (a config key, ``device =
    'cuda'``) or a flag such as ``--device`` (``--device cuda``). A ``ValueError`` for anything else, and for
    CUDA on a machine without it.
    """
    flag = name.startswith("-")
    said = f"{name} {requested}" if flag else f"{name} = {requested!r}"
    try:
        device = torch.device("cuda" if requested == "auto" else requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{said}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{said} but torch.cuda.is_available() is False on this machine; use "
                         + (f"{name} cpu or auto" if flag else f"{name} = 'cpu' or 'auto'"))
    if device.index is None and not bind_local_rank:
        return device
    index = int(os.environ.get("LOCAL_RANK", "0")) if device.index is None else device.index
    if bind_local_rank:
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_process_group(device: torch.device, timeout_minutes: float) -> None:
    """Join the process group torchrun describes (env://), also a 1-rank one, so that a launch through torchrun
    always runs the collectives' real code; a plain ``python`` launch stays without a process group.

    NCCL on CUDA (bound to this rank's GPU at once), gloo on the CPU.
    """
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    bound = {"device_id": device} if device.type == "cuda" else {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout, **bound)
        return
    # Under torchrun the store can outlive a restart (the agent's store serves every round). A restarted
    # group that reads the previous round's keys makes gloo connect to the dead ranks' addresses and fail,
    # so every attempt gets its own key space.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent_store, timeout=timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"facetrain/attempt_{attempt}", store),
                            rank=rank, world_size=world_size, timeout=timeout, **bound)


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.parallel.DistributedDataParallel:
    """DDP over ``model``: gradients live in DDP's buckets (no second copy), and each rank keeps its own
    batch-norm running statistics between steps, as the reference does (rank 0's are saved)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    kwargs: dict[str, Any] = {"device_ids": [device.index] if device.type == "cuda" else None,
                              "gradient_as_bucket_view": True}
    # torch 2.14 renamed broadcast_buffers (now deprecated, with a warning); earlier releases know only it.
    if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:
        kwargs["forward_sync_buffers"] = False
    else:
        kwargs["broadcast_buffers"] = False
    return ddp(model, **kwargs)


# ------------------------------------------------------------------------------------------------ collectives

def is_distributed() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of ranks; 1 without a process group."""
    return dist.get_world_size() if is_distributed() else 1


def collective_device() -> torch.device:
    """Where small tensors for a collective live: this rank's GPU under NCCL, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait for every rank; a no-op without a process group."""
    if get_world_size() > 1:
        dist.barrier()


def all_reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    """In-place all-reduce of ``tensor`` (same shape on every rank); returns it. Not differentiable."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def gather_lines(lines: list[str]) -> list[str]:
    """Every rank's ``lines``, in rank order, on every rank (a few messages, e.g. the files a rank could not
    read; pickled by torch.distributed between this job's own processes). ``lines`` itself without a group."""
    if get_world_size() == 1:
        return list(lines)
    gathered: list[list[str] | None] = [None] * get_world_size()
    dist.all_gather_object(gathered, list(lines))
    return [line for rank_lines in gathered for line in (rank_lines or [])]


def broadcast_ints(values: Sequence[int], device: torch.device | str) -> list[int]:
    """Rank 0's ``values`` on every rank (each rank passes a list of the same length); a decision that every
    rank must take the same way. The identity without a process group."""
    if get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.int64).to(device)  # (k,)
    dist.broadcast(tensor, src=0)
    return to_host(tensor)


def to_host(tensor: Tensor) -> list:
    """``tensor.tolist()``. On an accelerator, reading a tensor on the host waits for every queued kernel:
    a host-device synchronisation. The training step reads the device only through here, so that its
    synchronisations are few, named, and counted by the tests."""
    return tensor.tolist()


def all_gather_sizes(counts: Sequence[int] | Tensor, device: torch.device | str) -> list[list[int]]:
    """Gather a few integers per rank: returns ``W`` lists of ``len(counts)`` ints, in rank order, on the host.

    ``counts`` (host integers, or an int64 tensor already on ``device``) must have the same length on
    every rank. Used to learn each rank's batch size before a gather of tensors whose first dimension
    differs between ranks. Reading the result is one host-device synchronisation (``to_host``); host
    integers travel to the device without one (``non_blocking``).
    """
    if isinstance(counts, Tensor):
        local = counts.reshape(-1)  # (k,)
    else:
        local = torch.tensor(list(counts), dtype=torch.int64).to(device, non_blocking=True)  # (k,)
    world = get_world_size()
    if world == 1:
        return [to_host(local)]
    out = torch.empty(world * local.numel(), dtype=torch.int64, device=device)  # (W*k,)
    _all_gather_into(out, local)
    return to_host(out.view(world, -1))


def _reduce_scatter_rows(grad: Tensor, sizes: tuple[int, ...], async_op: bool = False) -> tuple[Tensor, Tensor, Any]:
    """Reduce-scatter(sum) of ``grad (Σ n_r, *S)`` (the gathered output's gradient), laid out as ``W`` blocks of
    ``max n_r`` rows (zeros after each rank's rows): ``(out (max n, *S), the padded input, the work handle)``;
    with ``async_op`` the collective may still be running (the caller keeps the input alive until it waits)."""
    longest = max(sizes)
    padded = grad.contiguous()
    if any(n != longest for n in sizes):
        padded = grad.new_zeros((len(sizes) * longest, *grad.shape[1:]))  # (W·max n, *S)
        offset = 0
        for r, n in enumerate(sizes):
            padded[r * longest: r * longest + n] = grad[offset: offset + n]
            offset += n
    out = padded.new_empty((longest, *padded.shape[1:]))  # (max n, *S)
    return out, padded, _reduce_scatter_into(out, padded, async_op=async_op)


class EarlyGradient:
    """Lets the one consumer of ``all_gather_cat``'s output start its backward's reduce-scatter early.

    Autograd runs the gather's backward only after the consumer's whole backward, and the reduce-scatter then
    waits for the slowest rank. A consumer that has its input's gradient first (the head: the embeddings' before
    the weight's) calls ``start(grad)``, which launches the reduce-scatter asynchronously (gloo's threads on a CPU,
    NCCL's stream on a GPU); the gather's backward then only waits for it. When autograd hands that backward
    another tensor (the output was also used elsewhere), it completes the early one, drops it and reduces what it
    got, so every rank runs the same collectives. Without a process group, or with one rank, ``start`` does
    nothing.
    """

    def __init__(self) -> None:
        self.sizes: tuple[int, ...] | None = None  # set by the gather's forward (W > 1)
        self.pending: tuple[Tensor, Tensor, Tensor, Any] | None = None  # (started gradient, the output, its
        # padded rows, the collective's work handle); the gradient is held, so autograd cannot add into it

    def start(self, grad: Tensor) -> None:
        """Launch the reduce-scatter of ``grad`` (the gathered output's whole gradient); returns at once."""
        if self.sizes is None or self.pending is not None:
            return
        self.pending = (grad, *_reduce_scatter_rows(grad, self.sizes, async_op=True))

    def finish(self, grad: Tensor) -> Tensor | None:
        """The reduce-scatter started for ``grad``, completed; None when none was started or another
        gradient was (which is then completed and dropped)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        started, out, _padded, work = pending
        work.wait()
        return out if grad is started else None


class _AllGatherCat(torch.autograd.Function):
    """Concatenate every rank's tensor along dim 0; backward is reduce-scatter(sum).

    Shapes per rank: input ``x_r`` is ``(n_r, *S)`` (``n_r`` may differ between ranks, ``S`` may not);
    output ``(N, *S)`` with ``N = Σ_r n_r``, identical on every rank.
    Forward: ``y = cat(x_0, …, x_{W-1})`` (padded to ``max n_r`` for the collective, then trimmed).
    Backward: ``∂L/∂x_r = grad_scale · Σ_q (∂L_q/∂y)[offset_r : offset_r + n_r]`` where ``∂L_q/∂y`` is
    the gradient arriving on rank q: a reduce-scatter(sum), the dual of the gather (NCCL has it; gloo
    on the CPU since torch 2.14, the release CI pins). Padded rows cost
    ``(max n_r − n_r)·|S|`` extra bytes per rank when sizes differ. ``grad_scale`` compensates DDP's
    averaging (module docstring). With an ``EarlyGradient`` the consumer may have started the
    reduce-scatter already; the backward then waits for it.
    """

    @staticmethod
    def forward(ctx, x: Tensor, sizes: tuple[int, ...], grad_scale: float, early: EarlyGradient | None) -> Tensor:
        world, rank = get_world_size(), get_rank()
        assert len(sizes) == world and sizes[rank] == x.shape[0], f"sizes {sizes} vs local {tuple(x.shape)}"
        ctx.sizes, ctx.grad_scale, ctx.early = sizes, grad_scale, early
        if early is not None:
            early.sizes = sizes
        longest = max(sizes)
        x = x.contiguous()
        if x.shape[0] < longest:
            x = torch.cat([x, x.new_zeros((longest - x.shape[0], *x.shape[1:]))])  # (max n, *S)
        gathered = x.new_empty((world * longest, *x.shape[1:]))  # (W·max n, *S)
        _all_gather_into(gathered, x)
        if all(n == longest for n in sizes):
            return gathered
        return torch.cat([gathered[r * longest: r * longest + n] for r, n in enumerate(sizes)])  # (N, *S)

    @staticmethod
    def backward(ctx, grad: Tensor):
        sizes, rank = ctx.sizes, get_rank()
        out = ctx.early.finish(grad) if ctx.early is not None else None
        if out is None:
            out = _reduce_scatter_rows(grad, sizes)[0]
        out = out[: sizes[rank]]  # (n_rank, *S)
        if ctx.grad_scale != 1.0:
            out.mul_(ctx.grad_scale)
        return out, None, None, None


def all_gather_cat(tensor: Tensor, grad_scale: float = 1.0, sizes: Sequence[int] | None = None,
                   early: EarlyGradient | None = None) -> Tensor:
    """Differentiable concatenation of every rank's ``tensor`` along dim 0 (first dims may differ).

    ``sizes`` (each rank's first dimension, from ``all_gather_sizes``) saves one small collective when
    known. Backward: reduce-scatter(sum) of the incoming gradients, times ``grad_scale``; the output's one
    consumer may start it early through ``early`` (``EarlyGradient``). With one rank this returns ``tensor``
    itself (scaled in backward if ``grad_scale != 1``).
    """
    world = get_world_size()
    if sizes is None:
        sizes = [n for n, in all_gather_sizes([tensor.shape[0]], tensor.device)] if world > 1 else [tensor.shape[0]]
    if world == 1:
        return _ScaleGrad.apply(tensor, grad_scale) if grad_scale != 1.0 else tensor
    return _AllGatherCat.apply(tensor, tuple(int(n) for n in sizes), float(grad_scale), early)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale`` (the one-rank ``grad_scale``)."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None
