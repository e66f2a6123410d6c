"""Weights & Biases logging: arcface_torch's ``using_wandb`` keys, on rank 0, beside TensorBoard.

``wandb`` is an optional package (``pip install wandb``), imported only when ``using_wandb = True``; the trainer
checks that it is installed on rank 0 before training starts. The run receives what TensorBoard receives
(``train/loss``, ``train/lr``, ``train/samples_per_sec``, ``train/grad_scale`` at every progress line and the
``val/<target>/...`` results), or only the ``val/`` results with ``wandb_log_all = False``; with
``save_artifacts = True`` each ``model.pt`` written at an epoch end or at the last step becomes a new version of
the run's model artifact. The run's files go to ``<output>/wandb``; ``WANDB_MODE=offline`` keeps them there
without a network (``wandb sync`` uploads them later).

A run that cannot start (no network, no login) is one warning: training goes on, logging to TensorBoard.
The API key is never logged nor saved in checkpoints (``utils.config.SECRET_KEYS``).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path
from typing import Any, Mapping

from utils.config import redacted
from utils.files import atomic_write
from utils.logging_setup import one_line

RUN_FILE = "wandb_run.json"  # in the output folder: the wandb run this folder logs to, for wandb_resume


def api_key(cfg: Mapping[str, Any]) -> str | None:
    """``wandb_key``, or None for none: unset, empty, or arcface_torch's placeholder (a string of X's)."""
    key = cfg["wandb_key"]
    return None if key is None or not key.strip() or set(key.strip()) == {"X"} else key.strip()


def check_installed(cfg: Mapping[str, Any]) -> None:
    """``ValueError`` when ``using_wandb = True`` and the ``wandb`` package cannot be imported."""
    if cfg["using_wandb"] and importlib.util.find_spec("wandb") is None:
        raise ValueError("using_wandb = True but the wandb package is not installed on rank 0's node; "
                         "pip install wandb, or set using_wandb = False (TensorBoard logs are written either way)")


class ScalarWriters:
    """``add_scalar`` and ``close`` of a ``SummaryWriter``, sent to every writer in ``writers``; ``add`` joins one
    later (the wandb run starts once the run knows where it resumes)."""

    def __init__(self, *writers: Any) -> None:
        self.writers = [w for w in writers if w is not None]

    def add(self, writer: Any) -> None:
        self.writers.append(writer)

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, scalar_value, global_step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class WandbWriter:
    """Scalars into a wandb run (``log_all`` False: only ``val/`` ones), and ``model.pt`` as its model artifact."""

    def __init__(self, run: Any, log_all: bool) -> None:
        self.run, self.log_all = run, log_all

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        if self.log_all or tag.startswith("val/"):
            self.run.log({tag: float(scalar_value)}, step=int(global_step))

    def log_model(self, path: Path, epoch: int, step: int) -> None:
        """``path`` as a new version of the artifact ``model-<run id>`` (aliases ``epoch_<epoch>``, ``latest``)."""
        import wandb

        artifact = wandb.Artifact(name=f"model-{self.run.id}", type="model",
                                  metadata={"epoch": int(epoch), "step": int(step)})
        artifact.add_file(str(path))
        self.run.log_artifact(artifact, aliases=[f"epoch_{epoch}", "latest"])

    def close(self) -> None:
        self.run.finish()


def _previous_run(output: Path, logger: logging.Logger) -> dict[str, str] | None:
    """The run recorded in ``output/wandb_run.json``: ``{"id", "name"}``, or None (absent or unreadable)."""
    path = output / RUN_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("id"), str) and isinstance(data.get("name"), str):
            return {"id": data["id"], "name": data["name"]}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass
    logger.warning("wandb_resume: %s is not a run record ({\"id\": ..., \"name\": ...}); starting a new wandb run",
                   path)
    return None


def start_run(cfg: Mapping[str, Any], output: Path, logger: logging.Logger) -> WandbWriter | None:
    """Start (or, with ``wandb_resume`` and a run recorded in ``output``, continue) the wandb run; None with one
    warning when wandb cannot start one. Rank 0 only."""
    import wandb

    previous = _previous_run(output, logger) if cfg["wandb_resume"] else None
    if previous is not None:
        name = previous["name"]
    else:  # as arcface_torch names its runs: the start time, then the suffix
        suffix = cfg["suffix_run_name"]
        name = time.strftime("%y%m%d_%H%M") + (f"_{suffix}" if suffix else "")
    try:
        key = api_key(cfg)
        if key is not None:
            wandb.login(key=key)
        (output / "wandb").mkdir(parents=True, exist_ok=True)
        run = wandb.init(entity=cfg["wandb_entity"], project=cfg["wandb_project"], name=name, notes=cfg["notes"],
                         config=redacted(cfg), dir=str(output),
                         **({"id": previous["id"], "resume": "allow"} if previous is not None else {}))
    except Exception as exc:  # noqa: BLE001 (wandb's errors have no common base: network, login, usage)
        logger.warning("wandb: no run started (%s); training goes on and logs to TensorBoard only "
                       "(WANDB_MODE=offline logs to %s without a network)", one_line(exc), output / "wandb")
        return None
    record = json.dumps({"id": run.id, "name": run.name}).encode()
    atomic_write(output / RUN_FILE, lambda f: f.write(record))
    logger.info("wandb run %s (id %s)%s", run.name, run.id, " continued" if previous is not None else "")
    return WandbWriter(run, bool(cfg["wandb_log_all"]))
