"""Which model a tool runs, as a backbone: trained weights, an exported ONNX model, or a seeded untrained network.

``build_backbone`` takes plain arguments (``eval.model_options`` turns a tool's command line into them).
``--weights`` may be a run folder (its ``model.pt``, ``weights_file``) and ``--onnx`` a folder holding one
``.onnx`` file (``onnx_file``). Without a network name the architecture is the ``model.json`` beside the weights
(``eval.model_card``); the weights file itself stays a plain state_dict in the official layout. Weights that do
not fit the architecture are one ``ValueError`` line that says what to pass instead. An ONNX model runs with
onnxruntime behind the ``nn.Module`` interface (``OnnxBackbone``). docs/evaluation.md describes the options.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eval.model_card import Architecture, card_beside, read_model_card
from utils.files import load_state_dict, load_weights
from utils.precision import AUTOCAST_DTYPES, AutocastModule

DEFAULT_EMBEDDING_SIZE = 512
WEIGHTS_FILE = "model.pt"  # what --weights FOLDER means: the trainer's (and arcface_torch's) weights in that folder
LISTED = 5  # how many of a folder's files an error message names
# What the model options of a tool are called in messages about the architecture.
ARCHITECTURE_FLAGS = "--network, --network-kwargs and --embedding-size"


def _holding(folder: Path, suffixes: tuple[str, ...]) -> tuple[list[Path], str]:
    """The files in ``folder`` whose name ends with one of ``suffixes`` (sorted), and what the folder holds, in
    words for an error message: "it holds" those files, else what it holds instead, or "it is empty"."""
    entries = sorted(folder.iterdir())
    matches = [path for path in entries if path.is_file() and path.name.endswith(suffixes)]
    shown = matches or entries
    if not shown:
        return matches, "it is empty"
    names = ", ".join(path.name + "/" * path.is_dir() for path in shown[:LISTED])
    if len(shown) > LISTED:
        names += f" and {len(shown) - LISTED} more"
    return matches, f"it holds {names}" if matches else f"it holds no {' or '.join(suffixes)} file, only {names}"


def weights_file(weights: str | os.PathLike) -> Path:
    """The weights file ``--weights`` names: ``weights`` itself, or ``<folder>/model.pt`` for a folder (a run's
    output, as arcface_torch's tools take it); ``ValueError`` naming the folder and what it holds when it has no
    ``model.pt``, ``FileNotFoundError`` saying first that a path does not exist (and what is nearest to it)."""
    weights = Path(weights)
    if not weights.exists():
        raise FileNotFoundError(f"--weights {weights}: no such file or folder{_nearest(weights)}")
    if not weights.is_dir():
        return weights
    if (weights / WEIGHTS_FILE).is_file():
        return weights / WEIGHTS_FILE
    _, holds = _holding(weights, (".pt", ".pth"))
    raise ValueError(f"{weights}: a folder without {WEIGHTS_FILE} (what the trainer writes); {holds}: pass the "
                     f"weights file itself")


def _nearest(path: Path) -> str:
    """"; did you mean X?" for the entry of ``path``'s folder whose name is nearest to it, or where the folder
    itself is missing, that; "" when nothing is near."""
    folder = path.parent
    if not folder.is_dir():
        return f" ({folder} does not exist either)" if str(folder) not in ("", ".") else ""
    names = difflib.get_close_matches(path.name, [entry.name for entry in folder.iterdir()], n=1, cutoff=0.6)
    return f"; did you mean {folder / names[0]}?" if names else ""


def is_onnx(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an exported ONNX model (an ``.onnx`` file) rather than torch weights."""
    return Path(path).suffix.lower() == ".onnx" and Path(path).is_file()


def onnx_file(onnx: str | os.PathLike) -> Path:
    """The model ``--onnx`` names: ``onnx`` itself, or the one ``.onnx`` file in a folder; ``ValueError`` naming
    the folder and what it holds when it has none or several."""
    onnx = Path(onnx)
    if not onnx.is_dir():
        return onnx
    found, holds = _holding(onnx, (".onnx",))
    if len(found) == 1:
        return found[0]
    raise ValueError(f"{onnx}: a folder, and {holds}; --onnx takes an .onnx file or a folder holding exactly one")


def architecture(weights: str | os.PathLike | None, network: str | None = None,
                 network_kwargs: dict[str, Any] | None = None, embedding_size: int | None = None) -> Architecture:
    """The architecture ``network`` names (with its kwargs and embedding size, default
    ``DEFAULT_EMBEDDING_SIZE``), else the ``model.json`` beside the weights file (``weights_file``;
    ``ValueError`` saying what to pass when there is none)."""
    if network:
        return Architecture(network, dict(network_kwargs or {}), embedding_size or DEFAULT_EMBEDDING_SIZE)
    card = card_beside(weights_file(weights))
    if not card.is_file():
        raise ValueError(f"--network is required: {card} does not exist (the trainer writes it beside model.pt); "
                         f"pass {ARCHITECTURE_FLAGS} as in the training config, e.g. --network r50")
    return read_model_card(card)


def _mismatch_hint(arch: Architecture, weights: Path) -> str | None:
    """What to pass instead when ``weights`` is a state_dict that does not fit ``arch``; None when the file is
    not a state_dict at all (then the loader's own message says everything)."""
    try:
        state = load_state_dict(weights)
    except ValueError:
        return None
    features = state.get("features.weight")  # IResNet, MobileFaceNet: the BatchNorm1d of the embedding
    size = ""
    if features is not None and features.dim() == 1:
        size = f" (the file's embeddings are {len(features)}-dimensional)"
    card = card_beside(weights)
    if arch.card is None and card.is_file():
        try:
            described = read_model_card(card)
        except ValueError:
            described = None  # an unreadable card suggests nothing
        if described is not None and described.flags() != arch.flags():
            return (f"{card} says {described.flags()}: leave out {ARCHITECTURE_FLAGS} to use it, or pass the "
                    f"ones the weights were trained with{size}")
    if arch.card is not None:
        return (f"{arch.card} says {arch.flags()}, which does not describe these weights: pass {ARCHITECTURE_FLAGS} "
                f"as in the training config{size}")
    return f"pass {ARCHITECTURE_FLAGS} as in the training config{size}"


def load_backbone(arch: Architecture, weights: str | os.PathLike) -> nn.Module:
    """``arch`` built and loaded strictly from ``weights``; a mismatch is one ``ValueError`` line that ends
    with what to pass instead."""
    weights = Path(weights)
    model = arch.build()
    try:
        load_weights(model, weights, network=arch.network)
    except ValueError as exc:
        hint = _mismatch_hint(arch, weights)
        if hint is None:
            raise
        raise ValueError(f"{exc}; {hint}") from None
    return model


class OnnxBackbone(nn.Module):
    """An exported model run by ONNX Runtime behind the ``nn.Module`` interface the protocols expect:
    (N, 3, H, W) float32 in, (N, D) float32 out, on the CPU (ORT copies to its own device)."""

    def __init__(self, path: str | os.PathLike, device: str = "cpu") -> None:
        super().__init__()
        import onnxruntime as ort  # only this source needs it

        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(path), providers=providers)
        except Exception as exc:  # ORT raises its own exception types for files that are not ONNX models
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ValueError(f"{path}: not a loadable ONNX model ({type(exc).__name__}: {first})") from exc
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise ValueError(f"{path}: expected a model with one input (images), found "
                             f"{[i.name for i in inputs]}")
        self.input_name = inputs[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.session.run(None, {self.input_name: x.detach().cpu().float().numpy()})[0]  # (N, D)
        return torch.from_numpy(out)


def model_file(weights: str | os.PathLike | None, onnx: str | os.PathLike | None) -> Path:
    """The file of the model ``--weights`` or ``--onnx`` names (``weights_file``, ``onnx_file``): beside it is
    its ``model.json``."""
    return onnx_file(onnx) if onnx is not None else weights_file(weights)


def build_backbone(*, weights: str | os.PathLike | None = None, onnx: str | os.PathLike | None = None,
                   random_init: int | None = None, network: str | None = None,
                   network_kwargs: dict[str, Any] | None = None, embedding_size: int | None = None,
                   device: str = "cpu", precision: str = "fp32") -> nn.Module:
    """The model on ``device``: an ONNX model (``onnx``), trained ``weights``, or ``network`` untrained, seeded
    ``random_init``; a torch model runs under ``precision``'s autocast when that is not fp32. A folder as
    ``weights`` or ``onnx`` means the model in it (``weights_file``, ``onnx_file``); without ``network`` the
    architecture is the ``model.json`` beside the weights. ``FileNotFoundError``/``ValueError`` (one line) when
    it cannot be built."""
    if onnx is not None:
        onnx = onnx_file(onnx)
        if not onnx.is_file():
            raise FileNotFoundError(f"ONNX model not found: {onnx}")
        return OnnxBackbone(onnx, device)
    arch = architecture(weights, network, network_kwargs, embedding_size)
    if random_init is not None:
        torch.manual_seed(random_init)  # the same SEED gives the same untrained network
        model = arch.build()
    else:
        model = load_backbone(arch, weights_file(weights))
    dtype = AUTOCAST_DTYPES[precision]
    model = model.to(device)
    return model if dtype is None else AutocastModule(model, dtype)


def device_of(module: nn.Module) -> torch.device:
    """The device of the module's first parameter or buffer; the CPU for a module that has none
    (e.g. ``OnnxBackbone``): where its inputs go."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")
