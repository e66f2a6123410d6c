"""Training and evaluation data: formats, datasets and the training loader.

``from dataset import MXFaceDataset, build_dataset, get_dataloader, ...`` keeps working as it did when this
was one module; the code lives in modules named for what they are:

- ``dataset.images``: decoding, resizing, and the one normalisation ``(x - 127.5) / 127.5``;
- ``dataset.recordio``: MXNet RecordIO without MXNet, the dataset layouts, and the one RecordIO checker;
- ``dataset.faces``: ``MXFaceDataset``, ``ImageFolderDataset``, ``SyntheticDataset``, ``build_dataset``;
- ``dataset.identity_folders``: the one rule of a folder of identity folders, which every reader of one uses;
- ``dataset.rec_from_images`` and ``dataset.inspection``: what ``make_rec.py`` writes and ``rec_info.py`` reports;
- ``dataset.loader``: the distributed, resumable sampler and loader (``get_dataloader``);
- ``dataset.build``: the training loader a config asks for (``build_data``) and what the data holds
  (``data_identity``);
- ``dataset.dali``: the optional GPU-decode loader (NVIDIA DALI, imported only when asked for);
- ``dataset.verification_set``: the verification ``.bin`` reader (restricted unpickler) and writer;
- ``dataset.synthetic_faces``: synthetic identities written in the real formats, for demos and tests.

This package imports only ``utils`` from the project (and torch, torchvision, numpy, PIL).
"""
from __future__ import annotations

from dataset.build import build_data, data_identity, legacy_data_identity
from dataset.dali import DaliLoader, get_dali_dataloader
from dataset.faces import ImageFolderDataset, MXFaceDataset, SyntheticDataset, build_dataset
from dataset.images import IMAGE_EXTENSIONS, Transform, decode, normalise
from dataset.loader import FaceDataLoader, FaceSampler, get_dataloader
from dataset.recordio import class_of, detect_layout

__all__ = ["IMAGE_EXTENSIONS", "DaliLoader", "FaceDataLoader", "FaceSampler", "ImageFolderDataset", "MXFaceDataset",
           "SyntheticDataset", "Transform", "build_data", "build_dataset", "class_of", "data_identity", "decode",
           "detect_layout", "get_dali_dataloader", "get_dataloader", "legacy_data_identity", "normalise"]
