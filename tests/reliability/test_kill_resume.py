"""A worker SIGKILLed mid-training: torchrun restarts the group, the trainer resumes by itself from the newest
complete checkpoint, and the final model equals an uninterrupted run's."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.local_ranks import free_port
from tests.helpers import CONFIG, ROOT, load_model, max_difference, subprocess_env
from utils.checkpoint import find_latest

# Checkpoints every 10 steps (the reference saves every 5; both keys are outside the fingerprint): about
# 2.5 s of training between two checkpoints, a wide window to kill a worker in.
KILLED_RUN = ("save_every_steps=10", "frequent=1")


def elastic_torchrun(nproc: int, max_restarts: int) -> list[str]:
    """torchrun with the c10d rendezvous, which gives every restart round a fresh key space.

    The static rendezvous (--master_addr/--master_port) keeps one store across restarts and its workers see
    the previous round's process-group keys: the restarted group then fails to connect (torch 2.x).
    """
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=reliability",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]


def children(pid: int) -> list[int]:
    """Direct child pids of ``pid`` from /proc (every thread's children file; no psutil)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended while we listed them
            continue
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkilled_worker_is_restarted_and_resumes_to_the_same_model(reference_run, tmp_path):
    output = tmp_path / "killed"
    cmd = [*elastic_torchrun(2, max_restarts=1), "train.py", CONFIG, "--set", f"output={output}", *KILLED_RUN]
    log = open(tmp_path / "torchrun.log", "w+")
    agent = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        while (first := find_latest(output)) is None:  # wait for the first complete checkpoint
            assert agent.poll() is None, f"torchrun exited {agent.returncode} before the first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 150 s"
            time.sleep(0.05)
        workers = [p for p in children(agent.pid) if "train.py" in cmdline(p)]
        assert len(workers) == 2, f"torchrun {agent.pid} has children {children(agent.pid)}"
        os.kill(workers[-1], signal.SIGKILL)
        killed_at = find_latest(output)
        assert killed_at is not None and int(killed_at.name[5:]) < 40, f"killed too late: after {killed_at}"
        agent.wait(timeout=200)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    log.seek(0)
    text = log.read()
    log.close()
    assert agent.returncode == 0, text[-4000:]
    resumed = [line for line in text.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, text[-4000:]
    step = int(resumed[0].split("step_")[1][:9])
    assert int(first.name[5:]) <= step < 40, resumed[0]
    assert max_difference(load_model(reference_run), load_model(output)) <= 1e-6
