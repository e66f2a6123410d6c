"""Verification during training: score the backbone on `.bin` pair sets every N steps (rank 0).

The trainer calls the callback on every rank. Rank 0 evaluates while the other ranks wait at a
barrier, so the trainer must create its process group with a timeout longer than one evaluation
(a few minutes for LFW + CFP-FP + AgeDB-30 with an r100 on one GPU); the default 10-30 minutes of
``init_process_group`` is enough.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

from torch import nn

from eval.verification import BinData, format_table, load_bin, test
from utils.distributed import barrier, get_rank

logger = logging.getLogger(__name__)

# Scalars written to TensorBoard per target, as val/<target>/<key>.
_LOGGED = ("acc", "acc_noflip", "val", "xnorm")


class ScalarWriter(Protocol):
    """What the callback needs from a ``torch.utils.tensorboard.SummaryWriter``."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...


class CallbackVerification:
    """Scores the backbone on ``<rec_prefix>/<target>.bin`` for every target in ``val_targets``.

    The files are loaded once, at construction, on rank 0 only (other ranks hold nothing).
    ``best[target]`` is the highest flip accuracy seen so far; ``nfolds`` is the number of
    cross-validation folds (10 in the published protocol).
    """

    def __init__(self, val_targets: Sequence[str], rec_prefix: str | os.PathLike,
                 summary_writer: ScalarWriter | None = None, image_size: tuple[int, int] = (112, 112),
                 batch_size: int = 64, nfolds: int = 10) -> None:
        self.rank = get_rank()
        self.summary_writer = summary_writer
        self.batch_size = batch_size
        self.nfolds = nfolds
        self.sets: dict[str, BinData] = {}
        self.best: dict[str, float] = {}
        if self.rank != 0:
            return
        for target in val_targets:
            path = Path(rec_prefix) / f"{target}.bin"
            if not path.is_file():
                raise FileNotFoundError(f"verification target {target!r}: {path} does not exist "
                                        f"(val_targets={list(val_targets)}, rec_prefix={rec_prefix})")
            self.sets[target] = load_bin(path, image_size)
            self.best[target] = 0.0
            logger.info("verification target %s: %d pairs from %s", target, len(self.sets[target][1]), path)

    def __call__(self, global_step: int, backbone: nn.Module) -> dict[str, dict[str, Any]] | None:
        """Evaluate on rank 0 and return ``{target: test() result}`` there (``None`` on other ranks);
        every rank returns only after rank 0 has finished. A DDP-wrapped backbone is evaluated through
        its ``.module`` so that no collective runs on rank 0 alone."""
        results: dict[str, dict[str, Any]] | None = None
        if self.rank == 0 and self.sets:
            results = self._evaluate(global_step, getattr(backbone, "module", backbone))
        barrier()
        return results

    def _evaluate(self, global_step: int, backbone: nn.Module) -> dict[str, dict[str, Any]]:
        results = {}
        for target, data in self.sets.items():
            r = test(data, backbone, self.batch_size, self.nfolds)
            results[target] = r
            self.best[target] = max(self.best[target], r["acc"])
            if self.summary_writer is not None:
                for key in _LOGGED:
                    self.summary_writer.add_scalar(f"val/{target}/{key}", r[key], global_step)
        # The same table, in the same units (fractions), as python -m eval.verify prints.
        logger.info("verification at step %d\n%s", global_step, "\n".join(format_table(results, self.best)))
        return results
