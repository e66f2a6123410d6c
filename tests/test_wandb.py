"""Weights & Biases logging through the train.py CLI, against a stand-in ``wandb`` package that records every call
(the real one needs an account or writes binary run files): what the run is started with, what it receives, the
model artifacts, the continued run, a run that cannot start, and the package missing. The API key is never logged
nor saved."""
from __future__ import annotations

import importlib.util
import json
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
import json, os

def _record(event, **data):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"event": event, **data}) + "\\n")

def login(key=None):
    _record("login", key=key)

class Artifact:
    def __init__(self, name, type, metadata=None):
        self.name, self.type, self.metadata, self.files = name, type, metadata, []

    def add_file(self, path):
        self.files.append(path)

class _Run:
    def __init__(self, id, name):
        self.id, self.name = id, name

    def log(self, data, step=None):
        _record("log", data=data, step=step)

    def log_artifact(self, artifact, aliases=None):
        _record("artifact", name=artifact.name, type=artifact.type, metadata=artifact.metadata,
                files=artifact.files, aliases=aliases)

    def finish(self):
        _record("finish")

def init(entity=None, project=None, name=None, notes=None, config=None, dir=None, id=None, resume=None):
    if os.environ.get("FAKE_WANDB_FAIL"):
        raise RuntimeError("wandb.init() timed out: no network")
    _record("init", entity=entity, project=project, name=name, notes=notes, config=config, dir=dir, id=id,
            resume=resume)
    return _Run(id or "run%d" % os.getpid(), name)
'''
# 64 images of 8 per step: 8 steps per epoch, 2 epochs, a progress line every 4 steps.
EPOCHS = ("max_steps=0", "num_image=64", "num_epoch=2", "save_every_steps=0", "frequent=4")
WANDB = ("using_wandb=True", "wandb_entity=team", "wandb_project=faces", "suffix_run_name=r50",
         "notes=first try", "wandb_key=SECRET-KEY-123", "save_artifacts=True")


def fake_wandb(tmp_path: Path, monkeypatch, fail: bool = False) -> Path:
    """Put the stand-in package first on the trainer's path; returns the file its calls are recorded in."""
    package = tmp_path / "fake" / "wandb"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_WANDB)
    monkeypatch.setenv("PYTHONPATH", f"{package.parent}:{ROOT}")
    monkeypatch.setenv("FAKE_WANDB_LOG", str(tmp_path / "calls.jsonl"))
    if fail:
        monkeypatch.setenv("FAKE_WANDB_FAIL", "1")
    return tmp_path / "calls.jsonl"


def calls(path: Path, event: str) -> list[dict]:
    return [c for c in map(json.loads, path.read_text().splitlines()) if c["event"] == event] if path.exists() else []


def test_the_run_gets_the_config_the_losses_and_the_models_and_never_the_key(tmp_path, monkeypatch):
    record, output = fake_wandb(tmp_path, monkeypatch), tmp_path / "run"
    train(CONFIG, output, *EPOCHS, *WANDB)
    assert calls(record, "login") == [{"event": "login", "key": "SECRET-KEY-123"}]
    (init,) = calls(record, "init")
    assert (init["entity"], init["project"], init["notes"], init["dir"]) == ("team", "faces", "first try", str(output))
    assert re.fullmatch(r"\d{6}_\d{4}_r50", init["name"]) and init["id"] is None and init["resume"] is None, init
    assert init["config"]["wandb_key"] == "<hidden>" and init["config"]["lr"] == 0.1, init["config"]
    logged = {(c["step"], tag): value for c in calls(record, "log") for tag, value in c["data"].items()}
    losses = logged_losses(output)
    assert sorted(losses) == [4, 8, 12, 16]
    assert {s: f"{logged[s, 'train/loss']:.4f}" for s in losses} == losses
    assert {tag for _, tag in logged} == {"train/loss", "train/lr", "train/samples_per_sec"}
    artifacts = calls(record, "artifact")
    assert [(a["metadata"], a["aliases"]) for a in artifacts] == [
        ({"epoch": 1, "step": 8}, ["epoch_1", "latest"]), ({"epoch": 2, "step": 16}, ["epoch_2", "latest"])]
    assert all(a["files"] == [str(output / "model.pt")] and a["type"] == "model" for a in artifacts)
    assert len(calls(record, "finish")) == 1
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
    assert sorted({c["step"] for c in calls(record, "log")}) == [4, 8, 12, 16, 20, 24]
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
    record, output = fake_wandb(tmp_path, monkeypatch, fail=True), tmp_path / "run"
    proc = train(CONFIG, output, *EPOCHS, *WANDB)
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "wandb: no run started" in line]
    assert len(warnings) == 1 and "no network" in warnings[0] and "WANDB_MODE=offline" in warnings[0], proc.stdout
    assert sorted(logged_losses(output)) == [4, 8, 12, 16] and (output / "model.pt").is_file()
    assert not (output / RUN_FILE).exists() and calls(record, "init") == []


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
            self.logged, self.finished = [], 0

        def log(self, data, step):
            self.logged.append((step, data))

        def finish(self):
            self.finished += 1

    every, val_only = Run(), Run()
    writers = ScalarWriters(WandbWriter(every, log_all=True), None)
    writers.add(WandbWriter(val_only, log_all=False))
    writers.add_scalar("train/loss", 2.5, 10)
    writers.add_scalar("val/lfw/acc", 0.9, 10)
    writers.close()
    assert every.logged == [(10, {"train/loss": 2.5}), (10, {"val/lfw/acc": 0.9})]
    assert val_only.logged == [(10, {"val/lfw/acc": 0.9})] and every.finished == val_only.finished == 1
