"""Which model a tool runs: the model options, defined once, and how they become a backbone.

``python -m eval.verify``, ``python -m eval.ijb``, ``scripts/torch2onnx.py`` and ``scripts/inference.py``
take the same options (``add_model_options``), each tool the sources it can run (``scripts/torch2onnx.py`` exports
on the CPU and has no ``--device``):

    --weights PATH          a backbone state_dict (``model.pt`` of a run, or an official ``backbone.pth``), or a
                            run folder: its ``model.pt``
    --onnx PATH             an exported model, run with onnxruntime, or a folder holding exactly one ``.onnx`` file
    --random-init SEED      the network untrained, seeded SEED (a baseline)
    --network NAME          backbone name (``backbones.list_models()``)
    --network-kwargs JSON   extra keyword arguments of ``backbones.get_model``, e.g. '{"widths": [8, 16, 16, 32]}'
    --embedding-size N      embedding size (default 512)
    --device cpu|cuda       where the model runs
    --precision fp32|bf16|fp16  autocast of the backbone's body (eval.verify, eval.ijb; torch models only)

``scripts/torch2onnx.py`` also takes the weights as its first argument, as arcface_torch's does (``--weights``
or the argument, not both). Without ``--network``, the architecture comes from ``model.json`` beside the
weights file, which the trainer writes beside ``model.pt`` (network, network_kwargs, embedding_size, input
size, normalisation); the weights file itself stays a plain state_dict in the official layout. Weights that
do not fit the architecture are one ``ValueError`` line that says what to pass instead.
"""
from __future__ import annotations

import argparse
import difflib
import json
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
WEIGHTS_HELP = f"backbone state_dict (official insightface layout), or a run folder: its {WEIGHTS_FILE}"
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


