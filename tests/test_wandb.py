"""Weights & Biases logging through the train.py CLI, against a stand-in ``wandb`` package that records every call
(the real one needs an account or writes binary run files): what the run is started with, what it receives, the
model artifacts, the continued run, a run that cannot start, and the package missing. The API key is never logged
nor saved."""
from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path

import pytest

from tests.helpers import CONFIG, ROOT, logged_losses, train
from utils.config import load_config, redacted
from utils.files import load_tensors
from utils.wandb_run import RUN_FILE, ScalarWriters, WandbWriter, api_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# The stand-in: the wandb calls the trainer makes, each appended to $FAKE_WANDB_LOG as one JSON line.
FAKE_WANDB = '''
import json, os, sys

if os.environ.get("FAKE_WANDB_BROKEN"):
    raise ImportError("cannot import name 'builder' from 'google.protobuf.internal'")

def _record(event, **data):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"event": event, **data}) + "\\n")

def login(key=None):
    _record("login", key=key)

class Settings:
    def __init__(self, api_key=None):
        self.api_key = api_key

class Artifact:
    def __init__(self, name, type, metadata=None):
        self.name, self.type, self.metadata, self.files = name, type, metadata, []

    def add_file(self, path):
        self.files.append(path)

class _Run:
    def __init__(self, id, name):
        self.id, self.name = id, name

    def define_metric(self, name, step_metric=None):
        _record("define_metric", name=name, step_metric=step_metric)

    def log(self, data):
        if os.environ.get("FAKE_WANDB_LOG_FAILS"):
            raise RuntimeError("wandb service process died")
        _record("log", data=data)

    def log_artifact(self, artifact, aliases=None):
        _record("artifact", name=artifact.name, type=artifact.type, metadata=artifact.metadata,
                files=artifact.files, aliases=aliases)

    def finish(self, exit_code=None):
        _record("finish", exit_code=exit_code)

def init(entity=None, project=None, name=None, notes=None, config=None, dir=None, id=None, resume=None,
         settings=None):
    if os.environ.get("FAKE_WANDB_FAIL"):
        raise RuntimeError("wandb.init() timed out: no network")
    _record("init", entity=entity, project=project, name=name, notes=notes, config=config, dir=dir, id=id,
            resume=resume, key_given=settings is not None and settings.api_key == "SECRET-KEY-123", argv=sys.argv)
    return _Run(id or "run%d" % os.getpid(), name)
'''
# 64 images of 8 per step: 8 steps per epoch, 2 epochs, a progress line every 4 steps.
EPOCHS = ("max_steps=0", "num_image=64", "num_epoch=2", "save_every_steps=0", "frequent=4")
WANDB = ("using_wandb=True", "wandb_entity=team", "wandb_project=faces", "suffix_run_name=r50",
         "notes=first try", "wandb_key=SECRET-KEY-123", "save_artifacts=True")


def fake_wandb(tmp_path: Path, monkeypatch, fail: str | None = None) -> Path:
    """Put the stand-in package first on the trainer's path; returns the file its calls are recorded in.
    ``fail``: "init" (no run starts), "log" (the run's calls fail), "import" (the package does not import)."""
    package = tmp_path / "fake" / "wandb"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_WANDB)
    monkeypatch.setenv("PYTHONPATH", f"{package.parent}:{ROOT}")
    monkeypatch.setenv("FAKE_WANDB_LOG", str(tmp_path / "calls.jsonl"))
    if fail is not None:
        variable = {"init": "FAKE_WANDB_FAIL", "log": "FAKE_WANDB_LOG_FAILS", "import": "FAKE_WANDB_BROKEN"}[fail]
        monkeypatch.setenv(variable, "1")
    return tmp_path / "calls.jsonl"


def calls(path: Path, event: str) -> list[dict]:
    return [c for c in map(json.loads, path.read_text().splitlines()) if c["event"] == event] if path.exists() else []


