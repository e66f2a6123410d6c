"""Test-suite set-up: the repository root is importable and torch uses one thread per process.

Multi-process tests start 2-3 ranks on a 2-core machine; one intra-op thread each keeps them from
oversubscribing the cores.
"""
from __future__ import annotations

import os
import sys

from _paths import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
