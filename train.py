"""Train a face-recognition backbone with a margin loss and a Partial FC head.

Launch forms (CONFIG is ``configs/NAME`` or the path to any ``.py`` config file):

    # one process (CPU or one GPU)
    python train.py configs/debug_cpu

    # one node, 8 GPUs
    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50

    # several nodes: run on every node (scripts/dist.sh prints the lines); c10d rendezvous on the master
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=10.0.0.1:29500 --rdzv-id=job1 --max-restarts=3 train.py configs/glint360k_r100

Options: ``--set KEY=VALUE [KEY=VALUE ...]`` (repeatable) overrides config keys, parsed to the key's type;
``--resume`` continues from the newest complete checkpoint in ``output`` (this also happens by itself
when ``output`` holds checkpoints of the same config, unless ``auto_resume=False``).

The file reads top to bottom: arguments → process group → build (model, head, optimizers, data) →
resume → loop (step, log, evaluate, checkpoint) → teardown.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from utils.cpu_memory import keep_freed_memory
from utils.precision import LossScaler, configure_tf32


# ----------------------------------------------------------------------------------------------------------
# Arguments and process group
# ----------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="configs/NAME (as in arcface_torch) or a path to a .py config file")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys; may be repeated: --set lr=0.1 batch_size=64 --set seed=1")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in `output` (same as resume=True)")
    return parser.parse_args(argv)


def pick_device(requested: str) -> torch.device:
    """The device for this process: `cuda:LOCAL_RANK` under torchrun on GPUs, else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("config asks for device='cuda' but torch.cuda.is_available() is False on this machine; "
                           "use device='cpu' or 'auto'")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device: torch.device, timeout_minutes: float) -> None:
    """Join the process group torchrun describes (env://), also a 1-rank one, so that a launch through torchrun
    always runs the collectives' real code; a plain `python` launch stays without a process group."""
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    # NCCL binds the group to this rank's GPU at once (no guessing of the device at the first collective).
    bound = {"device_id": device} if device.type == "cuda" else {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout, **bound)
        return
    # Under torchrun the store can outlive a restart (the agent's store serves every round). A restarted
    # group that reads the previous round's keys makes gloo connect to the dead ranks' addresses and fail,
    # so every attempt gets its own key space.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent_store, timeout=timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"facetrain/attempt_{attempt}", store),
                            rank=rank, world_size=world_size, timeout=timeout, **bound)


# ----------------------------------------------------------------------------------------------------------
# Build
# ----------------------------------------------------------------------------------------------------------
@dataclass
class TrainState:
    """Where the run is. Saved in every checkpoint; the data position is (epoch, step_in_epoch)."""

    step: int = 0  # optimizer steps taken (skipped non-finite steps count: their batches were consumed)
    epoch: int = 0
    step_in_epoch: int = 0
    nonfinite_in_row: int = 0
    skipped_steps: int = 0


@dataclass
class Job:
    """Everything the loop needs, built once."""

    cfg: Any
    derived: Any
    rank: int
    world_size: int
    device: torch.device
    backbone: nn.Module  # DDP-wrapped when world_size > 1
    model: nn.Module  # the plain backbone (what model.pt holds)
    head: nn.Module
    opt_backbone: torch.optim.Optimizer
    opt_head: torch.optim.Optimizer
    scaler: Any  # utils.precision.LossScaler
    autocast_dtype: torch.dtype | None
    loader: Any
    logger: Any
    writer: Any = None
    callback: Any = None
    output: Path = field(default_factory=Path)
    fingerprint: str = ""