def logged(path: Path) -> dict[tuple[int, str], float]:
    """{(trainer step, tag): value} of every scalar the run received."""
    out = {}
    for call in calls(path, "log"):
        data = dict(call["data"])
        step = data.pop("trainer/step")
        out.update({(step, tag): value for tag, value in data.items()})
    return out


def test_the_run_gets_the_config_the_losses_and_the_models_and_never_the_key(tmp_path, monkeypatch):
    record, output = fake_wandb(tmp_path, monkeypatch), tmp_path / "run"
    train(CONFIG, output, *EPOCHS, *WANDB)
    assert calls(record, "login") == []  # the key goes through the run's settings: wandb.login writes ~/.netrc
    (init,) = calls(record, "init")
    assert init["key_given"] and not any("SECRET-KEY" in arg for arg in init["argv"]), init["argv"]
    assert (init["entity"], init["project"], init["notes"], init["dir"]) == ("team", "faces", "first try", str(output))
    assert re.fullmatch(r"\d{6}_\d{4}_r50", init["name"]) and init["id"] is None and init["resume"] is None, init
    assert init["config"]["wandb_key"] == "<hidden>" and init["config"]["lr"] == 0.1, init["config"]
    assert [(c["name"], c["step_metric"]) for c in calls(record, "define_metric")] == [
        ("trainer/step", None), ("*", "trainer/step")]
    scalars, losses = logged(record), logged_losses(output)
    assert sorted(losses) == [4, 8, 12, 16]
    assert {s: f"{scalars[s, 'train/loss']:.4f}" for s in losses} == losses
    assert {tag for _, tag in scalars} == {"train/loss", "train/lr", "train/samples_per_sec"}
    artifacts = calls(record, "artifact")
    assert [(a["metadata"], a["aliases"]) for a in artifacts] == [
        ({"step": 8, "epoch": 1}, ["step_8", "latest", "epoch_1"]),
        ({"step": 16, "epoch": 2}, ["step_16", "latest", "epoch_2"])]
    assert all(a["files"] == [str(output / "model.pt")] and a["type"] == "model" for a in artifacts)
    assert [c["exit_code"] for c in calls(record, "finish")] == [0]
    saved = json.loads((output / RUN_FILE).read_text())
    assert saved == {"id": artifacts[0]["name"].removeprefix("model-"), "name": init["name"]}
    common = load_tensors(next((output / "checkpoints").glob("step_*")) / "common.pt")
    assert common["config"]["wandb_key"] == "<hidden>"
    for path in output.rglob("*"):
        assert not path.is_file() or b"SECRET-KEY" not in path.read_bytes(), path


def test_wandb_resume_continues_the_run_the_folder_logged_to(tmp_path, monkeypatch):
    record, output = fake_wandb(tmp_path, monkeypatch), tmp_path / "run"
    train(CONFIG, output, *EPOCHS, *WANDB)
    first = json.loads((output / RUN_FILE).read_text())
    train(CONFIG, output, *EPOCHS[:2], "num_epoch=3", *EPOCHS[3:], *WANDB, "wandb_resume=True", "--resume")
    second = calls(record, "init")[1]
    assert (second["id"], second["name"], second["resume"]) == (first["id"], first["name"], "allow")
    assert sorted({step for step, _ in logged(record)}) == [4, 8, 12, 16, 20, 24]
    # Without wandb_resume, each start is a new wandb run.
    train(CONFIG, output, *EPOCHS[:2], "num_epoch=4", *EPOCHS[3:], *WANDB, "--resume")
    third = calls(record, "init")[2]
    assert third["id"] is None and third["resume"] is None


def test_wandb_log_all_false_sends_no_training_scalars(tmp_path, monkeypatch):
    record, output = fake_wandb(tmp_path, monkeypatch), tmp_path / "run"
    train(CONFIG, output, *EPOCHS, "using_wandb=True", "wandb_log_all=False")
    assert len(calls(record, "init")) == 1 and calls(record, "log") == [] and calls(record, "artifact") == []
    assert calls(record, "login") == []  # no key: the login wandb already has


