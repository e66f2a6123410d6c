"""The training loader a run asks for: DALI's or ours over the dataset ``rec`` names."""
from __future__ import annotations

import logging

import torch

from dataset.dali import DaliLoader, get_dali_dataloader
from dataset.faces import build_dataset
from dataset.loader import FaceDataLoader, get_dataloader


def build_data(rec: str, batch_size: int, *, num_classes: int | None, num_image: int | None, seed: int,
               num_workers: int, dali: bool, rank: int, world_size: int, device: torch.device,
               logger: logging.Logger) -> tuple[FaceDataLoader | DaliLoader, int, int]:
    """``(loader, num_classes, num_image)``: the loader of ``rank`` over ``rec`` (NVIDIA DALI's when ``dali``) and
    the class and image counts, ``num_classes`` / ``num_image`` when given (the image count must be the dataset's),
    else what the dataset holds; both are logged with where they came from."""
    if dali:
        if num_classes is None:
            raise ValueError("dali = True needs num_classes: the DALI reader does not count classes")
        loader = get_dali_dataloader(rec, batch_size, rank=rank, world_size=world_size, seed=seed, device=device,
                                     num_classes=num_classes)
        images, classes = loader.num_images, num_classes
    else:
        data = build_dataset(rec, num_classes=num_classes, seed=seed, num_images=num_image)
        loader = get_dataloader(data, batch_size, rank=rank, world_size=world_size, seed=seed,
                                num_workers=num_workers, device=device)
        images, classes = len(data), data.num_classes
    if num_image is not None and images != num_image:
        raise ValueError(f"num_image = {num_image} in the config, but the dataset {rec!r} holds {images} "
                         f"images; set num_image = {images} or None (it sets the steps per epoch and the LR)")
    logger.info("data %s: num_classes = %d (%s), num_image = %d (%s)", rec, classes,
                "the config's" if num_classes is not None else "from the dataset", images,
                "the config's" if num_image is not None else "from the dataset")
    return loader, classes, images