def build_model(cfg, device: torch.device) -> nn.Module:
    """The backbone from the registry, optionally initialised from pretrained weights (strict)."""
    from backbones import get_model

    model = get_model(cfg.network, num_features=cfg.embedding_size, **dict(cfg.network_kwargs))
    if cfg.init_backbone:
        from utils.weights import load_weights

        load_weights(model, cfg.init_backbone, network=cfg.network)
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.parallel.DistributedDataParallel:
    """DDP over ``model``: gradients live in DDP's buckets (no second copy), and each rank keeps its own
    batch-norm running statistics between steps, as the reference does (rank 0's are saved)."""
    kwargs: dict[str, Any] = {"device_ids": [device.index] if device.type == "cuda" else None,
                              "gradient_as_bucket_view": True}
    # torch 2.14 renamed broadcast_buffers (now deprecated, with a warning); earlier releases know only it.
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = False
    else:
        kwargs["broadcast_buffers"] = False
    return nn.parallel.DistributedDataParallel(model, **kwargs)


def build_optimizer(name: str, params, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def build(cfg, rank: int, world_size: int, device: torch.device, logger) -> Job:
    from dataset import build_dataset, get_dataloader
    from losses import CombinedMarginLoss
    from partial_fc import PartialFC, build_head_optimizer
    from utils.config import derive, fingerprint

    # Every rank builds the same backbone from the same seed; DDP also broadcasts rank 0's weights.
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, device)
    backbone: nn.Module = model
    if world_size > 1:
        backbone = wrap_ddp(model, device)
        if cfg.fp16:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            backbone.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if cfg.compile:
        backbone = torch.compile(backbone, backend=cfg.compile_backend)

    m1, m2, m3 = cfg.margin_list
    margin = CombinedMarginLoss(cfg.margin_scale, m1, m2, m3, cfg.interclass_filtering_threshold,
                                gradient=cfg.margin_gradient)
    head = PartialFC(margin, cfg.embedding_size, cfg.num_classes, cfg.sample_rate, seed=cfg.seed).to(device)

    opt_backbone = build_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.momentum, cfg.weight_decay)
    opt_head = build_head_optimizer(head, cfg.optimizer, lr=cfg.lr, momentum=cfg.momentum,
                                    weight_decay=cfg.weight_decay)
    scaler = LossScaler(enabled=cfg.fp16)
    configure_tf32(device, cfg.tf32)
    autocast_dtype = torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None

    if cfg.dali:
        from dataset import get_dali_dataloader

        loader = get_dali_dataloader(cfg.rec, cfg.batch_size, rank=rank, world_size=world_size, seed=cfg.seed,
                                     device=device)
        num_images = loader.num_images
    else:
        data = build_dataset(cfg.rec, num_classes=cfg.num_classes, seed=cfg.seed, num_images=cfg.num_image)
        loader = get_dataloader(data, cfg.batch_size, rank=rank, world_size=world_size, seed=cfg.seed,
                                num_workers=cfg.num_workers, device=device)
        num_images = len(data)
    if num_images != cfg.num_image:
        raise ValueError(f"num_image = {cfg.num_image} in the config, but the dataset {cfg.rec!r} holds {num_images} "
                         f"images; set num_image = {num_images} (it sets the steps per epoch and the LR schedule)")
    derived = derive(cfg, world_size)

    output = Path(cfg.output)
    writer = callback = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(output / "tensorboard"))
    if cfg.val_targets and cfg.rec != "synthetic":
        from eval.callback import CallbackVerification

        callback = CallbackVerification(list(cfg.val_targets), rec_prefix=cfg.rec, summary_writer=writer,
                                        device=device)
    return Job(cfg=cfg, derived=derived, rank=rank, world_size=world_size, device=device, backbone=backbone,
               model=model, head=head, opt_backbone=opt_backbone, opt_head=opt_head, scaler=scaler,
               autocast_dtype=autocast_dtype, loader=loader, logger=logger, writer=writer, callback=callback,
               output=output, fingerprint=fingerprint(cfg))


