"""tests/helpers.py's in-process runs (``run_main``, ``train_here``) answer as the process would: exit status,
stdout and stderr (Python's warnings under a fresh interpreter's filters, an uncaught exception as a traceback),
and leave the loggers a tool configures as they were; the session's local ranks (``on_ranks``) are kept between
calls, each call in a process group and an environment of its own."""
from __future__ import annotations

import logging
import sys
import warnings

import pytest

from tests.helpers import CONFIG, run_main, train_here


def test_run_main_gives_the_exit_status_streams_warnings_and_tracebacks_of_a_process():
    def tool(argv):
        print("out", argv[0])
        print("err", file=sys.stderr)
        warnings.warn("shown", UserWarning, stacklevel=1)
        warnings.warn("hidden", DeprecationWarning, stacklevel=1)  # a fresh interpreter ignores it outside __main__
        if argv[0] == "raise":
            raise RuntimeError("boom")
        if argv[0] == "exit":
            sys.exit(argv[1] if len(argv) > 1 else 3)
        return int(argv[0])

    done = run_main(tool, ["0"], "tool.py")
    assert (done.args, done.returncode, done.stdout) == (["tool.py", "0"], 0, "out 0\n")
    assert done.stderr.startswith("err\n") and "UserWarning: shown" in done.stderr and "hidden" not in done.stderr
    assert run_main(tool, ["7"], "tool.py").returncode == 7
    raised = run_main(tool, ["raise"], "tool.py")
    assert raised.returncode == 1 and "Traceback" in raised.stderr and "RuntimeError: boom" in raised.stderr
    assert run_main(tool, ["exit"], "tool.py").returncode == 3
    said = run_main(tool, ["exit", "why"], "tool.py")
    assert said.returncode == 1 and said.stderr.endswith("why\n")


def test_train_here_says_what_the_process_says_and_puts_the_loggers_back(tmp_path, caplog):
    from utils.logging_setup import LIBRARY_PACKAGES, LOGGER_NAME

    loggers = [logging.getLogger(name) for name in (LOGGER_NAME, *LIBRARY_PACKAGES)]
    before = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    here = train_here(CONFIG, tmp_path / "here", "max_steps=1", "frequent=1")
    assert "step 1/1" in here.stdout and (tmp_path / "here" / "model.pt").is_file()
    assert [(lg.handlers, lg.level, lg.propagate) for lg in loggers] == before
    with caplog.at_level(logging.INFO, logger="dataset"):
        logging.getLogger("dataset.x").info("still reaches pytest")
    assert "still reaches pytest" in caplog.text
    # tests/test_train.py compares a mistake's exit status and line with a real `python train.py`.


def _pid_group_and_variable(rank: int, world_size: int, name: str) -> tuple[int, int, str | None]:
    import os

    import torch.distributed as dist

    seen = os.environ.get(name)
    os.environ[name] = "set by a call"
    return os.getpid(), dist.get_world_size(), seen


def _rank_one_fails(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails")
    return rank


@pytest.mark.process
def test_local_ranks_are_kept_between_calls_each_in_a_group_and_environment_of_its_own():
    """bench.local_ranks.LocalRanks, behind tests.helpers.on_ranks: the same processes answer the next call, in a
    process group of its own and the environment they started with; a failing call raises with its traceback and
    the next call runs on new ranks."""
    from bench.local_ranks import LocalRanks

    ranks = LocalRanks(2)
    try:
        first, second = (ranks.run(_pid_group_and_variable, "FACETRAIN_PROBE") for _ in range(2))
        assert [pid for pid, _, _ in first] == [pid for pid, _, _ in second]
        assert [(world, seen) for _, world, seen in first + second] == [(2, None)] * 4
        with pytest.raises(RuntimeError, match="(?s)_rank_one_fails failed on rank 1:.*ValueError: rank 1 fails"):
            ranks.run(_rank_one_fails)
        third = ranks.run(_pid_group_and_variable, "FACETRAIN_PROBE")
        assert {pid for pid, _, _ in third}.isdisjoint(pid for pid, _, _ in first)
    finally:
        ranks.close()
