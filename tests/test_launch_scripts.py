"""scripts/run.sh and scripts/dist.sh as a user types them: help, usage errors, the Python they pick.

Nothing here starts torchrun: PYTHON=echo (or a stub .venv/bin/python) prints the command instead.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.process  # every test runs bash
DIST = ["--nnodes", "2", "--nproc", "8", "--master-addr", "10.0.0.1"]


def sh(script: str, *args: str, root: Path = ROOT, python: str | None = "echo") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    if python is not None:
        env["PYTHON"] = python
    return subprocess.run(["bash", str(root / "scripts" / script), *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=20)


@pytest.mark.parametrize("script", ["run.sh", "dist.sh"])
def test_help_is_the_comment_block_not_code(script):
    proc = sh(script, "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert f"scripts/{script}" in proc.stdout
    assert "Python: $PYTHON when set, else .venv/bin/python" in proc.stdout  # how it picks Python
    assert not any(word in proc.stdout for word in ("set -euo", "cd \"$(dirname", "usage()", "#"))


@pytest.mark.parametrize("script", ["run.sh", "dist.sh"])
def test_no_arguments_print_usage_and_exit_2(script):
    proc = sh(script)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == sh(script, "--help").stdout  # the usage, on stderr


@pytest.mark.parametrize("args, message", [
    ([*DIST, "--node-rank", "2", "configs/x"], "dist.sh: --node-rank 2 must be < --nnodes 2 (node ranks are 0..1)"),
    ([*DIST, "--node-rank", "5", "--run", "configs/x"],
     "dist.sh: --node-rank 5 must be < --nnodes 2 (node ranks are 0..1)"),
    (["--nnodes", "2", "--nproc", "8", "configs/x"],
     "dist.sh: --nnodes, --nproc, --master-addr and CONFIG are required (see --help)"),
    ([*DIST, "--node-rank"], "dist.sh: --node-rank needs a value (see --help)"),
    (["--nnodes", "two", "--nproc", "8", "--master-addr", "h", "c"],
     "dist.sh: --nnodes must be a whole number, got 'two'"),
    (["--nnodes", "0", "--nproc", "8", "--master-addr", "h", "c"], "dist.sh: --nnodes must be >= 1, got 0"),
    ([*DIST, "--run", "configs/x"], "dist.sh: --run needs --node-rank"),
    ([*DIST, "--bogus", "configs/x"], "dist.sh: unknown option --bogus (see --help)"),
])
def test_dist_usage_errors_are_one_line_exit_2(args, message):
    proc = sh("dist.sh", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [message]


def test_dist_prints_each_node_line_with_the_chosen_python():
    proc = sh("dist.sh", *DIST, "--max-restarts", "3", "configs/wf42m_pfc02_r100", "--set", "lr=0.1",
              python="/opt/py/bin/python3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "# node 0" and lines[2] == "# node 1" and len(lines) == 4
    assert lines[3] == ("/opt/py/bin/python3 -m torch.distributed.run --nnodes=2 --node_rank=1 --nproc_per_node=8 "
                        "--rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29500 --rdzv-id=facetrain --max-restarts=3 "
                        "train.py configs/wf42m_pfc02_r100 --set lr=0.1 ")
    only = sh("dist.sh", *DIST, "--node-rank", "1", "configs/x").stdout.splitlines()
    assert only[0] == "# node 1" and len(only) == 2


def test_run_passes_config_nproc_and_options_to_the_chosen_python():
    proc = sh("run.sh", "configs/debug_cpu", "2", "--set", "max_steps=20")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("-m torch.distributed.run --standalone --nproc_per_node=2 train.py "
                                   "configs/debug_cpu --set max_steps=20")
    proc = sh("run.sh", "configs/debug_cpu", "0")
    assert proc.returncode == 2 and proc.stderr.splitlines() == ["run.sh: NPROC must be >= 1, got 0"]
    proc = sh("run.sh", "--nproc", "2")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "unknown option --nproc" in proc.stderr


@pytest.mark.parametrize("script, args", [("run.sh", ["configs/x", "1"]), ("dist.sh", [*DIST, "configs/x"])])
def test_without_PYTHON_the_repository_venv_then_python3(tmp_path, script, args):
    """A copy of the script in a bare repository: python3 from PATH (a stub here), then, once the
    repository has one, .venv/bin/python. run.sh runs the interpreter, dist.sh prints its name."""
    repo, stubs = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / script, repo / "scripts" / script)
    for path, name in ((stubs / "python3", "python3-stub"), (repo / ".venv" / "bin" / "python", "venv-stub")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/sh\necho {name} \"$@\"\n")
        path.chmod(0o755)
    venv = repo / ".venv"
    venv.rename(tmp_path / "venv-aside")

    def command() -> str:
        env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
        env["PATH"] = f"{stubs}:{env['PATH']}"
        proc = subprocess.run(["bash", str(repo / "scripts" / script), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=20)
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stdout.splitlines() if not line.startswith("#")][0]

    expected = {"run.sh": ("python3-stub -m torch.distributed.run", "venv-stub -m torch.distributed.run"),
                "dist.sh": ("python3 -m torch.distributed.run", ".venv/bin/python -m torch.distributed.run")}[script]
    assert command().startswith(expected[0])
    (tmp_path / "venv-aside").rename(venv)
    assert command().startswith(expected[1])


@pytest.mark.parametrize("visible, nproc", [(None, 8), ("0,1", 2), ("3", 1), ("", 1)])
def test_run_starts_one_rank_per_visible_gpu(tmp_path, visible, nproc):
    stub = tmp_path / "bin" / "nvidia-smi"  # a node with 8 GPUs
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(8)))
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHON="echo", PATH=f"{stub.parent}:{env['PATH']}")
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run.sh"), "configs/x"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"-m torch.distributed.run --standalone --nproc_per_node={nproc} train.py configs/x"


def test_make_setup_installs_and_runs_nothing_else(tmp_path):
    """README: `make setup` creates the environment only (no demo, no suite)."""
    plan = subprocess.run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    assert "pip install -q --no-compile -r requirements.txt" in plan and "requirements-faces.txt" in plan
    assert "-m pytest" not in plan and "demo.py" not in plan
    assert "-m pytest" in subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True).stdout