# ----------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------
def save(job: Job, state: TrainState) -> None:
    """`model.pt` (rank 0) and, with `save_all_states`, a step checkpoint in which every rank writes its head
    shard; both are written to a temporary name and renamed only when complete."""
    from utils import checkpoint

    if job.cfg.save_all_states:
        common = None
        if job.rank == 0:
            common = checkpoint.make_common(
                step=state.step, epoch=state.epoch, step_in_epoch=state.step_in_epoch,
                lr=job.opt_backbone.param_groups[0]["lr"], backbone=job.model.state_dict(),
                backbone_optimizer=job.opt_backbone.state_dict(), scaler=job.scaler.state_dict(),
                world_size=job.world_size, num_classes=job.cfg.num_classes, fingerprint=job.fingerprint,
                config={**job.cfg.to_dict(), "skipped_steps": state.skipped_steps})
        head = checkpoint.head_shard(job.head.weight, job.opt_head.state[job.head.weight], job.head.class_start,
                                     job.cfg.num_classes)
        path = checkpoint.save_checkpoint(job.output, state.step, rank=job.rank, world_size=job.world_size,
                                          head=head, common=common, keep=job.cfg.keep_checkpoints)
        job.logger.info("checkpoint %s (step %d; next: epoch %d, step %d in epoch)", path, state.step, state.epoch,
                        state.step_in_epoch)
    if job.rank == 0:
        checkpoint.save_atomic(job.model.state_dict(), job.output / "model.pt")


def resume_position(step: int, epoch: int, step_in_epoch: int, saved_world_size: int, world_size: int,
                    steps_per_epoch: int, max_steps: int) -> tuple[int, int, int]:
    """``(step, epoch, step_in_epoch)`` to continue from, in units of the new world size's optimizer steps.

    On the same world size nothing changes. On another one a step holds ``world_size / saved_world_size``
    times the samples: the position in the epoch keeps the samples consumed (rounded down, so a few are
    seen again rather than skipped), and for an epoch-based run (``max_steps = 0``) the step counter is
    recomputed from the epoch position, so the LR schedule continues at the same fraction of training and
    the run still ends after the configured epochs. A step-based run (``max_steps > 0``) keeps its step.
    """
    if saved_world_size == world_size:
        return step, epoch, step_in_epoch
    step_in_epoch = step_in_epoch * saved_world_size // world_size
    if step_in_epoch >= steps_per_epoch:
        epoch, step_in_epoch = epoch + 1, 0
    if max_steps == 0:
        step = epoch * steps_per_epoch + step_in_epoch
    return step, epoch, step_in_epoch


def resume(job: Job, ckpt_dir: Path) -> TrainState:
    """Restore everything `save` wrote; the head rows are re-partitioned when the world size changed."""
    from utils import checkpoint

    common = checkpoint.load_common(ckpt_dir)
    if common["fingerprint"] != job.fingerprint:
        raise ValueError(f"checkpoint {ckpt_dir} was written by a different config (fingerprint "
                         f"{common['fingerprint']} != {job.fingerprint}); use another `output`, or set "
                         f"auto_resume=False and resume=False to start afresh")
    job.model.load_state_dict(common["backbone"])
    job.opt_backbone.load_state_dict(common["backbone_optimizer"])
    job.scaler.load_state_dict(common["scaler"])
    rows = checkpoint.load_head_rows(ckpt_dir, job.head.class_start, job.head.num_local,
                                     num_classes=job.cfg.num_classes)
    checkpoint.restore_head(job.head.weight, job.opt_head, rows)
    rng = checkpoint.load_rng(ckpt_dir, job.rank)
    if common["world_size"] == job.world_size and rng is not None:
        checkpoint.set_rng_state(rng)
    else:
        # A new world size cannot continue the old per-rank random streams; start new ones deterministically.
        torch.manual_seed(job.cfg.seed + 1_000_003 * common["step"] + job.rank)
        job.logger.info("world size changed %d -> %d: head re-partitioned, random streams re-seeded",
                        common["world_size"], job.world_size)
    step, epoch, step_in_epoch = resume_position(common["step"], common["epoch"], common["step_in_epoch"],
                                                 common["world_size"], job.world_size,
                                                 job.derived.steps_per_epoch, job.cfg.max_steps)
    state = TrainState(step=step, epoch=epoch, step_in_epoch=step_in_epoch,
                       skipped_steps=common["config"].get("skipped_steps", 0))
    job.logger.info("resumed from %s at step %d (epoch %d, step %d in epoch)", ckpt_dir, state.step,
                    state.epoch, state.step_in_epoch)
    return state


