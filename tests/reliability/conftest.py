"""Shared trainer runs for the reliability tests.

One uninterrupted 2-rank run of configs/debug_cpu.py (40 steps, a checkpoint every 5, all kept) is the
reference that the kill, crash and world-size tests compare against or resume from; it runs once per session.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import CONFIG, REFERENCE, train


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """output folder of an uninterrupted 2-rank, 40-step run (model.pt, checkpoints every 5 steps)."""
    output = tmp_path_factory.mktemp("reference") / "run"
    train(CONFIG, output, *REFERENCE, nproc=2)
    return output
