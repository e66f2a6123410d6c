"""What every command-line tool shares: its two kinds of mistake, its exit codes, Ctrl-C and SIGTERM.

A tool's ``main(argv)`` parses its arguments (argparse exits 2 on a usage mistake) and hands the work to
``run_tool``, which turns whatever stops the work into one line on stderr (``<tool>: error: ...``) and the exit
status every tool documents:

    0    done (or the int the work returns, e.g. 1 when a check found problems)
    1    bad data: ``BadData``, and the error types a tool names in ``bad_data=``
    2    usage or configuration: ``UsageError``, any other ``ValueError``, an ``OSError``
    130  Ctrl-C;  143  SIGTERM (a scheduler, ``kill``), raised as ``Terminated`` so that it unwinds like Ctrl-C:
         ``finally`` blocks run, so staged files (``utils.files.staged``) are removed

Tools in ``scripts/`` are thin commands over library code; the library raises ``BadData`` / ``UsageError``
(or any ``ValueError``) and never exits, and says what it skipped through its logger, which ``tool_messages``
turns into the tool's lines on stderr; ``Progress`` is a bar on a terminal and a line every half minute in a log.
A tool imports this module first and its libraries inside ``quiet_interrupt``, so that Ctrl-C while they load
(torch alone takes seconds) is one line too: this module imports nothing heavy.
"""
from __future__ import annotations

import datetime
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from utils.logging_setup import one_line

EXIT_DONE, EXIT_BAD_DATA, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM


class BadData(ValueError):
    """The input data cannot serve (a bad file, inconsistent records, nothing usable): exit status 1."""


class UsageError(ValueError):
    """The command line or the configuration cannot work: exit status 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that it unwinds as Ctrl-C does (exit status 143)."""


def print_error(tool: str, exc: BaseException) -> None:
    """``<tool>: error: <one_line(exc)>`` on stderr: how every tool reports what stopped it."""

    print(f"{tool}: error: {one_line(exc)}", file=sys.stderr)


def warn(tool: str, message: str) -> None:
    """``<tool>: warning: <message>`` on stderr."""
    print(f"{tool}: warning: {message}", file=sys.stderr)


class _ToolLines(logging.Handler):
    """A log record as a tool's line on stderr, written past a progress bar (tqdm redraws it below)."""

    def __init__(self, tool: str) -> None:
        super().__init__(logging.INFO)
        self.tool = tool

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        said = "warning: " if record.levelno >= logging.WARNING else ""
        tqdm.write(f"{self.tool}: {said}{record.getMessage()}", file=sys.stderr)


@contextmanager
def tool_messages(tool: str, *packages: str) -> Iterator[None]:
    """While the block runs, what the library ``packages`` log at INFO and above is the tool's lines on stderr:
    ``<tool>: <message>``, and ``<tool>: warning: <message>`` for a warning. Their loggers are as before after."""
    handler = _ToolLines(tool)
    saved = []
    for name in packages:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers, logger.level, logger.propagate))
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, handlers, level, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)


@contextmanager
def quiet_interrupt(tool: str) -> Iterator[None]:
    """Around a tool's imports: Ctrl-C while they run ends the process with ``<tool>: interrupted`` on stderr and
    exit status 130, not a traceback through the import machinery. (Once ``run_tool`` runs the work, it says the
    same after the work has unwound.)"""
    try:
        yield
    except KeyboardInterrupt:
        print(f"{tool}: interrupted", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None


class Progress:
    """A tool's progress through ``total`` items: a tqdm bar when ``stream`` (stderr) is a terminal, otherwise (a
    log file, a pipe, a scheduler's output) a line every ``every`` seconds through ``log``: ``<done> of <total>
    <unit>, <rate> <unit>/s, <time> left``, and one at the end of a run that wrote any. ``initial`` items were done
    before (an interrupted run's): they count as done but not in the rate."""

    def __init__(self, total: int, unit: str, log: Callable[[str], None], initial: int = 0, every: float = 30.0,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        stream = sys.stderr if stream is None else stream
        self.total, self.unit, self.log, self.every, self.clock = total, unit, log, every, clock
        self.done = self.initial = initial
        self.start = self.last = clock()
        self.lines, self.said = 0, initial  # lines written, and the count the last one said
        self.bar = None
        if stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit=unit, file=stream)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.clock() - self.last >= self.every:
            self._line()

    def _line(self) -> None:
        self.last, self.lines, self.said = self.clock(), self.lines + 1, self.done
        rate = (self.done - self.initial) / max(self.last - self.start, 1e-9)
        left = f", {datetime.timedelta(seconds=round((self.total - self.done) / rate))} left" if rate > 0 else ""
        self.log(f"{self.done} of {self.total} {self.unit}, {rate:.1f} {self.unit}/s{left}")

    def close(self) -> None:
        """The bar's end, or the last line (after a run long enough to have written one, when it moved since)."""
        if self.bar is not None:
            self.bar.close()
        elif self.lines and self.done != self.said:
            self._line()


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def run_tool(tool: str, work: Callable[[], int | None], *, bad_data: tuple[type[BaseException], ...] = (),
             on_interrupt: Callable[[], str] | str = "") -> int:
    """Run ``work()`` and return the tool's exit status (module docstring). ``bad_data``: further error types
    that mean bad data (exit 1); ``on_interrupt``: what follows ``<tool>: interrupted`` after Ctrl-C or SIGTERM
    (e.g. ``"; nothing written"``), or a function that says it once the work has unwound. SIGTERM is turned
    into ``Terminated`` while ``work`` runs, when called from the main thread; the previous handler is put back.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        code = work()
        return EXIT_DONE if code is None else code
    except (BadData, *bad_data) as exc:
        print_error(tool, exc)
        return EXIT_BAD_DATA
    except (ValueError, OSError) as exc:
        print_error(tool, exc)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:  # what was staged is already gone; a traceback would add nothing
        said = on_interrupt() if callable(on_interrupt) else on_interrupt
        print(f"{tool}: interrupted{said}", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