# ----------------------------------------------------------------------------------------------------------
# One optimizer step
# ----------------------------------------------------------------------------------------------------------
class NonFiniteLossError(RuntimeError):
    """Raised after `max_nonfinite_steps` optimizer steps in a row were skipped for non-finite values."""


def _backbone_grads(job: Job) -> list[torch.Tensor]:
    return [p.grad for p in job.model.parameters() if p.grad is not None]


def _head_grad_values(job: Job) -> torch.Tensor | None:
    """The head's gradient as a dense ``(rows, D)`` tensor: itself, or the values of the sparse gradient (which
    is coalesced in place first, so that changing the values changes the gradient)."""
    grad = job.head.weight.grad
    if grad is None:
        return None
    if not grad.is_sparse:
        return grad
    if not grad.is_coalesced():  # a sum over micro-batches
        job.head.weight.grad = grad = grad.coalesce()
    return grad.values()


def step_is_finite(job: Job, loss: torch.Tensor) -> tuple[bool, list[str], torch.Tensor]:
    """One decision for both optimizers on every rank: are the loss, the backbone's and the head's gradients
    finite everywhere? Returns ``(finite, what was not, the backbone's gradient norm)`` (the norm of the
    gradients as they are: loss-scaled with fp16).

    The backbone's gradients are equal on every rank after DDP's all-reduce, the loss is the global mean,
    but the head's gradients are this rank's own: the three flags are all-reduced (MAX), so every rank
    skips or steps together. Reading them is the one host-device synchronisation of the trainer's step.
    """
    from torch.nn.utils import get_total_norm

    from utils.distributed import all_reduce, to_host

    grads = _backbone_grads(job)
    backbone = get_total_norm(grads) if grads else loss.new_zeros(())  # () of the scaled gradients
    head = _head_grad_values(job)
    head_sum = head.sum() if head is not None else loss.new_zeros(())  # () non-finite iff an entry is
    flags = (~torch.isfinite(torch.stack([loss.float(), backbone.float(), head_sum.float()]))).float()  # (3,)
    bad = to_host(all_reduce(flags, dist.ReduceOp.MAX))
    names = [name for name, b in zip(("loss", "backbone gradients", "head gradients"), bad) if b]
    return not names, names, backbone


