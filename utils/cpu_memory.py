"""The C heap under CPU training (glibc): transparent huge pages for large tensors, and trimming.

A fresh multi-megabyte tensor costs a page fault per 4 KiB page when first written; the head allocates
several per step (gathered rows, cosines, logits: tens of MB each), which made a CPU head step ~30% slower
than the same step writing into reused buffers. With the glibc tunable ``glibc.malloc.hugetlb=1`` malloc asks
the kernel for transparent huge pages (2 MiB, ``madvise`` mode), and the faults nearly vanish. A tunable is
read when a process starts, so it is set in the environment of the processes to come: ``huge_pages_env``
(``bench/head.py`` sets it for its ranks, ``scripts/demo.py`` and ``scripts/run.sh`` for torchrun's).
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def huge_pages_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with glibc's huge-page tunable added to GLIBC_TUNABLES."""
    env = dict(os.environ if env is None else env)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        tunables.append(HUGE_PAGES_TUNABLE)
    env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env


def trim_heap() -> None:
    """Give freed heap memory back to the OS now (glibc ``malloc_trim``); a no-op on other C libraries."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
