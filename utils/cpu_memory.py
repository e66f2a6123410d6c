"""The C heap under training processes (glibc): huge pages for large tensors, freed memory kept, and trimming.

A fresh multi-megabyte tensor costs a page fault per 4 KiB page when first written; the head allocates
several per step (gathered rows, cosines, logits: tens of MB each), which made a CPU head step ~30% slower
than the same step writing into reused buffers. With the glibc tunable ``glibc.malloc.hugetlb=1`` malloc asks
the kernel for transparent huge pages (2 MiB, ``madvise`` mode), and the faults become rarer. glibc still
maps every allocation over 32 MiB anew and unmaps it when it is freed, so a CPU step still pays for zeroing
fresh pages every step (at sample rate 1 the head's 1 GiB weight gradient alone). ``KEEP_FREED_TUNABLES``
(``glibc.malloc.mmap_max=0``: large blocks come from the heap too; ``glibc.malloc.trim_threshold`` of 1 TiB: the
heap is not shrunk when its top is freed) keep freed memory in the process for the next step, as torch's
caching allocator does for GPU memory: 15% off a CPU head step at sample rate 1 (6.29 s against 5.38 s,
1M classes on 2 ranks) and ~5% at 0.1, with the same peak memory. Only CPU training gets them: a GPU rank's
host memory (a checkpoint read before it moves to the device) is better given back.

A tunable is read when a process starts, so it is set in the environment of the processes to come:
``heap_env`` (``bench/head.py`` for its ranks, ``scripts/demo.py`` for torchrun's; ``scripts/run.sh`` sets the
same tunables in the shell, and ``tests/test_launch_scripts.py`` holds the two to each other).
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
KEEP_FREED_TUNABLES = ("glibc.malloc.mmap_max=0", "glibc.malloc.trim_threshold=1099511627776")


def heap_env(env: Mapping[str, str] | None = None, *, keep_freed: bool) -> dict[str, str]:
    """``env`` (default: this process's environment) with glibc's huge-page tunable, and with ``keep_freed`` (CPU
    training) ``KEEP_FREED_TUNABLES``, added to GLIBC_TUNABLES; a tunable the environment already sets is left
    as it is."""
    env = dict(os.environ if env is None else env)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    for tunable in (HUGE_PAGES_TUNABLE, *(KEEP_FREED_TUNABLES if keep_freed else ())):
        name = tunable.split("=")[0] + "="
        if not any(t.startswith(name) for t in tunables):
            tunables.append(tunable)
    env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env


def trim_heap() -> None:
    """Give freed heap memory back to the OS now (glibc ``malloc_trim``); a no-op on other C libraries."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