def optimizer_step(job: Job, state: TrainState,
                   micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """Forward/backward over `gradient_acc` micro-batches, then one update of backbone and head, or none.

    The loss of each micro-batch is divided by their number; DDP synchronises only on the last one
    (`no_sync`). If the loss or any gradient (backbone's or head's, on any rank) is not finite, both
    optimizers skip the step: gradients are dropped, weights, optimizer state and batch-norm running
    statistics stay as they were, and the fp16 loss scale backs off once. Returns the mean loss as a
    device tensor (not read here: logging reads it every `frequent` steps), or None when skipped.
    """
    from utils.lr_scheduler import apply_lr, lr_at
    from utils.precision import autocast

    cfg, d = job.cfg, job.derived
    apply_lr([job.opt_backbone, job.opt_head],
             lr_at(state.step, cfg.lr, d.warmup_steps, d.total_steps, power=cfg.lr_power))
    # Batch-norm running statistics change in the forward pass itself; a skipped step must put them back, or
    # one NaN batch poisons every later evaluation and checkpoint. The copy is small (r100: ~0.2 MB).
    saved_buffers = [b.detach().clone() for b in job.model.buffers()]
    losses = []
    for i, (images, labels) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = nullcontext() if last or job.world_size == 1 else job.backbone.no_sync()
        with sync:
            if cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with autocast(job.device, job.autocast_dtype):
                embeddings = job.backbone(images)  # (B, D) fp32: the backbones leave autocast for their tail
                loss = job.head(embeddings, labels)  # () fp32
            # Backward runs even for a non-finite loss, so every rank's DDP reducer sees the same iteration;
            # the gradients are then dropped below. The loss is the global-batch mean: equal on every rank.
            job.scaler.scale_loss(loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    loss = torch.stack(losses).mean()  # ()
    finite, bad, backbone_norm = step_is_finite(job, loss)
    if finite:
        state.nonfinite_in_row = 0
        grads = _backbone_grads(job)
        inv_scale = 1.0 / job.scaler.scale
        if job.scaler.is_enabled():  # unscale both: the updates, clipping and weight decay see true gradients
            head = _head_grad_values(job)
            for grad in grads + ([head] if head is not None else []):
                grad.mul_(inv_scale)
        if cfg.clip_grad_norm > 0 and grads:  # the backbone only, as the reference
            params = [p for p in job.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, cfg.clip_grad_norm, backbone_norm * inv_scale)
        job.opt_backbone.step()
        job.opt_head.step()
    else:
        state.nonfinite_in_row += 1
        state.skipped_steps += 1
        with torch.no_grad():
            for buffer, saved in zip(job.model.buffers(), saved_buffers):
                buffer.copy_(saved)
        job.logger.warning("step %d: non-finite %s (loss %s); update of backbone and head skipped (%d in a row, "
                           "stop at %d)%s", state.step, ", ".join(bad), float(loss), state.nonfinite_in_row,
                           cfg.max_nonfinite_steps,
                           f"; loss scale {job.scaler.scale:g} -> {job.scaler.scale * job.scaler.backoff_factor:g}"
                           if job.scaler.is_enabled() else "")
    job.scaler.update(skipped=not finite)
    job.opt_backbone.zero_grad(set_to_none=True)
    job.opt_head.zero_grad(set_to_none=True)
    if state.nonfinite_in_row >= cfg.max_nonfinite_steps:
        raise NonFiniteLossError(
            f"the loss or the gradients were not finite for {state.nonfinite_in_row} optimizer steps in a row (up "
            f"to step {state.step}); stopping. Weights were not updated on those steps and the newest complete "
            f"checkpoint in {job.output / 'checkpoints'} is intact. Lower `lr`, check the data, or use fp16/bf16 "
            f"with care")
    return loss if finite else None


# ----------------------------------------------------------------------------------------------------------
# Loop
# ----------------------------------------------------------------------------------------------------------
class Meter:
    """Running mean of the loss and throughput since the last log line (``steps`` counts skipped steps too:
    their batches were read and computed). Losses are summed on the device; ``mean`` reads the sum on the
    host, once per log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total: torch.Tensor | float = 0.0
        self.count, self.steps, self.start = 0, 0, time.perf_counter()

    def add(self, loss: torch.Tensor | None) -> None:
        """One step's loss (a device tensor), or None for a skipped step."""
        self.steps += 1
        if loss is not None:
            self.total = self.total + loss
            self.count += 1

    @property
    def mean(self) -> float:
        return float(self.total) / self.count if self.count else float("nan")


def train(job: Job, state: TrainState) -> None:
    cfg, d, logger = job.cfg, job.derived, job.logger
    steps_per_epoch, total_steps = d.steps_per_epoch, d.total_steps
    samples_per_step = d.global_batch_size * cfg.gradient_acc
    progress = None
    if job.rank == 0 and sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=total_steps, initial=state.step, unit="step", dynamic_ncols=True)
    meter, run_start, run_start_step = Meter(), time.perf_counter(), state.step
    logger.info("training: %d steps (%d per epoch), global batch %d x %d accumulation, from step %d",
                total_steps, steps_per_epoch, d.global_batch_size, cfg.gradient_acc, state.step)
    while state.step < total_steps:
        job.loader.set_epoch(state.epoch, start_step=state.step_in_epoch * cfg.gradient_acc)
        batches = iter(job.loader)
        while state.step_in_epoch < steps_per_epoch and state.step < total_steps:
            micro = [next(batches) for _ in range(cfg.gradient_acc)]
            loss = optimizer_step(job, state, micro)
            meter.add(loss)
            state.step += 1
            state.step_in_epoch += 1
            epoch_end = state.step_in_epoch == steps_per_epoch
            if epoch_end:
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
            if progress is not None:
                progress.update(1)
            if state.step % cfg.frequent == 0 or state.step == total_steps:
                mean = log_progress(job, state, meter, samples_per_step, run_start, run_start_step)
                if progress is not None:
                    progress.set_postfix(loss=f"{mean:.3f}", epoch=state.epoch)
            if job.callback is not None and state.step % cfg.verbose == 0:
                job.callback(state.step, job.model)
            if epoch_end or state.step == total_steps or (
                    cfg.save_every_steps and state.step % cfg.save_every_steps == 0):
                save(job, state)
            if epoch_end:
                break
    if progress is not None:
        progress.close()
    logger.info("done: %d steps, %d skipped for a non-finite loss; model at %s", state.step, state.skipped_steps,
                job.output / "model.pt")


def log_progress(job: Job, state: TrainState, meter: Meter, samples_per_step: int, run_start: float,
                 run_start_step: int) -> float:
    """One log line (and TensorBoard scalars) for the steps since the last one; returns their mean loss."""
    now = time.perf_counter()
    mean = meter.mean  # reads the summed loss on the host
    steps = max(state.step - run_start_step, 1)
    # The interval since the last line: `frequent` steps, fewer for the last line or after a resume.
    speed = samples_per_step * meter.steps / max(now - meter.start, 1e-9)
    eta = (job.derived.total_steps - state.step) * (now - run_start) / steps
    lr = job.opt_backbone.param_groups[0]["lr"]
    scale = job.scaler.scale
    job.logger.info("step %d/%d epoch %d | loss %.4f | lr %.6f | %.1f samples/s | grad scale %g | eta %s",
                    state.step, job.derived.total_steps, state.epoch, mean, lr, speed, scale,
                    datetime.timedelta(seconds=int(eta)))
    if job.writer is not None:
        job.writer.add_scalar("train/loss", mean, state.step)
        job.writer.add_scalar("train/lr", lr, state.step)
        job.writer.add_scalar("train/samples_per_sec", speed, state.step)
        if job.scaler.is_enabled():
            job.writer.add_scalar("train/grad_scale", scale, state.step)
    meter.reset()
    return mean


# ----------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    from utils import checkpoint
    from utils.config import check_paths, check_world, load_config
    from utils.distributed import get_rank, get_world_size
    from utils.logging_setup import setup_logging

    args = parse_args(argv)
    overrides = list(args.overrides) + (["resume=true"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as exc:  # a mistake in the config or --set: one line, no traceback
        print(f"train.py: {exc}", file=sys.stderr)
        return 2
    device = pick_device(cfg.device)
    if device.type == "cpu":
        keep_freed_memory()  # the head's large per-step tensors reuse warm heap pages (utils/cpu_memory.py)
    init_distributed(device, cfg.dist_timeout_minutes)
    try:
        rank, world_size = get_rank(), get_world_size()
        logger = setup_logging(rank, cfg.output)
        try:
            check_world(cfg, world_size)
            check_paths(cfg)
        except ValueError as exc:
            logger.error("%s", exc)
            return 2
        logger.info("config %s (%d ranks, backend %s, device %s):\n%s", args.config, world_size,
                    dist.get_backend() if dist.is_initialized() else "none", device, cfg)
        job = build(cfg, rank, world_size, device, logger)
        state = TrainState()
        if rank == 0:
            checkpoint.clean_partial(job.output)
        if isinstance(cfg.resume, str):
            latest = Path(cfg.resume)
        else:
            latest = checkpoint.find_latest(job.output) if (cfg.resume or cfg.auto_resume) else None
        if cfg.resume and latest is None:
            logger.info("resume requested but %s holds no complete checkpoint: starting from step 0",
                        job.output / "checkpoints")
        if latest is not None:
            state = resume(job, latest)
        try:
            train(job, state)
        except NonFiniteLossError as exc:
            logger.error("%s", exc)
            return 3
        if job.writer is not None:
            job.writer.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
