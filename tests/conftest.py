"""Test-suite set-up: torch uses one thread per process (pyproject.toml puts the repository root on sys.path), a
test that starts a process says so, and the session's shared fixtures.

Multi-process tests start 2-3 ranks on a 2-core machine; one intra-op thread each keeps them from
oversubscribing the cores. A test that starts a process (a tool's command line, torchrun, spawned ranks, loader
workers, inductor's compile workers) is marked ``process`` or ``slow``, which ``make test-fast`` leaves out; there,
a test without either mark fails where it would start one, naming the mark. ``make test`` runs the files on two
pytest-xdist workers, a file's tests (and the files that read one shared run) in one worker.
"""
from __future__ import annotations

import functools
import multiprocessing.process
import os
import subprocess

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

PROCESS_MARKS = ("process", "slow")  # pyproject.toml declares them; `make test-fast` deselects both
_running: list[pytest.Item] = []  # the test being set up, run or torn down


def _only_if_marked(start):
    """``start`` (what every new process goes through), refused to a test that is not marked as starting one."""
    @functools.wraps(start)
    def guarded(*args, **kwargs):
        if _running and not any(_running[0].get_closest_marker(mark) for mark in PROCESS_MARKS):
            pytest.fail(f"{_running[0].nodeid} starts a process: mark it @pytest.mark.process (or slow, if it trains); "
                        "make test-fast leaves those out", pytrace=False)
        return start(*args, **kwargs)
    return guarded


def pytest_configure(config):
    """The guard is on where the processes are left out (``-m "not slow and not process"``: make test-fast)."""
    if "not process" in (config.getoption("markexpr") or ""):
        subprocess.Popen._execute_child = _only_if_marked(subprocess.Popen._execute_child)
        multiprocessing.process.BaseProcess.start = _only_if_marked(multiprocessing.process.BaseProcess.start)


# Session fixtures holding a run that tests of several files read: make test's workers (pytest-xdist, --dist
# loadgroup) run those files in one worker, so that the run is made once.
SHARED_RUNS = ("reference_run", "finetune_data")


def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        # One group per file (its module fixtures are computed once), merged where files share a session run.
        shared = {item.path: run for item in items for run in SHARED_RUNS if run in item.fixturenames}
        for item in items:
            item.add_marker(pytest.mark.xdist_group(shared.get(item.path, str(item.path))))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running[:] = [item]
    yield
    _running.clear()


@pytest.fixture(scope="session")
def finetune_data(tmp_path_factory):
    """The fine-tuning recipe's pre-trained model and data (tests/finetune_data.py), read by test_finetune.py and
    test_import_onnx.py: {"pretrained": model.pt, "tuning": the rec folder, "held_out": held_out.bin}. Read only."""
    from tests.finetune_data import make_finetune_data

    return make_finetune_data(tmp_path_factory.mktemp("finetune_data"))
