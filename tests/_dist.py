"""Run a function on N gloo ranks in spawned processes and collect what each rank returns.

Every call gets its own free port (bound to port 0 by the OS, never a fixed number) and a timeout,
so a hung collective fails the test instead of hanging the suite.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world_size: int, port: int, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickled here, by value: a tensor put on a torch.multiprocessing queue is shared through a file
        # descriptor that dies with this process, which exits right after.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # reported to the parent, which fails the test with it
        queue.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    ``fn`` must be importable (a module-level function) and its arguments and result picklable.
    Raises ``RuntimeError`` with the rank's traceback when any rank fails, or after ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except queue_module.Empty as exc:  # some rank hung or died without reporting
                raise RuntimeError(f"distributed run of {fn.__name__} on {world_size} ranks: no result "
                                   f"within {timeout:.0f}s (got ranks {sorted(results)})") from exc
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError(f"distributed run of {fn.__name__} failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]
