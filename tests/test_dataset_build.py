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


def test_what_the_identity_folder_rule_ignores_is_not_data(tmp_path):
    """data_identity of an image folder: the images training reads (the one identity-folder rule); a Thumbs.db,
    a hidden folder or a notes file leave it as it is; the previous releases' identity (every file) is still
    known, for their checkpoints."""
    from dataset import data_identity, legacy_data_identity

    (tmp_path / "alice").mkdir()
    (tmp_path / "alice" / "0.jpg").write_bytes(b"x" * 10)
    clean = data_identity(str(tmp_path))
    assert legacy_data_identity(str(tmp_path)) is None  # nothing the rule ignores: both releases agree
    (tmp_path / "alice" / "Thumbs.db").write_bytes(b"t")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "0.jpg").write_bytes(b"y")
    (tmp_path / "alice" / "notes.txt").write_text("left of the camera")
    assert data_identity(str(tmp_path)) == clean
    legacy = legacy_data_identity(str(tmp_path))
    assert legacy is not None and legacy != clean
    (tmp_path / "alice" / "2020").mkdir()
    (tmp_path / "alice" / "2020" / "1.png").write_bytes(b"z")  # a sub-folder's image is alice's: data
    assert data_identity(str(tmp_path)) != clean
    assert data_identity("synthetic") == "synthetic" and legacy_data_identity("synthetic") is None
