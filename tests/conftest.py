"""Test-suite set-up: torch uses one thread per process (pyproject.toml puts the repository root on sys.path), and
the session's shared fixtures.

Multi-process tests start 2-3 ranks on a 2-core machine; one intra-op thread each keeps them from
oversubscribing the cores.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def finetune_data(tmp_path_factory):
    """The fine-tuning recipe's pre-trained model and data (tests/finetune_data.py), read by test_finetune.py and
    test_import_onnx.py: {"pretrained": model.pt, "tuning": the rec folder, "held_out": held_out.bin}. Read only."""
    from tests.finetune_data import make_finetune_data

    return make_finetune_data(tmp_path_factory.mktemp("finetune_data"))
