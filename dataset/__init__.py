"""Training and evaluation data: formats, datasets and the training loader (``from dataset import ...``).

- ``images``: decoding and the one normalisation ``(x - 127.5) / 127.5``; ``recordio``: MXNet RecordIO without
  MXNet, its layouts and the one checker; ``identity_folders``: the one rule of a folder of identity folders;
- ``faces``: the datasets (``build_dataset``); ``loader``: the distributed, resumable loader (``get_dataloader``);
  ``dali``: the optional GPU-decode loader; ``build``: the loader a run asks for and what the data holds;
- ``verification_set``: the `.bin` reader (restricted unpickler) and writer; ``synthetic_faces``: generated
  identities in the real formats; ``rec_from_images``, ``rec_copy``, ``inspection``: what the rec tools do.

This package imports only ``utils`` from the project. The formats and the loader: docs/data.md.
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
