"""tests/helpers.py's in-process runs (``run_main``, ``train_here``) answer as the process would: exit status,
stdout and stderr (Python's warnings under a fresh interpreter's filters, an uncaught exception as a traceback),
and leave the loggers a tool configures as they were."""
from __future__ import annotations

import logging
import sys
import warnings

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
