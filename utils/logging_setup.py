"""One logger for the trainer: rank 0 writes to the console and to ``<output>/training.log``; and its
progress lines (``ProgressLog``).

Other ranks log warnings and errors only, to the console, prefixed with their rank, so a failure on any
rank is still visible but the normal log is written once.
"""
from __future__ import annotations

import datetime
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: tools import one_line without loading torch
    import torch

LOGGER_NAME = "facetrain"
_FORMAT = "%(asctime)s %(levelname)s %(message)s"


# The project's packages whose module loggers log as the trainer's (rank 0 only, into training.log).
LIBRARY_PACKAGES = ("alignment", "backbones", "dataset", "eval", "losses", "partial_fc", "photos", "trainer", "utils")

def setup_logging(rank: int, output: str | Path | None) -> logging.Logger:
    """Configure and return the project logger for this rank (idempotent: handlers are replaced)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = False
    console = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    if rank == 0:
        logger.setLevel(logging.INFO)
        # Progress to stdout, errors to stderr (a failed job's one line is where shells and schedulers look).
        console.addFilter(lambda record: record.levelno < logging.ERROR)
        errors = logging.StreamHandler(sys.stderr)
        errors.setLevel(logging.ERROR)
        for handler in (console, errors):
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
            logger.addHandler(handler)
        if output is not None:
            Path(output).mkdir(parents=True, exist_ok=True)
            file_handler = logging.FileHandler(Path(output) / "training.log")
            file_handler.setFormatter(logging.Formatter(_FORMAT))
            logger.addHandler(file_handler)
    else:
        logger.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(f"[rank {rank}] " + _FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(console)
    # Library modules log through logging.getLogger(__name__); route the project's packages here too.
    for name in LIBRARY_PACKAGES:
        child = logging.getLogger(name)
        child.handlers = logger.handlers[:]
        child.setLevel(logger.level)
        child.propagate = False
    return logger


def one_line(exc: BaseException) -> str:
    """An error as the one line a user reads: its message with every run of white space (line breaks
    included) made one space, or, for an error re-raised from a DataLoader worker (whose message holds the
    worker's traceback), the original error's last line."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        return " ".join(lines[-1].split())
    return " ".join(str(exc).split()) or type(exc).__name__


class ProgressLog:
    """The trainer's progress lines: loss (running mean since the last line), LR, samples/s, grad scale, ETA,
    to the log and, on rank 0, to TensorBoard (``train/loss``, ``train/lr``, ...).

    Losses are summed on the device (``add``); ``log`` reads the sum on the host, once per line. Steps
    count skipped ones too (their batches were read and computed); ``images_per_step`` is the global batch
    times the accumulation.
    """

    def __init__(self, logger: logging.Logger, writer, total_steps: int, images_per_step: int,
                 start_step: int) -> None:
        self.logger, self.writer = logger, writer
        self.total_steps, self.images_per_step = total_steps, images_per_step
        self.run_start, self.start_step = time.perf_counter(), start_step
        self._reset()

    def _reset(self) -> None:
        self.total: torch.Tensor | float = 0.0
        self.count, self.steps, self.start = 0, 0, time.perf_counter()

    def add(self, loss: torch.Tensor | None) -> None:
        """One step's loss (a device tensor), or None for a skipped step."""
        self.steps += 1
        if loss is not None:
            self.total = self.total + loss
            self.count += 1

    def log(self, step: int, epoch: int, lr: float, scale: float | None) -> float:
        """Log the steps since the last line (``scale``: the fp16 loss scale, None without one); returns their
        mean loss."""
        now = time.perf_counter()
        mean = float(self.total) / self.count if self.count else float("nan")
        # The interval since the last line: `frequent` steps, fewer for the last line or after a resume.
        speed = self.images_per_step * self.steps / max(now - self.start, 1e-9)
        eta = (self.total_steps - step) * (now - self.run_start) / max(step - self.start_step, 1)
        self.logger.info("step %d/%d epoch %d | loss %.4f | lr %.6f | %.1f samples/s | grad scale %g | eta %s",
                         step, self.total_steps, epoch, mean, lr, speed, 1.0 if scale is None else scale,
                         datetime.timedelta(seconds=int(eta)))
        if self.writer is not None:
            scalars = {"loss": mean, "lr": lr, "samples_per_sec": speed, **({"grad_scale": scale} if scale else {})}
            for key, value in scalars.items():
                self.writer.add_scalar(f"train/{key}", value, step)
        self._reset()
        return mean
