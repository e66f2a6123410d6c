"""Verification during training: score the backbone on `.bin` pair sets every N steps, on rank 0.

Every rank calls the callback; rank 0 evaluates while the others wait at a barrier, so the process group's
timeout must outlast one evaluation (``init_process_group``'s default, 10-30 minutes, does). What it logs and
where: docs/evaluation.md#verification-sets.
"""
from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dataset.verification_set import BinData, load_bin
from eval.verification import format_table, test
from utils.distributed import barrier, broadcast_ints, get_rank
from utils.precision import AutocastModule

logger = logging.getLogger(__name__)

_MISSING, _LOADED, _UNREADABLE = 0, 1, 2  # rank 0's decision per target, broadcast to every rank
# Scalars written to TensorBoard per target, as val/<target>/<key>.
_LOGGED = ("acc", "acc_noflip", "val", "xnorm")


class ScalarWriter(Protocol):
    """What the callback needs from a ``torch.utils.tensorboard.SummaryWriter``."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...


class CallbackVerification:
    """Scores the backbone on ``<rec_prefix>/<target>.bin`` for every target in ``val_targets``.

    Every rank constructs it; the files are loaded once, on rank 0 only, and a collective on ``device`` (the
    training device: NCCL needs a CUDA tensor) tells the others which it found (``targets``). A missing file is
    skipped with one warning; an unreadable one raises ``ValueError`` on every rank. ``best[target]``: the best
    flip accuracy so far; ``nfolds``: the protocol's folds (10 published); ``autocast_dtype``: the body's autocast
    (the trainer's bf16/fp16, so a mixed-precision run is verified as it computes), None for fp32.
    """

    def __init__(self, val_targets: Sequence[str], rec_prefix: str | os.PathLike,
                 summary_writer: ScalarWriter | None = None, image_size: tuple[int, int] = (112, 112),
                 batch_size: int = 64, nfolds: int = 10, device: torch.device | str = "cpu",
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.rank = get_rank()
        self.autocast_dtype = autocast_dtype
        self.summary_writer = summary_writer
        self.batch_size = batch_size
        self.nfolds = nfolds
        self.sets: dict[str, BinData] = {}
        self.best: dict[str, float] = {}
        # Rank 0 decides for every rank which targets exist (a missing file is skipped with one warning, as
        # configs/base.py promises) and whether they loaded; the others follow its decision, so no rank is left
        # waiting in a collective for one that stopped.
        paths = [Path(rec_prefix) / f"{target}.bin" for target in val_targets]
        status = [_MISSING] * len(paths)
        error = ""
        if self.rank == 0:
            for i, (target, path) in enumerate(zip(val_targets, paths)):
                if not path.is_file():
                    logger.warning("verification target %s: %s does not exist; skipped", target, path)
                    continue
                try:
                    self.sets[target] = load_bin(path, image_size)
                except (ValueError, OSError, pickle.UnpicklingError) as exc:  # a refused global is an UnpicklingError
                    status[i], error = _UNREADABLE, str(exc)
                    break
                status[i] = _LOADED
                self.best[target] = 0.0
                logger.info("verification target %s: %d pairs from %s", target, len(self.sets[target][1]), path)
        status = broadcast_ints(status, device)
        if _UNREADABLE in status:
            path = paths[status.index(_UNREADABLE)]
            raise ValueError(error if self.rank == 0 else f"{path}: rank 0 could not read this verification file")
        self.targets = [t for t, s in zip(val_targets, status) if s == _LOADED]

    def __call__(self, global_step: int, backbone: nn.Module) -> dict[str, dict[str, Any]] | None:
        """Evaluate on rank 0 and return ``{target: test() result}`` there (``None`` on other ranks);
        every rank returns only after rank 0 has finished. A DDP-wrapped backbone is evaluated through
        its ``.module`` so that no collective runs on rank 0 alone."""
        results: dict[str, dict[str, Any]] | None = None
        if not self.targets:  # the same on every rank: nothing to evaluate, nobody waits
            return None
        if self.rank == 0:
            results = self._evaluate(global_step, AutocastModule(getattr(backbone, "module", backbone),
                                                                 self.autocast_dtype))
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
        # The same table, in the same units (fractions), as scripts/verify.py prints.
        logger.info("verification at step %d\n%s", global_step, "\n".join(format_table(results, self.best)))
        return results
