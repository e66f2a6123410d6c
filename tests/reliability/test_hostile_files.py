"""Files crafted to run a command when unpickled (a verification .bin, a checkpoint's common.pt or head shard,
weights for init_backbone or eval.verify --weights) are refused by the programs (train.py's and scripts/verify.py's
main, run in this process by ``tests.helpers.run_main``) and the command does not run. tests/test_checkpoint.py and
tests/test_verification.py test the loaders themselves."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torchvision.io import encode_jpeg

from eval.verification import save_bin
from tests.helpers import CONFIG, REFERENCE, run_main, train_here
from utils.checkpoint import MANIFEST


class RunsACommand:
    """Unpickling this calls os.system(f"touch {marker}")."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def hostile_torch_file(path: Path, marker: Path, **plain) -> Path:
    torch.save({**plain, "payload": RunsACommand(marker)}, path)
    return path


def verify(*args: str) -> subprocess.CompletedProcess:
    from scripts import verify as tool

    return run_main(tool.main, ["--targets", "lfw", "--device", "cpu", *args], "scripts/verify.py")


def good_bin(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    images = [encode_jpeg(torch.randint(0, 256, (3, 112, 112), dtype=torch.uint8, generator=g)).numpy().tobytes()
              for _ in range(4)]
    save_bin(folder / "lfw.bin", images, [True, False])
    return folder


TINY = ("--network", "tiny", "--embedding-size", "32", "--network-kwargs", '{"widths": [8, 16, 16, 32]}')


@pytest.mark.timeout(120)
def test_verify_refuses_a_hostile_bin(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "lfw.bin", "wb") as f:
        pickle.dump(([RunsACommand(marker)] * 2, [True]), f)
    proc = verify(*TINY, "--random-init", "0", "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 1 and "lfw.bin" in proc.stderr, proc.stderr[-3000:]  # 1: bad data
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_verify_refuses_hostile_weights(tmp_path):
    marker = tmp_path / "pwned"
    weights = hostile_torch_file(tmp_path / "model.pt", marker)
    proc = verify(*TINY, "--weights", str(weights), "--data-dir", str(good_bin(tmp_path / "data")))
    assert proc.returncode == 2 and f"{weights}: refused" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_trainer_refuses_hostile_init_backbone(tmp_path):
    marker = tmp_path / "pwned"
    weights = hostile_torch_file(tmp_path / "model.pt", marker)
    proc = train_here(CONFIG, tmp_path / "out", f"init_backbone={weights}", check=False)
    assert proc.returncode != 0 and f"{weights}: refused" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["common.pt", "head_rank0.pt"])
def test_trainer_refuses_a_hostile_checkpoint_file(reference_run, tmp_path, name):
    """A complete checkpoint (manifest sizes match) one of whose files runs a command: auto-resume refuses it."""
    marker = tmp_path / "pwned"
    output = tmp_path / "out"
    ckpt = output / "checkpoints" / "step_000000005"
    shutil.copytree(reference_run / "checkpoints" / ckpt.name, ckpt)
    hostile_torch_file(ckpt / name, marker, step=5)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"][name] = (ckpt / name).stat().st_size
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    proc = train_here(CONFIG, output, *REFERENCE, check=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert f"{ckpt / name}: refused" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()
