"""Train a face-recognition backbone with a margin loss and a Partial FC head.

Launch forms (CONFIG is ``configs/NAME`` or the path to any ``.py`` config file):

    # one process (CPU or one GPU)
    python train.py configs/debug_cpu

    # one node, 8 GPUs
    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50

    # several nodes: run on every node (scripts/dist.sh prints the lines); c10d rendezvous on the master
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=10.0.0.1:29500 --rdzv-id=job1 --max-restarts=3 train.py configs/glint360k_r100

``--set KEY=VALUE [KEY=VALUE ...]`` overrides config keys; ``--resume`` continues the newest checkpoint in
``output`` even when the config changed (a run of the same config resumes by itself): docs/training.md,
docs/checkpoints.md. Reads top to bottom: arguments → build → resume → loop (step, log, evaluate, checkpoint) →
teardown; building the run, wrapping the backbone and checkpointing are ``trainer/``'s (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist

from trainer import checkpointing
from trainer.build import Job, build
from trainer.output_lock import hold_output
from trainer.preflight import check_on_every_rank
from trainer.run_state import TrainState, schedule_of, step_lr
from utils.config import check_world, config_from_overrides, load_config
from utils.distributed import gather_lines, get_rank, get_world_size, init_process_group, pick_device
from utils.logging_setup import ProgressLog, one_line, setup_logging
from utils.lr_scheduler import apply_lr
from utils.precision import NonFiniteLossError, autocast, nonfinite_parts
from utils.wandb_run import start_run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="configs/NAME (as in arcface_torch) or a path to a .py config file "
                                                  "(before or after --set)")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys; may be repeated: --set lr=0.1 batch_size=64 --set seed=1")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in `output` (same as resume=True)")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None,
                        help="accepted for `python -m torch.distributed.launch`, which passes it; the rank's GPU "
                             "comes from the LOCAL_RANK variable, which torchrun and the launcher set")
    args = parser.parse_args(argv)
    names = config_from_overrides(args)
    if args.config is None:
        parser.error("the config is required: train.py configs/NAME [--set KEY=VALUE ...]"
                     + (f"; got several values without '=': {names}" if names else ""))
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    return args


# ------------------------------ One optimizer step ---------------------------------------------------------
def optimizer_step(job: Job, state: TrainState, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                   bad_samples: Sequence[str] = ()) -> torch.Tensor | None:
    """Forward/backward over `gradient_acc` micro-batches (DDP synchronises on the last), then one update of
    backbone and head (of the head alone during `head_warmup_steps`), or, if the loss or any gradient on any
    rank is not finite, none: weights, optimizer state and batch-norm statistics stay, the fp16 loss scale
    backs off once. A micro-batch that the loader left with fewer than 2 samples (`bad_samples` left out; batch
    norm refuses to train on 1; with `batch_size = 1`, none) skips the step on every rank in the same way, the
    loss scale unchanged. Returns the mean loss (a device tensor, read by logging every `frequent` steps), or
    None when skipped."""
    cfg, d = job.cfg, job.derived
    lr = step_lr(state.step, state, schedule_of(cfg, d))
    apply_lr(job.opt_head, lr)
    apply_lr(job.opt_backbone, lr * cfg.backbone_lr_scale)
    # Head warm-up: the plain backbone, outside DDP, in eval mode and without a graph, so that no gradient, no
    # all-reduce and no batch-norm update reaches it (docs/finetuning.md says why not requires_grad).
    head_only = job.fine_tuning.head_only(state.step)
    job.fine_tuning.set_modes(job.backbone, state.step)
    backbone = job.backbone if head_only else job.wrapped_backbone
    # Batch-norm running statistics change in the forward pass itself; a skipped step must put them back, or
    # one NaN batch poisons every later evaluation and checkpoint. The copy is small: statistics, not weights.
    buffers = [*job.backbone.buffers(), *job.head.buffers()]  # BN statistics; AdaFace's norm statistics
    saved_buffers = [b.detach().clone() for b in buffers]
    losses = []
    fewest = min(2, cfg.batch_size)  # samples a micro-batch needs to train on
    short = False  # a micro-batch of this rank has fewer: every rank skips the step
    for i, (images, labels) in enumerate(micro_batches):
        if len(labels) < fewest:
            # Left out down to 0 or 1 samples, which batch norm refuses to train on. This rank still runs the
            # step's forward, backward and collectives, on two blank images of class 0 that only keep it in step
            # with the others, and the flags below make every rank skip the update.
            short = True
            images, labels = images.new_zeros((2, *images.shape[1:])), labels.new_zeros(2)  # (2, 3, H, W), (2,)
        last = i == len(micro_batches) - 1
        with nullcontext() if last or job.world_size == 1 else job.wrapped_backbone.no_sync():
            if cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with autocast(job.device, job.autocast_dtype):
                with torch.set_grad_enabled(not head_only):
                    embeddings = backbone(images)  # (B, D) fp32: the backbones leave autocast for their tail
                loss = job.head(embeddings, labels)  # () fp32
            # Backward runs even for a non-finite loss, so every rank's DDP reducer sees the same iteration;
            # the gradients are then dropped below. The loss is the global-batch mean: equal on every rank.
            job.scaler.scale_loss(loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    loss = torch.stack(losses).mean()  # ()
    grads = [p.grad for p in job.backbone.parameters() if p.grad is not None]
    head_grad = job.head.gradient_rows()
    bad, backbone_norm, left_out, short = nonfinite_parts(loss, grads, head_grad, len(bad_samples), short)
    if left_out:  # some rank's loader left out a sample it could not read: every rank learns which
        problems = gather_lines(list(bad_samples))
        if not cfg.skip_bad_images:
            raise ValueError(f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                             + "; fix or remove the file (scripts/rec_info.py DATA --check lists every bad one), "
                             "or set skip_bad_images = True to train without such images")
        for problem in problems:
            job.logger.warning("step %d: skipped a sample that cannot be read (skip_bad_images): %s", state.step,
                               problem)
    if short or bad:
        with torch.no_grad():
            for buffer, saved in zip(buffers, saved_buffers):
                buffer.copy_(saved)
    if short:  # the values come from the blank stand-in: neither a good step nor a non-finite one
        job.logger.warning("step %d: a rank's batch kept fewer than %d readable samples, too few to train on; update "
                           "of backbone and head skipped on every rank", state.step, fewest)
    elif not bad:
        state.nonfinite_in_row = 0
        inv_scale = 1.0 / job.scaler.scale
        if job.scaler.is_enabled():  # unscale both: the updates, clipping and weight decay see true gradients
            for grad in grads + ([head_grad] if head_grad is not None else []):
                grad.mul_(inv_scale)
        if cfg.clip_grad_norm > 0 and grads:  # the backbone only, as the reference
            params = [p for p in job.backbone.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, cfg.clip_grad_norm, backbone_norm * inv_scale)
        job.opt_backbone.step()
        job.opt_head.step()
    else:
        state.nonfinite_in_row += 1
        state.skipped_steps += 1
        backoff = (f"; loss scale {job.scaler.scale:g} -> {job.scaler.scale * job.scaler.backoff_factor:g}"
                   if job.scaler.is_enabled() else "")
        job.logger.warning("step %d: non-finite %s (loss %s); update of backbone and head skipped (%d in a row, "
                           "stop at %d)%s", state.step, ", ".join(bad), float(loss), state.nonfinite_in_row,
                           cfg.max_nonfinite_steps, backoff)
    if not short:
        job.scaler.update(skipped=bool(bad))
    job.opt_backbone.zero_grad(set_to_none=True)
    job.opt_head.zero_grad(set_to_none=True)
    if state.nonfinite_in_row >= cfg.max_nonfinite_steps:
        raise NonFiniteLossError(state.nonfinite_in_row, state.step, job.output / "checkpoints")
    return None if bad or short else loss


# ------------------------------ Loop -----------------------------------------------------------------------
def train(job: Job, state: TrainState) -> None:
    cfg, d, logger = job.cfg, job.derived, job.logger
    progress = None
    if job.rank == 0 and sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=d.total_steps, initial=state.step, unit="step", dynamic_ncols=True)
    progress_log = ProgressLog(logger, job.writer, d.total_steps, d.images_per_step, state.step)
    by_epochs = cfg.num_epoch * d.steps_per_epoch
    length = (f"max_steps = {cfg.max_steps} (num_epoch = {cfg.num_epoch} would be {by_epochs})" if cfg.max_steps > 0
              else f"num_epoch = {cfg.num_epoch}")
    logger.info("training: %d steps, set by %s; %d steps per epoch, global batch %d x %d accumulation, from step %d",
                d.total_steps, length, d.steps_per_epoch, d.global_batch_size, cfg.gradient_acc, state.step)
    while state.step < d.total_steps:
        job.loader.set_epoch(state.epoch, start_step=state.step_in_epoch * cfg.gradient_acc)
        batches = iter(job.loader)
        while state.step_in_epoch < d.steps_per_epoch and state.step < d.total_steps:
            micro_batches = [next(batches) for _ in range(cfg.gradient_acc)]
            bad_samples = job.loader.take_problems() if hasattr(job.loader, "take_problems") else []
            progress_log.add(optimizer_step(job, state, micro_batches, bad_samples))
            state.step += 1
            state.step_in_epoch += 1
            epoch_end = state.step_in_epoch == d.steps_per_epoch
            if epoch_end:
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
            if progress is not None:
                progress.update(1)
            if state.step % cfg.frequent == 0 or state.step == d.total_steps:
                mean = progress_log.log(state.step, state.epoch, job.opt_head.param_groups[0]["lr"],
                                        job.scaler.scale if job.scaler.is_enabled() else None)
                if progress is not None:
                    progress.set_postfix(loss=f"{mean:.3f}", epoch=state.epoch)
            if job.callback is not None and state.step % cfg.verbose == 0:
                job.callback(state.step, job.backbone)
            if checkpointing.checkpoint_due(state.step, epoch_end, d.steps_per_epoch, d.total_steps,
                                            cfg.save_every_steps):
                checkpointing.save_run(job, state, logger)
                if (epoch_end or state.step == d.total_steps) and job.wandb is not None and cfg.save_artifacts:
                    job.wandb.log_model(job.output / "model.pt", state.step, state.epoch if epoch_end else None)
            if epoch_end:
                break
    if progress is not None:
        progress.close()
    logger.info("done: %d steps, %d skipped for a non-finite loss or gradient; model at %s", state.step,
                state.skipped_steps, job.output / "model.pt")


# ------------------------------ Entry point ----------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides) + (["resume=true"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides)
        device = pick_device(cfg.device)
    except (ValueError, FileNotFoundError) as exc:  # a mistake in the config or --set: one line, no traceback
        # Found before the run has a process group or a folder to log in: every rank of a node meets it (they
        # read the same files), its first rank says it, on stderr only (the folder may be what is wrong).
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"train.py: {exc}", file=sys.stderr)
        return 2
    init_process_group(device, cfg.dist_timeout_minutes)
    try:
        rank, world_size = get_rank(), get_world_size()
        logger = setup_logging(rank, cfg.output)
        job, lock, code = None, None, 1  # the exit code: 1 until training ends (0) or stops on a mistake (2, 3)
        try:
            check_world(cfg, world_size)
            check_on_every_rank(cfg, rank)
            lock = hold_output(cfg.output, rank, logger)  # before anything reads or writes the folder's run
            logger.info("config %s (%d ranks, backend %s, device %s, %d torch threads per rank):\n%s", args.config,
                        world_size, dist.get_backend() if dist.is_initialized() else "none", device,
                        torch.get_num_threads(), cfg)
            job = build(cfg, rank, world_size, device, logger)
            state = checkpointing.resume(job, job.derived.steps_per_epoch, logger)
            if rank == 0 and job.cfg.using_wandb:  # once the run knows where it resumes, which it may refuse
                job.wandb = start_run(job.cfg, job.output, logger)
                if job.wandb is not None:
                    job.writer.add(job.wandb)
            train(job, state)
            code = 0
        except NonFiniteLossError as exc:
            logger.error("%s", exc)
            code = 3
        except ValueError as exc:  # a mistake in the config, the data or the folder: one line, once, exit 2
            code = 2
            # Every rank meets it (they read the same config, data and folder): rank 0 says it, in training.log
            # too; the first rank of each other node says it on stderr, as that node's output.
            if rank == 0:
                logger.error("%s", one_line(exc))
            elif os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"train.py: rank {rank}: {one_line(exc)}", file=sys.stderr)
        finally:  # TensorBoard's last events flushed, the wandb run finished with the exit code, whatever happened
            if job is not None and job.wandb is not None:
                job.wandb.exit_code = code
            if job is not None and job.writer is not None:
                job.writer.close()
            if lock is not None:
                lock.release()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
