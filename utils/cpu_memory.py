"""The C heap under CPU training: keep freed memory for reuse, or hand it back, through glibc's ``mallopt``.

Large tensors (the head's cosines, logits and gathered rows: tens of MB each, every step) are served by
glibc with a fresh ``mmap`` and unmapped when freed. The next step's tensor then pays a page fault per
4 KiB page when first written (about as long as one pass of arithmetic over it). ``keep_freed_memory``
raises glibc's mmap and trim thresholds so that such blocks come from the heap and stay there when freed:
the next step reuses warm pages. The resident set then stays at its high-water mark, which a training
process reaches on its first step anyway. On a C library without ``mallopt`` (not glibc) nothing changes.
"""
from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_LARGE = (1 << 31) - 1  # an int, as mallopt takes


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and keep freed memory there (glibc). Returns whether it took."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        logger.debug("no mallopt in this C library: the heap keeps its defaults")
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _LARGE)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _LARGE))
    if not ok:
        logger.debug("mallopt refused the thresholds: the heap keeps its defaults")
    return ok


def trim_heap() -> None:
    """Give freed heap memory back to the OS now (glibc ``malloc_trim``); a no-op elsewhere."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
