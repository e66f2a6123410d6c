"""dataset.build.build_data: the loader and the class and image counts from plain arguments."""
from __future__ import annotations

import logging

import pytest
import torch

from dataset import build_data
from tests.helpers import FIXTURES

CPU, LOGGER = torch.device("cpu"), logging.getLogger("test_dataset_build")


def data(rec: str = "synthetic", **given):
    args = {"num_classes": 3, "num_image": None, "seed": 1, "num_workers": 0, "dali": False, "rank": 0,
            "world_size": 1, "device": CPU, "logger": LOGGER} | given
    return build_data(rec, 4, **args)


def test_counts_left_none_come_from_the_dataset_and_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        loader, num_classes, num_image = data()
    assert (num_classes, num_image) == (3, 30)  # synthetic data: 10 images per class
    assert "data synthetic: num_classes = 3 (the config's), num_image = 30 (from the dataset)" in caplog.text
    images, labels = next(iter(loader))
    assert images.shape[0] == 4 and labels.shape == (4,)


def test_a_given_image_count_must_be_the_dataset_s():
    rec = str(FIXTURES / "rec_insightface")  # 30 images of 6 classes
    assert data(rec, num_classes=None, num_image=30)[1:] == (6, 30)
    with pytest.raises(ValueError, match=r"num_image = 20 in the config, but the dataset '.*rec_insightface' holds 30 "
                                         r"images; set num_image = 30 or None"):
        data(rec, num_classes=None, num_image=20)
