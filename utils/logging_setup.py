"""One logger for the trainer: rank 0 writes to the console and to ``<output>/training.log``.

Other ranks log warnings and errors only, to the console, prefixed with their rank, so a failure on any
rank is still visible but the normal log is written once.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER_NAME = "facetrain"
_FORMAT = "%(asctime)s %(levelname)s %(message)s"


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
        console.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(console)
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
    for name in ("partial_fc", "dataset", "eval", "utils", "backbones", "losses"):
        child = logging.getLogger(name)
        child.handlers = logger.handlers[:]
        child.setLevel(logger.level)
        child.propagate = False
    return logger
