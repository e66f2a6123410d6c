"""trainer.output_lock: one run per output folder. A second start while a run trains is one line and exit 2; a lock
whose run is gone (this machine: its process ended; another machine: its heartbeat stopped; an earlier round of the
same torchrun job) is taken over with one line; the lock is refreshed while the run trains and released at its end.

The restarts torchrun makes itself: tests/reliability/test_kill_resume.py keeps passing with the lock in place."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from bench.local_ranks import run_on_local_ranks
from tests.helpers import CONFIG, ROOT, subprocess_env, train
from trainer.output_lock import LOCK_FILE, OutputLock, hold_output, this_run
from utils.checkpoint import list_checkpoints

LOGGER = logging.getLogger("test.output_lock")


def write_lock(output, **fields) -> dict:
    """A lock as another run wrote it: this process's record with ``fields`` changed."""
    held = {**this_run(), **fields}
    output.mkdir(parents=True, exist_ok=True)
    (output / LOCK_FILE).write_text(json.dumps(held))
    return held


@pytest.fixture
def sleeper():
    """A live process of this machine, as a run that holds the folder."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _start_time(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]


def test_a_run_takes_refreshes_and_releases_the_lock(tmp_path):
    lock = OutputLock(tmp_path, LOGGER, heartbeat_s=0.05).acquire()
    held = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (held["pid"], held["host"]) == (os.getpid(), this_run()["host"]) and held["command"]
    time.sleep(0.3)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"] > held["heartbeat"]  # refreshed
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists() and sorted(os.listdir(tmp_path)) == []


@pytest.mark.process
def test_a_second_start_while_a_run_trains_here_is_refused_naming_it(tmp_path, sleeper):
    held = write_lock(tmp_path, pid=sleeper.pid, process_start=_start_time(sleeper.pid), command="train.py first")
    with pytest.raises(ValueError) as refused:
        OutputLock(tmp_path, LOGGER).acquire()
    line = str(refused.value)
    assert line.startswith(f"output {tmp_path} is in use: the run `") and "\n" not in line
    assert "the run `train.py first` started " in line and f"on {held['host']} (pid {sleeper.pid}) trains there" \
        in line, line
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == held  # untouched


@pytest.mark.process
def test_a_lock_whose_process_is_gone_is_taken_over_with_one_line(tmp_path, caplog):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_lock(tmp_path, pid=int(gone.stdout), command="train.py killed")
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        lock = OutputLock(tmp_path, LOGGER).acquire()
    lock.release()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "the run `train.py killed` started" in lines[0], lines
    assert f"(pid {int(gone.stdout)}) is gone" in lines[0], lines


@pytest.mark.process
def test_a_reused_pid_is_not_the_run_that_held_the_lock(tmp_path, sleeper):
    write_lock(tmp_path, pid=sleeper.pid, process_start="1")  # the pid now names a process started later
    OutputLock(tmp_path, LOGGER).acquire().release()


def test_another_machine_s_lock_is_taken_over_when_its_heartbeat_stopped(tmp_path, caplog):
    write_lock(tmp_path, host="node7", pid=1, heartbeat=time.time() - 1000)
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        OutputLock(tmp_path, LOGGER).acquire().release()
    assert "has not refreshed it for 1000 s" in caplog.records[0].getMessage()
    write_lock(tmp_path, host="node7", pid=1, heartbeat=time.time() - 5)
    with pytest.raises(ValueError, match=r"on node7 \(pid 1\) trains there \(its lock was refreshed 5 s ago\)"):
        OutputLock(tmp_path, LOGGER).acquire()


def test_torchrun_s_restart_takes_over_its_previous_round_on_another_node(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    write_lock(tmp_path, host="node7", pid=1, job="job1", restart=1)  # fresh: the round stopped a moment ago
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        OutputLock(tmp_path, LOGGER).acquire().release()
    assert "torchrun job job1" in caplog.records[0].getMessage() and "round 1 of this torchrun job" in \
        caplog.records[0].getMessage()
    # Another job's lock on another node (or an unnamed job's): a restarted rank 0 waits for its heartbeat to stop,
    # then takes it over; while it is refreshed, the folder is refused.
    write_lock(tmp_path, host="node7", pid=1, job="job2", restart=1)
    start = time.monotonic()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        OutputLock(tmp_path, LOGGER, heartbeat_s=0.1).acquire(stale_s=1.0).release()
    assert time.monotonic() - start >= 1.0 and "has not refreshed it for 1 s" in caplog.records[0].getMessage()
    stop = threading.Event()

    def beat() -> None:  # the other node's run, alive
        while not stop.wait(0.1):
            write_lock(tmp_path, host="node7", pid=1, job="job2", restart=1)

    write_lock(tmp_path, host="node7", pid=1, job="job2", restart=1)
    refresher = threading.Thread(target=beat)
    refresher.start()
    try:
        with pytest.raises(ValueError, match="trains there"):
            OutputLock(tmp_path, LOGGER, heartbeat_s=0.1).acquire(stale_s=1.0)
    finally:
        stop.set()
        refresher.join()


def _hold(rank: int, world_size: int, output: str) -> str:
    try:
        lock = hold_output(output, rank, LOGGER)
    except ValueError as exc:
        return f"refused: {exc}"
    if lock is not None:
        lock.release()
    return "held"


@pytest.mark.process
@pytest.mark.timeout(120)
def test_every_rank_learns_that_the_folder_is_held(tmp_path, sleeper):
    write_lock(tmp_path, pid=sleeper.pid, process_start=_start_time(sleeper.pid))
    outcomes = run_on_local_ranks(_hold, 2, str(tmp_path), timeout=90)
    assert outcomes[0] == outcomes[1] and outcomes[0].startswith("refused: output "), outcomes
    (tmp_path / LOCK_FILE).unlink()
    assert run_on_local_ranks(_hold, 2, str(tmp_path), timeout=90) == ["held", "held"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_train_py_in_a_folder_where_one_trains_exits_2_naming_it(tmp_path):
    output = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "train.py", CONFIG, "--set", f"output={output}", "max_steps=100000",
                              "frequent=1"], cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list_checkpoints(output):  # training, and past its first checkpoint
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.2)
        second = train(CONFIG, output, "max_steps=100000", check=False)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stdout[-2000:] + second.stderr[-2000:]
        assert f"output {output} is in use: the run `train.py {CONFIG} --set output={output} " in lines[0], lines
        assert f"(pid {first.pid}) trains there" in lines[0], lines
        assert "resumed from" not in second.stdout and first.poll() is None  # the first one trains on
        assert json.loads((output / LOCK_FILE).read_text())["pid"] == first.pid
    finally:
        first.terminate()
        first.communicate(timeout=60)
    # A killed run leaves its lock; the next start takes it over with one line and continues its checkpoints.
    assert json.loads((output / LOCK_FILE).read_text())["pid"] == first.pid
    proc = train(CONFIG, output, "max_steps=1", "--resume")  # past its end already: resumes, trains no step
    took = [line for line in proc.stdout.splitlines() if "took over" in line]
    assert len(took) == 1 and f"(pid {first.pid}) is gone" in took[0], proc.stdout[-2000:]
    assert "resumed from" in proc.stdout and not (output / LOCK_FILE).exists()
