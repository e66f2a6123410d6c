"""train.py as a new user types it: --set before or after the config, and the names users type for our keys.

The command lines go to train.py's main in this process (``tests.helpers.run_main``); README's image-folder example
runs torchrun.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import CONFIG, ROOT, run_main, subprocess_env
from utils.config import COMMON_NAMES, load_config

pytestmark = pytest.mark.timeout(180)


def _train(*args: str) -> subprocess.CompletedProcess:
    import train

    return run_main(train.main, list(args), "train.py")


@pytest.mark.parametrize("typed, meant", [("learning_rate", "lr"), ("epochs", "num_epoch"), ("batchsize", "batch_size"),
                                          ("weight-decay", "weight_decay"), ("lr_rat", "sample_rate")])
def test_an_unknown_key_suggests_the_name_users_mean(typed, meant, tmp_path):
    """`--set learning_rate=0.01` suggested 'sample_rate' (the nearest spelling); the common names come first.
    Both orders of --set and the config give the same one line."""
    for args in (("--set", f"{typed}=0.01", CONFIG), (CONFIG, "--set", f"{typed}=0.01")):
        proc = _train(*args, "--set", f"output={tmp_path}")
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
            f"train.py: --set '{typed}=0.01': unknown key '{typed}'; did you mean '{meant}'?"], proc.stderr


def test_set_before_the_config_trains(tmp_path):
    """`python train.py --set lr=0.1 configs/debug_cpu` (the order the usage line shows) used to say the config
    was missing: --set's values had taken it."""
    proc = _train("--set", "lr=0.05", "max_steps=2", "frequent=1", f"output={tmp_path}", CONFIG)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "training.log").read_text()
    assert "step 2/2" in log and "lr 0.05" in log.replace("lr 0.050000", "lr 0.05"), log[-2000:]
    proc = _train("--set", "lr=0.1")
    assert proc.returncode == 2 and "the config is required: train.py configs/NAME" in proc.stderr


def test_every_common_name_points_at_a_key():
    keys = set(load_config(CONFIG))
    assert not {name: key for name, key in COMMON_NAMES.items() if key not in keys}
    assert not keys & set(COMMON_NAMES)  # a name that is one of our keys would never be suggested


@pytest.mark.slow
def test_readme_s_image_folder_example_trains_on_two_ranks(tmp_path):
    """README's three lines for a folder of identity folders: copy configs/image_folder_r50.py and set its rec,
    check the folder, torchrun on 2 ranks. The tiny network and 4 steps (--set) keep it short on a CPU."""
    from tests.helpers import faces, torchrun_command

    readme = (ROOT / "README.md").read_text()
    assert "cp configs/image_folder_r50.py configs/my_faces.py" in readme
    assert "torchrun --nproc_per_node=2 train.py configs/my_faces" in readme
    folder = faces(tmp_path / "faces", identities=6, per_identity=4)
    config = tmp_path / "my_faces.py"
    text = (ROOT / "configs" / "image_folder_r50.py").read_text()
    assert 'config.rec = "/data/faces"' in text
    config.write_text(text.replace('config.rec = "/data/faces"', f'config.rec = "{folder}"'))
    check = subprocess.run([sys.executable, "scripts/rec_info.py", str(folder), "--check"], cwd=ROOT,
                           capture_output=True, text=True, timeout=100)
    assert check.returncode == 0 and "check passed" in check.stdout, check.stderr
    output = tmp_path / "run"
    proc = subprocess.run([*torchrun_command(2), "train.py", str(config), "--set", f"output={output}",
                           "network=tiny", "network_kwargs={'widths': (4, 8, 8, 16)}", "embedding_size=16",
                           "batch_size=4", "max_steps=4", "warmup_epoch=0", "device=cpu", "num_workers=0"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    log = (output / "training.log").read_text()
    assert f"data {folder}: num_classes = 6 (from the dataset), num_image = 24 (from the dataset)" in log
    assert "step 4/4" in log


@pytest.mark.process
def test_readme_says_how_to_use_the_environment_right_after_the_two_commands():
    """After `make demo`, a plain `torchrun` is not on the PATH: README's next paragraph says to activate .venv or
    call its programs by path, and those programs are there (the suite runs in that environment)."""
    readme = (ROOT / "README.md").read_text()
    two, env = readme.index("## Two commands"), readme.index("**Using the environment.**")
    assert two < env < readme.index("**`make demo`**")
    assert "source .venv/bin/activate" in readme and ".venv/bin/torchrun --nproc_per_node=2 train.py" in readme
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "torchrun"), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "nproc" in proc.stdout, proc.stderr
