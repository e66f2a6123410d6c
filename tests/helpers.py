"""Everything the tests share: paths, ranks in processes, trainer runs, a small image folder, a tiny run folder, a
tool's main in process, a tiny in-process Job, references.

Imported as ``from tests.helpers import ...`` (pyproject.toml puts the repository root on ``sys.path`` for pytest).
Every launch gets a free port (picked by the OS) and a timeout, so a hung rendezvous or collective fails the
test instead of hanging the suite. Local ranks are spawned once per world size and kept for the session
(``on_ranks``); a test starts processes of its own where the start is what it checks.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from bench.local_ranks import LocalRanks, free_port
from utils.distributed import all_gather_cat, all_gather_sizes

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"  # MXNet-written RecordIO and .bin files, and the recipe table (README there)
UNWRITABLE = "/proc/no-such-folder"  # nobody, root included, can create a folder under /proc
# The reliability tests' trainer run: save_every_steps and keep_checkpoints are outside the config fingerprint,
# so runs that differ only in them train the same model and may resume each other's checkpoints.
CONFIG = "configs/debug_cpu"
REFERENCE = ("save_every_steps=5", "keep_checkpoints=20", "frequent=1")
LOSS_LINE = re.compile(r"step (\d+)/\d+ epoch \d+ \| loss (\S+)")
LR_LINE = re.compile(r"step (\d+)/(\d+) epoch \d+ \| loss \S+ \| lr (\S+)")


def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (first dimensions may differ), in rank order; ``[tensor]`` without a group."""
    sizes = [n for n, in all_gather_sizes([tensor.shape[0]], tensor.device)]
    return list(torch.split(all_gather_cat(tensor, sizes=sizes), sizes))


_RANKS: dict[int, LocalRanks] = {}  # the session's local ranks, by world size


def on_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """``bench.local_ranks.run_on_local_ranks(fn, world_size, *args)`` on ranks the session keeps (``LocalRanks``, one
    set per world size): after the first call, no process starts. A check that needs a fresh process (a peak of
    memory, a warning said once per process) calls ``run_on_local_ranks``."""
    if world_size not in _RANKS:
        _RANKS[world_size] = LocalRanks(world_size)
        atexit.register(_RANKS[world_size].close)
    return _RANKS[world_size].run(fn, *args, timeout=timeout)


def subprocess_env() -> dict[str, str]:
    """The environment for a trainer subprocess: one thread per rank, unbuffered output."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def torchrun_command(nproc: int, *, port: int | None = None, nnodes: int = 1, node_rank: int = 0,
                     max_restarts: int = 0) -> list[str]:
    """The torchrun command line (static rendezvous on 127.0.0.1:port) up to, not including, train.py."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
            f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port or free_port()}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]


def _run_failed(proc: subprocess.CompletedProcess) -> AssertionError:
    """The failure of a run that ``check``ed: its command line, exit status and the ends of stdout and stderr."""
    return AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                          f"--- stderr\n{proc.stderr[-4000:]}")