def test_a_run_that_cannot_start_is_one_warning_and_training_goes_on(tmp_path, monkeypatch):
    record, output = fake_wandb(tmp_path, monkeypatch, fail="init"), tmp_path / "run"
    proc = train(CONFIG, output, *EPOCHS, *WANDB)
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "wandb: no run started" in line]
    assert len(warnings) == 1 and "no network" in warnings[0] and "WANDB_MODE=offline" in warnings[0], proc.stdout
    assert sorted(logged_losses(output)) == [4, 8, 12, 16] and (output / "model.pt").is_file()
    assert not (output / RUN_FILE).exists() and calls(record, "init") == []


def test_a_run_whose_calls_fail_later_is_one_warning_and_training_goes_on(tmp_path, monkeypatch):
    record, output = fake_wandb(tmp_path, monkeypatch, fail="log"), tmp_path / "run"
    proc = train(CONFIG, output, *EPOCHS, *WANDB)
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "wandb: log failed" in line]
    assert len(warnings) == 1 and "service process died" in warnings[0], proc.stdout[-3000:]
    assert sorted(logged_losses(output)) == [4, 8, 12, 16] and (output / "model.pt").is_file()
    assert calls(record, "artifact") == [] and calls(record, "finish") == []  # the run is left alone after it failed


def test_a_wandb_that_does_not_import_is_one_line(tmp_path, monkeypatch):
    fake_wandb(tmp_path, monkeypatch, fail="import")
    proc = train(CONFIG, tmp_path / "run", *EPOCHS, "using_wandb=True", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "the wandb package does not import on rank 0's node" in line and "google.protobuf" in line, line


def test_a_training_that_stops_on_a_mistake_finishes_its_run_with_that_exit_code(tmp_path, monkeypatch):
    record, output = fake_wandb(tmp_path, monkeypatch), tmp_path / "run"
    proc = train(CONFIG, output, *EPOCHS, "using_wandb=True", "max_nonfinite_steps=1", "lr=1e30", check=False)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [c["exit_code"] for c in calls(record, "finish")] == [3]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_using_wandb_without_the_package_is_one_line(tmp_path):
    proc = train(CONFIG, tmp_path / "run", *EPOCHS, "using_wandb=True", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "using_wandb = True but the wandb package is not installed" in line and "pip install wandb" in line


# ------------------------------------------------------------------------------------------------ in process
def test_the_key_is_hidden_and_the_placeholder_is_no_key():
    cfg = load_config(CONFIG, ["wandb_key=SECRET-KEY-123"])
    assert "SECRET-KEY" not in str(cfg) and "<hidden>" in str(cfg) and redacted(cfg)["wandb_key"] == "<hidden>"
    assert api_key(cfg) == "SECRET-KEY-123"
    assert api_key(load_config(CONFIG, ["wandb_key=" + "X" * 40])) is None  # arcface_torch's base.py value
    assert api_key(load_config(CONFIG)) is None and redacted(load_config(CONFIG))["wandb_key"] is None


def test_scalar_writers_send_to_every_writer_and_wandb_filters_by_log_all():
    class Run:
        def __init__(self):
            self.logged, self.finished = [], []

        def define_metric(self, name, step_metric=None):
            pass

        def log(self, data):
            self.logged.append(data)

        def finish(self, exit_code=None):
            self.finished.append(exit_code)

    every, val_only = Run(), Run()
    writers = ScalarWriters(WandbWriter(every, log_all=True, logger=logging.getLogger("test")), None)
    writers.add(WandbWriter(val_only, log_all=False, logger=logging.getLogger("test")))
    writers.add_scalar("train/loss", 2.5, 10)
    writers.add_scalar("val/lfw/acc", 0.9, 10)
    writers.close()
    writers.close()  # a second close does nothing
    assert every.logged == [{"train/loss": 2.5, "trainer/step": 10}, {"val/lfw/acc": 0.9, "trainer/step": 10}]
    assert val_only.logged == [{"val/lfw/acc": 0.9, "trainer/step": 10}] and every.finished == val_only.finished == [0]
