"""N local ranks of a function, for the benchmarks and the tests (training itself is launched by torchrun).

``run_on_local_ranks(fn, N, *args)`` spawns N processes that join a gloo (or NCCL) group on 127.0.0.1 through a
port the OS picked (``free_port``), calls ``fn(rank, N, *args)`` on each and returns the results by rank, or
raises with the failing rank's traceback, or after a timeout.
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

__all__ = ["free_port", "run_on_local_ranks"]


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


def run_on_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                       timeout: float = 180.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned local ranks; return the results by rank.

    For benchmarks and tests (training is launched by torchrun). ``fn`` must be importable (a module-level
    function) and its arguments and result picklable. Every call gets its own free port. Raises
    ``RuntimeError`` with the failing rank's traceback, or after ``timeout`` seconds without a result.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_local_rank_main, args=(fn, r, world_size, port, backend, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    by_rank: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue_module.Empty as exc:  # some rank hung or died without reporting
                raise RuntimeError(f"{fn.__name__} on {world_size} local ranks: no result within {timeout:.0f}s "
                                   f"(got ranks {sorted(by_rank)})") from exc
            if not ok:
                errors.append(f"rank {rank}:\n{value}")
                break
            by_rank[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError(f"{fn.__name__} failed on " + "\n".join(errors))
    return [by_rank[r] for r in range(world_size)]
