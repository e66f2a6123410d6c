"""A run built from its config: the loader, the backbone (plain and wrapped), the head, both optimizers, the
loss scale, the writers and the verification callback, in one ``Job``."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from backbones import get_model
from backbones.memory_format import check_channels_last
from dataset import DaliLoader, FaceDataLoader, build_data, data_identity
from eval.callback import CallbackVerification
from losses import build_margin
from partial_fc import PartialFC, build_optimizers
from trainer.finetune import FineTuning, folded_batch_norms_warning, prepare
from trainer.parallelize import parallelize
from utils.config import Config, Derived, check_world, derive, fingerprint
from utils.files import load_weights
from utils.precision import LossScaler, configure_cuda
from utils.wandb_run import ScalarWriters, WandbWriter


@dataclass
class Job:
    """Everything the loop needs, built once by ``build``."""

    cfg: Config
    derived: Derived
    rank: int
    world_size: int
    device: torch.device
    backbone: nn.Module  # the plain backbone: what model.pt, checkpoints and evaluation use
    wrapped_backbone: nn.Module  # what the step calls: `backbone` inside DDP and/or torch.compile
    head: PartialFC
    opt_backbone: torch.optim.Optimizer
    opt_head: torch.optim.Optimizer
    scaler: LossScaler
    autocast_dtype: torch.dtype | None
    loader: FaceDataLoader | DaliLoader | None
    logger: logging.Logger
    writer: ScalarWriters | None = None  # rank 0: TensorBoard, and the wandb run once it starts
    wandb: WandbWriter | None = None  # rank 0 with using_wandb = True, once the run has started
    callback: CallbackVerification | None = None
    output: Path = Path(".")
    fingerprint: str = ""  # of the config and the data's identity: what a checkpoint must match to auto-resume
    data_identity: str = "synthetic"
    fine_tuning: FineTuning = field(default_factory=FineTuning)  # frozen batch norms, head-only steps


def build_backbone(cfg: Config, device: torch.device) -> nn.Module:
    """The backbone from the registry, optionally initialised from pretrained weights (strict)."""
    model = get_model(cfg.network, num_features=cfg.embedding_size, **dict(cfg.network_kwargs))
    if cfg.init_backbone:
        load_weights(model, cfg.init_backbone, network=cfg.network)
    model = model.to(device)
    if not cfg.channels_last:
        return model
    check_channels_last(model, device, cfg.network)
    return model.to(memory_format=torch.channels_last)


def build_margin_of(cfg: Config) -> nn.Module:
    """The margin ``cfg`` asks for (``margin`` and the keys that margin reads)."""
    return build_margin(cfg.margin, scale=cfg.margin_scale, gradient=cfg.margin_gradient, margin_list=cfg.margin_list,
                        interclass_filtering_threshold=cfg.interclass_filtering_threshold, adaface_m=cfg.adaface_m,
                        adaface_h=cfg.adaface_h, adaface_t_alpha=cfg.adaface_t_alpha)


def build(cfg: Config, rank: int, world_size: int, device: torch.device, logger: logging.Logger) -> Job:
    """Turn ``cfg`` into the run's parts: the one place that reads the config for the components, which take
    plain arguments. ``num_classes`` / ``num_image`` left None are filled in from the dataset (``job.cfg``)."""
    loader, num_classes, num_image = build_data(
        cfg.rec, cfg.batch_size, num_classes=cfg.num_classes, num_image=cfg.num_image, seed=cfg.seed,
        num_workers=cfg.num_workers, dali=cfg.dali, rank=rank, world_size=world_size, device=device, logger=logger)
    if cfg.num_classes is None or cfg.num_image is None:
        cfg = cfg.updated(num_classes=num_classes, num_image=num_image)
    check_world(cfg, world_size)
    torch.manual_seed(cfg.seed)  # every rank builds the same backbone; DDP also broadcasts rank 0's weights
    backbone = build_backbone(cfg, device)
    # Frozen stages leave DDP's reducer: freeze before wrapping.
    fine_tuning, summary = prepare(backbone, cfg.network, cfg.lr, freeze_stages=cfg.freeze_stages,
                                   freeze_bn=cfg.freeze_bn, head_warmup_steps=cfg.head_warmup_steps,
                                   backbone_lr_scale=cfg.backbone_lr_scale)
    if summary is not None:
        logger.info("%s", summary)
    if (warning := folded_batch_norms_warning(cfg.init_backbone, cfg.freeze_bn)) is not None:
        logger.warning("%s", warning)
    wrapped = parallelize(backbone, cfg, device, world_size)

    head = PartialFC(build_margin_of(cfg), cfg.embedding_size, cfg.num_classes, cfg.sample_rate, seed=cfg.seed,
                     sub_centers=cfg.sub_centers, update=cfg.head_update, compile=cfg.compile_head, device=device)
    opt_backbone, opt_head = build_optimizers(cfg.optimizer, backbone.parameters(), head, cfg.lr, cfg.momentum,
                                              cfg.weight_decay)
    configure_cuda(device, cfg.tf32, cfg.cudnn_benchmark)
    output, data = Path(cfg.output), data_identity(cfg.rec)
    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = ScalarWriters(SummaryWriter(log_dir=str(output / "tensorboard")))
    autocast_dtype = torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None
    callback = None
    if cfg.val_targets and cfg.rec != "synthetic":
        # Verification runs in the training precision, as the forward it checks.
        callback = CallbackVerification(list(cfg.val_targets), rec_prefix=cfg.rec, summary_writer=writer,
                                        device=device, autocast_dtype=autocast_dtype)
    return Job(cfg=cfg, derived=derive(cfg, world_size), rank=rank, world_size=world_size, device=device,
               backbone=backbone, wrapped_backbone=wrapped, head=head, opt_backbone=opt_backbone, opt_head=opt_head,
               scaler=LossScaler(enabled=cfg.fp16), autocast_dtype=autocast_dtype,
               loader=loader, logger=logger, writer=writer, callback=callback, output=output,
               fingerprint=fingerprint(cfg, data), data_identity=data, fine_tuning=fine_tuning)