def json_object(text: str) -> dict[str, Any]:
    """argparse type of ``--network-kwargs``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"widths\": [8, 16, 16, 32]}}'; "
                                         f"got {text!r} ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"widths\": [8, 16, 16, 32]}}'; "
                                         f"got {text!r}")
    return value


def add_model_options(parser: argparse.ArgumentParser, *, onnx: bool = True, random_init: bool = True,
                      device: bool = True, precision: bool = False, weights_argument: bool = False) -> None:
    """Add the model options to ``parser``; ``onnx``/``random_init``: whether the tool accepts those
    sources besides ``--weights``; ``device``: whether it takes ``--device``; ``precision``: whether it takes
    ``--precision`` (the autocast dtype of a torch model's forward); ``weights_argument``: whether the weights
    may also be given as an optional positional argument instead of ``--weights`` (torch2onnx, as
    arcface_torch's takes them; only with ``--weights`` as the one source). Check them with
    ``check_model_options`` after parsing, which also moves that argument into ``args.weights``."""
    assert not (weights_argument and (onnx or random_init)), \
        f"a positional weights argument is for tools without other sources (onnx={onnx}, random_init={random_init})"
    g = parser.add_argument_group("model", "the backbone to run (without --network: read from model.json beside "
                                           "the weights, which the trainer writes)")
    if onnx or random_init:
        source = g.add_mutually_exclusive_group(required=True)
        source.add_argument("--weights", type=Path, help=WEIGHTS_HELP)
        if onnx:
            source.add_argument("--onnx", type=Path, help="exported ONNX model, run with onnxruntime (or a folder "
                                                          "holding exactly one .onnx file)")
        if random_init:
            source.add_argument("--random-init", type=int, metavar="SEED",
                                help="the network untrained, seeded SEED (needs --network)")
    else:
        g.add_argument("--weights", type=Path, required=not weights_argument, help=WEIGHTS_HELP)
        if weights_argument:
            g.add_argument("weights_argument", nargs="?", type=Path, metavar="WEIGHTS",
                           help="the same as --weights, as arcface_torch's tools take it (give one of the two)")
    g.add_argument("--network", help="backbone name (backbones.list_models()); default: model.json's")
    g.add_argument("--network-kwargs", type=json_object, metavar="JSON",
                   help="extra backbones.get_model arguments as a JSON object, e.g. '{\"widths\": [8, 16, 16, 32]}'")
    g.add_argument("--embedding-size", type=int, metavar="N",
                   help=f"embedding size (default {DEFAULT_EMBEDDING_SIZE} with --network; model.json's without)")
    if device:
        g.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    if precision:
        g.add_argument("--precision", choices=tuple(AUTOCAST_DTYPES), default="fp32",
                       help="run the backbone's body under bf16/fp16 autocast, as a config with bf16/fp16 = True "
                            "trains it (the embedding layers stay fp32); default fp32")


def check_model_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse combinations of the model options that cannot work (exits through ``parser.error``); with
    ``add_model_options(weights_argument=True)``, set ``args.weights`` from whichever of the argument and
    ``--weights`` was given."""
    if hasattr(args, "weights_argument"):
        if args.weights_argument is not None and args.weights is not None:
            parser.error(f"the weights are given twice, as {args.weights_argument} and as --weights {args.weights}; "
                         f"give one")
        if args.weights_argument is None and args.weights is None:
            parser.error(f"the weights are required: a .pt/.pth file or a run folder holding {WEIGHTS_FILE}, as the "
                         f"first argument or as --weights")
        args.weights = args.weights if args.weights is not None else args.weights_argument
    describes = args.network_kwargs is not None or args.embedding_size is not None
    if getattr(args, "onnx", None) is None and args.weights is not None and is_onnx(args.weights):
        if hasattr(args, "weights_argument"):  # torch2onnx: the one tool that needs torch weights
            parser.error(f"{args.weights} is an exported ONNX model already; pass the torch weights (model.pt)")
        args.onnx, args.weights = args.weights, None  # an exported model given as --weights: run it as --onnx
    if getattr(args, "onnx", None) is not None and (args.network or describes):
        parser.error(f"--onnx runs the exported model as it is; {ARCHITECTURE_FLAGS} do not apply")
    if getattr(args, "onnx", None) is not None and getattr(args, "precision", "fp32") != "fp32":
        parser.error(f"--onnx runs the exported model as it is; --precision {args.precision} applies to torch models")
    if getattr(args, "random_init", None) is not None and not args.network:
        parser.error("--random-init needs --network (there are no weights, so no model.json beside them)")
    if describes and not args.network:
        parser.error("--network-kwargs and --embedding-size describe the network --network names; pass --network "
                     "too (without all three, model.json beside --weights describes the network)")
    if args.embedding_size is not None and args.embedding_size < 1:
        parser.error(f"--embedding-size must be >= 1, got {args.embedding_size}")
    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")


def architecture(args: argparse.Namespace) -> Architecture:
    """The architecture the options name: the flags with ``--network``, else ``model.json`` beside the
    weights file (``weights_file``; ``ValueError`` saying what to pass when there is none)."""
    if args.network:
        return Architecture(args.network, dict(args.network_kwargs or {}),
                            args.embedding_size or DEFAULT_EMBEDDING_SIZE)
    card = card_beside(weights_file(args.weights))
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


def build_backbone(args: argparse.Namespace) -> nn.Module:
    """The model the options name, on ``--device``: an ONNX model, trained weights, or a seeded untrained
    network, run under ``--precision``'s autocast when that is not fp32; a folder given as ``--weights`` or
    ``--onnx`` means the model in it (``weights_file``, ``onnx_file``). ``FileNotFoundError``/``ValueError``
    (one line) when it cannot be built."""
    device = getattr(args, "device", "cpu")
    onnx = getattr(args, "onnx", None)
    if onnx is not None:
        onnx = onnx_file(onnx)
        if not onnx.is_file():
            raise FileNotFoundError(f"ONNX model not found: {onnx}")
        return OnnxBackbone(onnx, device)
    arch = architecture(args)
    seed = getattr(args, "random_init", None)
    if seed is not None:
        torch.manual_seed(seed)  # the same SEED gives the same untrained network
        model = arch.build()
    else:
        model = load_backbone(arch, weights_file(args.weights))
    dtype = AUTOCAST_DTYPES[getattr(args, "precision", "fp32")]
    model = model.to(device)
    return model if dtype is None else AutocastModule(model, dtype)


def device_of(module: nn.Module) -> torch.device:
    """The device of the module's first parameter or buffer; the CPU for a module that has none
    (e.g. ``OnnxBackbone``): where its inputs go."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")