def train(config: str, output: Path, *sets: str, nproc: int = 1, timeout: float = 240,
          check: bool = True) -> subprocess.CompletedProcess:
    """Run train.py on ``nproc`` ranks (plain python when 1) with ``output=...`` and ``--set`` pairs."""
    args = ["train.py", config, "--set", f"output={output}", *sets]
    cmd = [sys.executable, *args] if nproc == 1 else [*torchrun_command(nproc), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise _run_failed(proc)
    return proc


def faces(root: Path, identities: int = 8, per_identity: int = 4) -> Path:
    """A small image folder dataset (one folder per identity) under ``root``: ``per_identity`` random 112x112
    JPEGs in each, the same bytes on every call (one generator, seed 0)."""
    from torchvision.io import encode_jpeg

    g = torch.Generator().manual_seed(0)
    for identity in range(identities):
        (root / f"id{identity}").mkdir(parents=True, exist_ok=True)
        for i in range(per_identity):
            image = torch.randint(0, 256, (3, 112, 112), generator=g, dtype=torch.uint8)
            (root / f"id{identity}" / f"{i}.jpg").write_bytes(encode_jpeg(image).numpy().tobytes())
    return root


def tiny_run(folder: Path, network_kwargs: dict, *, indent: int | None = None) -> nn.Module:
    """``folder`` as the trainer leaves a run: an untrained tiny network's (seed 0, 16 features, built with
    ``network_kwargs``) model.pt and its model.json (``json.dumps`` with ``indent``). Returns the network."""
    import json

    from backbones import get_model
    from eval.model_card import MODEL_CARD, model_card

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    net = get_model("tiny", num_features=16, **network_kwargs)
    torch.save(net.state_dict(), folder / "model.pt")
    card = model_card("tiny", network_kwargs, 16, fingerprint="0" * 16, step=0)
    (folder / MODEL_CARD).write_text(json.dumps(card, indent=indent))
    return net


# The filters a fresh interpreter starts with (Python's -W default set): what a tool's process would print.
_INTERPRETER_WARNINGS = (("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                         ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                         ("ignore", ResourceWarning, ""))


def run_main(main, argv: list[str], name: str) -> subprocess.CompletedProcess:
    """``main(argv)`` of a tool (``train.main``, ``scripts.X.main``) in this process, as ``python <name> argv``
    would run it: the exit status (returned, or a ``SystemExit``'s) and stdout and stderr, which also get Python's
    warnings under a fresh interpreter's filters; an uncaught exception is a traceback on stderr and status 1.

    What it saves is the start of a process and its imports (seconds each), for tests about what the tool does;
    the tests of how it starts (``python scripts/X.py``, torchrun, signals) start a real process. The loggers a
    tool configures (the trainer's and the project's packages') are put back as they were, training.log closed.
    """
    import contextlib
    import io
    import traceback
    import warnings

    from utils.logging_setup import LIBRARY_PACKAGES, LOGGER_NAME

    loggers = [logging.getLogger(n) for n in (LOGGER_NAME, *LIBRARY_PACKAGES)]
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.resetwarnings()
        for action, category, module in reversed(_INTERPRETER_WARNINGS):
            warnings.filterwarnings(action, category=category, module=module)
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors; sys.exit(message) prints the message
            code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
            if not isinstance(exc.code, int) and exc.code is not None:
                print(exc.code, file=sys.stderr)
        except Exception:  # noqa: BLE001 - what the interpreter does with it
            traceback.print_exc()
            code = 1
        finally:
            for logger, handlers, level, propagate in saved:
                for handler in logger.handlers:
                    if handler not in handlers:
                        handler.close()
                logger.handlers, logger.propagate = handlers, propagate
                logger.setLevel(level)
    return subprocess.CompletedProcess([name, *argv], 0 if code is None else code, out.getvalue(), err.getvalue())


def train_here(config: str, output: Path, *sets: str, check: bool = True) -> subprocess.CompletedProcess:
    """``train``'s one-rank run (``python train.py ...``) in this process (``run_main``): for the tests of what a
    run does, where the start of a process adds nothing to check."""
    import train as train_py

    proc = run_main(train_py.main, [config, "--set", f"output={output}", *sets], "train.py")
    if check and proc.returncode != 0:
        raise _run_failed(proc)
    return proc


def two_nodes(config: str, output: Path, sets0: tuple[str, ...], sets1: tuple[str, ...],
              timeout: float = 240) -> list[tuple[int, str]]:
    """Two torchrun processes (``--nnodes=2``, one rank each, c10d rendezvous on 127.0.0.1) started through
    ``scripts/dist.sh --run``, as a user starts one per node; node ``r`` gets ``output`` and ``sets<r>`` as
    ``--set`` pairs. Returns ``(exit code, stdout and stderr)`` per node."""
    port = free_port()
    nodes = [subprocess.Popen(["bash", "scripts/dist.sh", "--nnodes", "2", "--nproc", "1", "--master-addr",
                               "127.0.0.1", "--master-port", str(port), "--node-rank", str(r), "--run", config,
                               "--set", f"output={output}", *sets],
                              cwd=ROOT, env={**subprocess_env(), "PYTHON": sys.executable}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r, sets in enumerate((sets0, sets1))]
    outs = []
    try:
        for node in nodes:
            outs.append(node.communicate(timeout=timeout)[0])
    finally:
        for node in nodes:
            node.kill()
    return [(node.returncode, out) for node, out in zip(nodes, outs)]


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
    from utils.files import load_tensors

    shards = sorted((load_tensors(p) for p in ckpt.glob("head_rank*.pt")), key=lambda s: s["class_start"])
    return (torch.cat([s["weight"] for s in shards]),
            {k: torch.cat([s["state"][k] for s in shards]) for k in shards[0]["state"]})


def gathered_head_after_resume(rank: int, world_size: int, config: str, sets: tuple[str, ...], ckpt: str,
                               output: str):
    """On each of ``world_size`` ranks (``tests/_dist.run_distributed``): build the trainer, resume from
    ``ckpt``, and return ``(step, weight (C, D), optimizer state (C, ...))`` gathered on rank 0."""
    import logging

    from trainer.build import build
    from trainer.checkpointing import restore_training_state
    from utils.config import load_config

    cfg = load_config(config, [*sets, f"output={output}"])
    job = build(cfg, rank, world_size, torch.device("cpu"), logging.getLogger("test"))
    state, _ = restore_training_state(job, Path(ckpt), job.derived.steps_per_epoch)
    weight = torch.cat(gather(job.head.weight.detach()))  # (C, D)
    head_state = job.opt_head.state[job.head.weight]
    gathered = {k: torch.cat(gather(v)) for k, v in sorted(head_state.items())}
    return (state.step, weight, gathered) if rank == 0 else None


def tiny_job(rank: int, world_size: int, cfg_overrides: list[str], model: nn.Module, head, *, lr: float = 0.1,
             fp16_scaler: bool = False, init_scale: float = 2.0 ** 16, autocast_dtype: torch.dtype | None = None,
             device: torch.device | str = "cpu"):
    """A trainer ``Job`` around ``model`` and ``head`` (SGD with momentum on both, as the trainer builds them)
    without data: for driving ``train.optimizer_step`` in process. ``model`` and ``head`` must be on ``device``
    already; with ``world_size > 1`` the model is wrapped in DDP there, its gradients all-reduced in fp16 when
    ``cfg_overrides`` set ``fp16=true`` (``trainer.parallelize``)."""
    from partial_fc import build_optimizers
    from trainer.build import Job
    from trainer.parallelize import parallelize
    from utils.config import derive, load_config
    from utils.precision import LossScaler

    cfg = load_config(CONFIG, cfg_overrides)
    device = torch.device(device)
    wrapped = parallelize(model, cfg, device, world_size)
    opt_backbone, opt_head = build_optimizers("sgd", model.parameters(), head, lr, 0.9, 5e-4)
    return Job(cfg=cfg, derived=derive(cfg, world_size), rank=rank, world_size=world_size,
               device=device, backbone=model, wrapped_backbone=wrapped, head=head,
               opt_backbone=opt_backbone, opt_head=opt_head,
               scaler=LossScaler(enabled=fp16_scaler, init_scale=init_scale), autocast_dtype=autocast_dtype,
               loader=None, logger=logging.getLogger("test"))


def reference_polynomial_warmup(base_lr: float, warmup: int, total: int, power: float, steps: int) -> list[float]:
    """The learning rate of each of the first ``steps`` updates under arcface_torch's current PolynomialLRWarmup.

    Written out independently from its behaviour: a torch scheduler's constructor takes step 0, which returns
    the optimizer's initial lr (the peak); every later step ``l`` returns ``base * l / w`` while ``l <= w`` and
    otherwise multiplies the previous lr by ``((1 - (l - w)/(t - w)) / (1 - (l - 1 - w)/(t - w))) ** power``; past
    ``t`` it keeps the last value. Update ``k`` (0-based) uses the value of step ``k``. ``warmup`` may be
    negative (a recipe's ``warmup_epoch = -1``).
    """
    lrs, lr = [], base_lr
    for step in range(steps):
        if 0 < step <= total:  # step 0 and steps past the end keep the previous value
            if step <= warmup:
                lr = base_lr * step / warmup
            else:
                ratio = (1.0 - (step - warmup) / (total - warmup)) / (1.0 - (step - 1 - warmup) / (total - warmup))
                lr *= ratio ** power
        lrs.append(lr)
    return lrs


def mixed_precision_steps(dtype: str, device: str) -> dict:
    """The trainer's steps with ``fp16``/``bf16 = True`` on ``configs/debug_cpu``: steps until four in a row are
    finite (with fp16 the loss scale first backs off from 2^16 until the gradients fit; at most 24 steps), then one
    step with an inf injected into a backbone gradient. What ``check_mixed_precision_steps`` judges."""
    from train import optimizer_step
    from trainer.build import build
    from trainer.run_state import TrainState
    from utils.config import load_config

    cfg = load_config("configs/debug_cpu", [f"device={device}", f"{dtype}=true", "max_nonfinite_steps=24"])
    job = build(cfg, 0, 1, torch.device(device, 0) if device == "cuda" else torch.device(device),
                logging.getLogger("test"))
    job.loader.set_epoch(0)
    batches = iter(job.loader)
    state = TrainState()
    losses: list[float | None] = []
    while len(losses) < 24 and not (len(losses) >= 4 and all(v is not None for v in losses[-4:])):
        loss = optimizer_step(job, state, [next(batches)])
        losses.append(None if loss is None else float(loss))
        state.step += 1
    settled = job.scaler.scale
    before = job.head.weight.detach().clone()
    param = next(job.backbone.parameters())
    handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))
    skipped = optimizer_step(job, state, [next(batches)])
    handle.remove()
    return dict(losses=losses, skipped=skipped, head_unchanged=torch.equal(before, job.head.weight.detach()),
                settled=settled, scale=job.scaler.scale, embedding_dtype=job.backbone(next(batches)[0]).dtype)


def check_mixed_precision_steps(r: dict, dtype: str) -> None:
    """Four finite steps in a row, reached (fp16: the scale backed off at most 8 times from 2^16); an inf in a
    backbone gradient skips the head too and (fp16) halves the settled scale; the embedding is fp32."""
    assert len(r["losses"]) >= 4 and all(v is not None and v == v for v in r["losses"][-4:]), r["losses"]
    assert r["skipped"] is None and r["head_unchanged"], "an inf in a backbone gradient must skip the head too"
    assert r["embedding_dtype"] == torch.float32
    if dtype == "fp16":
        assert r["settled"] >= 2.0 ** 8 and r["scale"] == r["settled"] / 2, (r["settled"], r["scale"], r["losses"])
    else:
        assert all(v is not None for v in r["losses"]) and len(r["losses"]) == 4, r["losses"]  # bf16: nothing skips

