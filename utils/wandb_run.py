"""Weights & Biases logging: arcface_torch's ``using_wandb`` keys, on rank 0, beside TensorBoard.

``wandb`` is optional, imported only when ``using_wandb = True``; the trainer checks that it is installed on rank
0 before training. The run receives what TensorBoard receives (only the ``val/`` results with ``wandb_log_all =
False``), logged against ``trainer/step``; with ``save_artifacts`` each ``model.pt`` becomes a version of the run's
model artifact. A run that cannot start, or fails later, is one warning and training goes on. The API key reaches
wandb through its settings (no ``wandb.login``, which would write ``~/.netrc``), is removed from the command line
wandb records, and is never logged nor saved (``utils.config.SECRET_KEYS``). See docs/wandb.md.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from utils.config import redacted
from utils.files import atomic_write
from utils.logging_setup import one_line

RUN_FILE = "wandb_run.json"  # in the output folder: the wandb run this folder logs to, for wandb_resume
STEP_METRIC = "trainer/step"  # every scalar's x axis in the wandb run


def api_key(cfg: Mapping[str, Any]) -> str | None:
    """``wandb_key``, or None for none: unset, empty, or arcface_torch's placeholder (a string of X's)."""
    key = cfg["wandb_key"]
    return None if key is None or not key.strip() or set(key.strip()) == {"X"} else key.strip()


def check_installed(cfg: Mapping[str, Any]) -> None:
    """``ValueError`` when ``using_wandb = True`` and the ``wandb`` package is not installed, or does not import."""
    if not cfg["using_wandb"]:
        return
    try:
        import wandb  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (a broken install fails in its own dependencies' ways)
        if isinstance(exc, ModuleNotFoundError) and exc.name == "wandb":
            raise ValueError("using_wandb = True but the wandb package is not installed on rank 0's node; pip "
                             "install wandb, or set using_wandb = False (TensorBoard logs are written either "
                             "way)") from None
        raise ValueError(f"using_wandb = True but the wandb package does not import on rank 0's node "
                         f"({one_line(exc)}); reinstall it, or set using_wandb = False") from None


def _without_key(argv: list[str], key: str) -> list[str]:
    """``argv`` with the API key written over: wandb records the command line with the run."""
    return [arg.replace(key, "<hidden>") for arg in argv]


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
    """Scalars into a wandb run (``log_all`` False: only ``val/`` ones) against ``trainer/step``, and ``model.pt``
    as its model artifact. The first call that fails is one warning and turns the writer off."""

    def __init__(self, run: Any, log_all: bool, logger: logging.Logger) -> None:
        self.run, self.log_all, self.logger = run, log_all, logger
        self.exit_code = 0  # what the run finishes with: the trainer sets it when training stops on an error
        self._call("define_metric",
                   lambda r: (r.define_metric(STEP_METRIC), r.define_metric("*", step_metric=STEP_METRIC)))

    def _call(self, what: str, work: Callable[[Any], Any]) -> None:
        """``work(run)``; its first failure (``what`` names it) is one warning and turns the writer off."""
        if self.run is None:
            return
        try:
            work(self.run)
        except Exception as exc:  # noqa: BLE001 (wandb's service can fail in many ways; training must not)
            self.logger.warning("wandb: %s failed (%s); the run gets nothing more, training goes on and logs to "
                                "TensorBoard", what, one_line(exc))
            self.run = None

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        if self.log_all or tag.startswith("val/"):
            self._call("log", lambda r: r.log({tag: float(scalar_value), STEP_METRIC: int(global_step)}))

    def log_model(self, path: Path, step: int, epoch: int | None) -> None:
        """``path`` as a new version of the artifact ``model-<run id>``, aliased ``step_<step>``, ``latest`` and,
        at the end of an epoch, ``epoch_<epoch>`` (epochs completed)."""
        at_epoch_end = epoch is not None

        def log(run: Any) -> None:
            import wandb

            artifact = wandb.Artifact(name=f"model-{run.id}", type="model",
                                      metadata={"step": int(step), **({"epoch": int(epoch)} if at_epoch_end else {})})
            artifact.add_file(str(path))
            aliases = [f"step_{step}", "latest", *([f"epoch_{epoch}"] if at_epoch_end else [])]
            run.log_artifact(artifact, aliases=aliases)

        self._call("log_artifact", log)

    def close(self) -> None:
        self._call("finish", lambda r: r.finish(exit_code=self.exit_code))
        self.run = None


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
    previous = _previous_run(output, logger) if cfg["wandb_resume"] else None
    if previous is not None:
        name = previous["name"]
    else:  # as arcface_torch names its runs: the start time, then the suffix
        suffix = cfg["suffix_run_name"]
        name = time.strftime("%y%m%d_%H%M") + (f"_{suffix}" if suffix else "")
    key = api_key(cfg)
    if key is not None:
        sys.argv = _without_key(sys.argv, key)
    try:
        import wandb

        (output / "wandb").mkdir(parents=True, exist_ok=True)
        run = wandb.init(entity=cfg["wandb_entity"], project=cfg["wandb_project"], name=name, notes=cfg["notes"],
                         config=redacted(cfg), dir=str(output),
                         **({"settings": wandb.Settings(api_key=key)} if key is not None else {}),
                         **({"id": previous["id"], "resume": "allow"} if previous is not None else {}))
        record = json.dumps({"id": run.id, "name": run.name}).encode()
        atomic_write(output / RUN_FILE, lambda f: f.write(record))
    except Exception as exc:  # noqa: BLE001 (wandb's errors have no common base: network, login, usage)
        logger.warning("wandb: no run started (%s); training goes on and logs to TensorBoard only "
                       "(WANDB_MODE=offline logs to %s without a network)", one_line(exc), output / "wandb")
        return None
    logger.info("wandb run %s (id %s)%s", run.name, run.id, " continued" if previous is not None else "")
    return WandbWriter(run, bool(cfg["wandb_log_all"]), logger)
