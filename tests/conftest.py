"""Test-suite set-up: torch uses one thread per process (pyproject.toml puts the repository root on sys.path).

Multi-process tests start 2-3 ranks on a 2-core machine; one intra-op thread each keeps them from
oversubscribing the cores.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
