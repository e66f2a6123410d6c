"""The training loader a config asks for: DALI's or ours over the dataset ``rec`` names."""
from __future__ import annotations

import logging

import torch

from dataset.dali import DaliLoader, get_dali_dataloader
from dataset.faces import build_dataset
from dataset.loader import FaceDataLoader, get_dataloader
from utils.config import Config


def build_data(cfg: Config, rank: int, world_size: int, device: torch.device,
               logger: logging.Logger) -> tuple[FaceDataLoader | DaliLoader, Config]:
    """The loader, and the config with `num_classes`/`num_image` filled in from the dataset when left None."""
    if cfg.dali:
        if cfg.num_classes is None:
            raise ValueError("dali = True needs num_classes: the DALI reader does not count classes")
        loader = get_dali_dataloader(cfg.rec, cfg.batch_size, rank=rank, world_size=world_size, seed=cfg.seed,
                                     device=device, num_classes=cfg.num_classes)
        num_images, num_classes = loader.num_images, cfg.num_classes
    else:
        data = build_dataset(cfg.rec, num_classes=cfg.num_classes, seed=cfg.seed, num_images=cfg.num_image)
        loader = get_dataloader(data, cfg.batch_size, rank=rank, world_size=world_size, seed=cfg.seed,
                                num_workers=cfg.num_workers, device=device)
        num_images, num_classes = len(data), data.num_classes
    if cfg.num_image is not None and num_images != cfg.num_image:
        raise ValueError(f"num_image = {cfg.num_image} in the config, but the dataset {cfg.rec!r} holds {num_images} "
                         f"images; set num_image = {num_images} or None (it sets the steps per epoch and the LR)")
    logger.info("data %s: num_classes = %d (%s), num_image = %d (%s)", cfg.rec, num_classes,
                "the config's" if cfg.num_classes is not None else "from the dataset", num_images,
                "the config's" if cfg.num_image is not None else "from the dataset")
    if cfg.num_classes is None or cfg.num_image is None:
        cfg = cfg.updated(num_classes=num_classes, num_image=num_images)
    return loader, cfg

