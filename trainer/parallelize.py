"""The plain backbone wrapped for the step, as torchtitan's ``parallelize``: parallelism is a layer applied to
a plain model, which stays what ``model.pt``, checkpoints and evaluation use."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from backbones.memory_format import check_channels_last
from utils.config import Config
from utils.distributed import wrap_ddp


def parallelize(backbone: nn.Module, cfg: Config, device: torch.device, world_size: int) -> nn.Module:
    """What the step calls: ``backbone`` inside DDP when ``world_size > 1`` (with ``fp16``, its gradients
    all-reduced in fp16) and/or ``torch.compile`` when ``compile``; ``backbone`` itself when neither."""
    wrapped: nn.Module = backbone
    if world_size > 1:
        wrapped = wrap_ddp(backbone, device)
        if cfg.fp16:  # fp16 gradients on the wire: half the all-reduce traffic, as the reference
            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if cfg.compile:
        if cfg.compile_backend == "inductor":  # it lays CPU convolutions out channels-last by itself
            check_channels_last(backbone, device, cfg.network, setting="compile = True with compile_backend = "
                                "'inductor'", remedy="set compile = False or compile_backend = 'aot_eager'")
        wrapped = torch.compile(wrapped, backend=cfg.compile_backend)
    return wrapped
