"""Run the real trainer in subprocesses: `python train.py` or `torchrun` on 127.0.0.1, with a timeout.

Used by the trainer and reliability tests. Every launch gets a free port (picked by the OS) and a timeout,
so a hung rendezvous or collective fails the test instead of hanging the suite.
"""
from __future__ import annotations

import os
import shutil
import re
import subprocess
import sys
from pathlib import Path

import torch

from _dist import free_port

ROOT = Path(__file__).resolve().parents[1]
LOSS_LINE = re.compile(r"step (\d+)/\d+ epoch \d+ \| loss (\S+)")
LR_LINE = re.compile(r"step (\d+)/(\d+) epoch \d+ \| loss \S+ \| lr (\S+)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def torchrun_command(nproc: int, *, port: int | None = None, nnodes: int = 1, node_rank: int = 0,
                     max_restarts: int = 0) -> list[str]:
    """The torchrun command line (static rendezvous on 127.0.0.1:port) up to, not including, train.py."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
            f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port or free_port()}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]


def train(config: str, output: Path, *sets: str, nproc: int = 1, timeout: float = 240,
          check: bool = True) -> subprocess.CompletedProcess:
    """Run train.py on ``nproc`` ranks (plain python when 1) with ``output=...`` and ``--set`` pairs."""
    args = ["train.py", config, "--set", f"output={output}", *sets]
    cmd = [sys.executable, *args] if nproc == 1 else [*torchrun_command(nproc), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-4000:]}")
    return proc


def logged_losses(output: Path) -> dict[int, str]:
    """{step: loss as logged} from output/training.log (one entry per logged step; the last run wins)."""
    losses: dict[int, str] = {}
    for line in (output / "training.log").read_text().splitlines():
        m = LOSS_LINE.search(line)
        if m:
            losses[int(m.group(1))] = m.group(2)
    return losses


def logged_lrs(output: Path) -> dict[int, tuple[int, str]]:
    """{step: (total steps, LR as logged)} from output/training.log (the last run wins)."""
    lrs: dict[int, tuple[int, str]] = {}
    for line in (output / "training.log").read_text().splitlines():
        m = LR_LINE.search(line)
        if m:
            lrs[int(m.group(1))] = (int(m.group(2)), m.group(3))
    return lrs


def load_model(output: Path) -> dict[str, torch.Tensor]:
    return torch.load(output / "model.pt", map_location="cpu", weights_only=True)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"different keys: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def copy_checkpoints_until(src: Path, dst: Path, step: int) -> Path:
    """``dst`` holding ``src``'s checkpoints up to ``step``: a run that stopped right after that step."""
    shutil.copytree(src / "checkpoints", dst / "checkpoints",
                    ignore=lambda _, names: [n for n in names if n.startswith("step_") and int(n[5:14]) > step])
    return dst


def saved_head(ckpt: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weight (C, D) and optimizer state (C, ...) of a checkpoint, its shards joined in class order."""
    from utils.checkpoint import load_file

    shards = sorted((load_file(p) for p in ckpt.glob("head_rank*.pt")), key=lambda s: s["class_start"])
    return (torch.cat([s["weight"] for s in shards]),
            {k: torch.cat([s["state"][k] for s in shards]) for k in shards[0]["state"]})


def gathered_head_after_resume(rank: int, world_size: int, config: str, sets: tuple[str, ...], ckpt: str,
                               output: str):
    """On each of ``world_size`` ranks (``tests/_dist.run_distributed``): build the trainer, resume from
    ``ckpt``, and return ``(step, weight (C, D), optimizer state (C, ...))`` gathered on rank 0."""
    import logging

    import train as trainer
    from utils.config import load_config
    from utils.distributed import all_gather

    cfg = load_config(config, [*sets, f"output={output}"])
    job = trainer.build(cfg, rank, world_size, torch.device("cpu"), logging.getLogger("test"))
    state = trainer.resume(job, Path(ckpt))
    weight = torch.cat(all_gather(job.head.weight.detach()))  # (C, D)
    head_state = job.opt_head.state[job.head.weight]
    gathered = {k: torch.cat(all_gather(v)) for k, v in sorted(head_state.items())}
    return (state.step, weight, gathered) if rank == 0 else None
