"""N local ranks of a function, for the benchmarks and the tests (training itself is launched by torchrun).

``run_on_local_ranks(fn, N, *args)`` spawns N processes that join a gloo (or NCCL) group on 127.0.0.1 through a
port the OS picked (``free_port``), calls ``fn(rank, N, *args)`` on each and returns the results by rank, or
raises with the failing rank's traceback, or after a timeout. ``LocalRanks(N).run(fn, *args)`` does the same on N
ranks spawned once and kept for the next call (a process group of its own each time): for a test suite's many
small functions, where starting the processes costs more than the function.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["LocalRanks", "free_port", "run_on_local_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, args: tuple,
                     results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickled here, by value: a tensor put on a torch.multiprocessing queue is shared through a file
        # descriptor that dies with this process, which exits right after.
        results.put((rank, True, pickle.dumps(result)))
    except BaseException:  # reported to the parent, which raises with it
        results.put((rank, False, traceback.format_exc()))


def _collect(fn: Callable[..., Any], world_size: int, results, timeout: float) -> list[Any]:
    """Every rank's result from ``results`` (in rank order), or ``RuntimeError`` with the first failing rank's
    traceback, or after ``timeout`` seconds without a result."""
    by_rank: dict[int, Any] = {}
    for _ in range(world_size):
        try:
            rank, ok, value = results.get(timeout=timeout)
        except queue_module.Empty as exc:  # some rank hung or died without reporting
            raise RuntimeError(f"{fn.__name__} on {world_size} local ranks: no result within {timeout:.0f}s "
                               f"(got ranks {sorted(by_rank)})") from exc
        if not ok:
            raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
        by_rank[rank] = pickle.loads(value)
    return [by_rank[r] for r in range(world_size)]


def _stop(procs: list) -> None:
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def run_on_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                       timeout: float = 180.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` local ranks spawned for this call (``LocalRanks``,
    closed after it); return the results by rank.

    For benchmarks and tests (training is launched by torchrun). ``fn`` must be importable (a module-level
    function) and its arguments and result picklable. Every call gets its own free port. Raises
    ``RuntimeError`` with the failing rank's traceback, or after ``timeout`` seconds without a result.
    """
    ranks = LocalRanks(world_size, backend)
    try:
        return ranks.run(fn, *args, timeout=timeout)
    finally:
        ranks.close()


def _serve(rank: int, world_size: int, backend: str, inbox, results, parent: int) -> None:
    """A rank of ``LocalRanks``: each job ``(fn, port, args)`` from ``inbox`` in a process group of its own and the
    environment it started with, until ``None`` comes or the parent process is gone."""
    environ = dict(os.environ)
    while True:
        try:
            job = inbox.get(timeout=5)
        except queue_module.Empty:
            if os.getppid() != parent:  # the parent died without saying so: do not outlive it
                return
            continue
        if job is None:
            return
        fn, port, args = job
        _local_rank_main(fn, rank, world_size, port, backend, args, results)
        os.environ.clear()
        os.environ.update(environ)


class LocalRanks:
    """``world_size`` local ranks spawned at the first ``run`` and kept: ``run(fn, *args)`` returns what
    ``run_on_local_ranks(fn, world_size, *args)`` returns, without starting processes. Each call joins a process
    group of its own (a free port) and starts from the environment the ranks started with; what else a function
    leaves in its process (module state, torch's random generator, a warning already shown) the next call finds, so
    a result that needs a fresh process (a peak of memory, a first warning) comes from ``run_on_local_ranks``. A call
    that fails or times out stops the ranks (the next call spawns new ones); ``close`` stops them."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size, self.backend = world_size, backend
        self._procs: list = []
        self._inboxes: list = []

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
        if not self._procs:
            ctx = mp.get_context("spawn")
            self._results, self._inboxes = ctx.Queue(), [ctx.Queue() for _ in range(self.world_size)]
            self._procs = [ctx.Process(target=_serve, args=(r, self.world_size, self.backend, self._inboxes[r],
                                                            self._results, os.getpid()))
                           for r in range(self.world_size)]
            for p in self._procs:
                p.start()
        port = free_port()
        for inbox in self._inboxes:
            inbox.put((fn, port, args))
        try:
            return _collect(fn, self.world_size, self._results, timeout)
        except BaseException:  # a rank may still be in the failed call's collectives: these ranks serve no other
            for p in self._procs:
                p.kill()
            self.close()
            raise

    def close(self) -> None:
        """Stop the ranks (they finish the call they are in)."""
        for p, inbox in zip(self._procs, self._inboxes):
            if p.is_alive():
                inbox.put(None)
        _stop(self._procs)
        self._procs = []
