"""One run per output folder: ``<output>/run.lock`` names the run that trains there.

Rank 0 takes the lock before anything looks at the checkpoints (``hold_output``) and every rank learns the
outcome: a second start in a folder where a run trains stops with one line naming that run. The file (JSON) names
the host, the process (pid, and its start time against pid reuse), the start, the command, the torchrun job
(``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``) and a heartbeat a thread refreshes every ``HEARTBEAT_S``
seconds. A lock is taken over, with one line, when its run is gone: on this machine when its process has ended;
from another when it names an earlier round of this torchrun job, or its heartbeat is older than ``STALE_S``.
Released when the run ends. The rules users see: docs/checkpoints.md#a-folder-belongs-to-one-run.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from utils.distributed import gather_lines
from utils.files import atomic_write

LOCK_FILE = "run.lock"
HEARTBEAT_S = 10.0  # how often the holder refreshes the lock
STALE_S = 120.0  # a lock on another machine not refreshed for this long belongs to a run that is gone
_UNNAMED_JOB = (None, "", "none")  # torchrun's default --rdzv-id names no job


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time in clock ticks since boot)`` of process ``pid`` from /proc, or None when it does not
    exist (or there is no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_run() -> dict[str, Any]:
    """The lock's content for this process."""
    now, stat = time.time(), _proc_stat(os.getpid())
    return {"host": socket.gethostname(), "pid_namespace": _pid_namespace(), "pid": os.getpid(),
            "process_start": stat[1] if stat else None, "started": now, "heartbeat": now,
            "command": " ".join(sys.argv)[:300], "job": os.environ.get("TORCHELASTIC_RUN_ID"),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}


def _same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("host", "pid_namespace", "pid", "process_start"))


def _running_here(held: dict[str, Any]) -> bool:
    """Whether the process the lock names (on this machine) still runs: not ended, not a zombie, not another
    process that reused its pid."""
    stat = _proc_stat(int(held["pid"]))
    if stat is None:
        if Path("/proc/self/stat").exists():
            return False
        try:  # no /proc: ask the kernel
            os.kill(int(held["pid"]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state, start = stat
    return state != "Z" and (held.get("process_start") is None or start == held["process_start"])


def describe(held: dict[str, Any]) -> str:
    """``the run `train.py configs/x` started 2024-05-01 10:00:00 on node3 (pid 4242, torchrun job j1)``."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(held.get("started", 0))))
    job = f", torchrun job {held['job']}" if held.get("job") not in _UNNAMED_JOB else ""
    return f"the run `{held.get('command')}` started {started} on {held.get('host')} (pid {held.get('pid')}{job})"


def _here(held: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the lock was taken on this machine: its processes are ours to see."""
    return held.get("host") == me["host"] and held.get("pid_namespace") == me["pid_namespace"]


def verdict(held: dict[str, Any], me: dict[str, Any], now: float, stale_s: float = STALE_S) -> tuple[bool, str]:
    """``(whether me may take a lock that held names, why)``: ``me`` and ``held`` are ``this_run()`` records."""
    if "unreadable" in held:
        return True, held["unreadable"]
    age = now - float(held.get("heartbeat", 0))
    if _same_process(held, me):
        return True, "this process holds it"
    here = _here(held, me)
    if here and not _running_here(held):
        return True, f"{describe(held)} is gone"
    if not here and held.get("job") not in _UNNAMED_JOB and held.get("job") == me["job"] \
            and int(held.get("restart", 0)) < me["restart"]:
        return True, f"{describe(held)} is round {held.get('restart', 0)} of this torchrun job, now restarted"
    if not here and age > stale_s:
        return True, f"{describe(held)} has not refreshed it for {age:.0f} s"
    return False, f"{describe(held)} trains there (its lock was refreshed {max(age, 0):.0f} s ago)"


class OutputLock:
    """``<output>/run.lock`` held by this process, refreshed by a heartbeat thread until ``release``."""

    def __init__(self, output: str | os.PathLike, logger: logging.Logger, heartbeat_s: float = HEARTBEAT_S):
        self.path, self.logger, self.heartbeat_s = Path(output) / LOCK_FILE, logger, heartbeat_s
        self.record = this_run()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, Any] | None:
        """The lock's content; None when there is none. One being written is read again until it parses."""
        for _ in range(50):
            try:
                held = json.loads(self.path.read_text())
                if isinstance(held, dict) and "pid" in held:
                    return held
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        try:
            content: Any = self.path.read_bytes()[:80]
        except FileNotFoundError:
            return None
        except OSError as exc:
            content = exc
        return {"unreadable": f"it does not hold a lock ({content!r})"}

    def _write(self) -> None:
        atomic_write(self.path, lambda f: f.write(json.dumps(self.record, indent=1).encode()))

    def _create(self) -> bool:
        """Create the lock holding this run's record unless a lock exists (atomic: a hard link of a complete
        file). True when created."""
        mine = self.path.with_name(f"{LOCK_FILE}.{self.record['pid']}")
        atomic_write(mine, lambda f: f.write(json.dumps(self.record, indent=1).encode()))
        try:
            os.link(mine, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: an exclusive create (readers retry until it parses)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(mine.read_bytes())
                f.flush()
                os.fsync(f.fileno())
            return True
        finally:
            mine.unlink(missing_ok=True)

    def acquire(self, stale_s: float = STALE_S) -> OutputLock:
        """Take the lock (module docstring) or raise ``ValueError`` naming the run that holds it. A restarted
        rank 0 (torchrun restart count > 0) that finds a lock of another machine waits up to ``stale_s`` for it
        to go stale."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + stale_s + 2 * self.heartbeat_s
        while not self._create():
            held = self._read()
            if held is None:  # released meanwhile
                continue
            free, why = verdict(held, self.record, time.time(), stale_s)
            if free:
                self._write()
                if not _same_process(self._read() or {}, self.record):  # another start took it over first
                    continue
                self.logger.warning("took over %s: %s", self.path, why)
                break
            if _here(held, self.record) or self.record["restart"] == 0 or time.monotonic() >= deadline:
                raise ValueError(f"output {self.path.parent} is in use: {why}; wait for that run to end or stop it, "
                                 f"or use another `output` (the lock of a run that is gone is taken over by itself)")
            time.sleep(1.0)
        self._thread = threading.Thread(target=self._beat, name="output-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            held = self._read()
            if held is None or not _same_process(held, self.record):
                self.logger.error("%s no longer names this run (%s): another start took the folder over",
                                  self.path, describe(held) if held else "removed")
                return
            self.record["heartbeat"] = time.time()
            try:
                self._write()
            except OSError as exc:  # a full disk or a file server's hiccup: the next beat tries again
                self.logger.warning("could not refresh %s: %s", self.path, exc)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it still names this run."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        held = self._read() if self.path.exists() else None
        if held is not None and _same_process(held, self.record):
            self.path.unlink(missing_ok=True)


def hold_output(output: str | os.PathLike, rank: int, logger: logging.Logger) -> OutputLock | None:
    """Rank 0 takes ``<output>/run.lock`` (the lock, returned; None on other ranks); every rank learns whether it
    could, and raises the same ``ValueError`` when not."""
    lock, problem = None, None
    if rank == 0:
        try:
            lock = OutputLock(output, logger).acquire()
        except ValueError as exc:
            problem = str(exc)
        except OSError as exc:
            problem = f"output {output}: cannot hold the folder for this run ({exc})"
    lines = gather_lines([problem] if problem else [])
    if lines:
        raise ValueError(lines[0])
    return lock
