"""The model options of the command-line tools, defined once: how a tool's command line names a backbone.

``scripts/verify.py``, ``scripts/ijb.py``, ``scripts/torch2onnx.py``, ``scripts/inference.py``,
``scripts/compare.py`` and ``scripts/overlap.py`` take the same options (``add_model_options``), each tool the
sources it can run: ``--weights PATH`` (a state_dict or a run folder), ``--onnx PATH``, ``--random-init SEED``;
``--network NAME``, ``--network-kwargs JSON``, ``--embedding-size N`` (without them: ``model.json`` beside the
weights); ``--device cpu|cuda``; ``--precision fp32|bf16|fp16`` (torch models only). ``check_model_options``
refuses combinations that cannot work, and ``backbone_from_options`` builds the model they name
(``eval.model_source``, the library). docs/evaluation.md#the-model-options describes them for users.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eval.model_source import ARCHITECTURE_FLAGS, DEFAULT_EMBEDDING_SIZE, WEIGHTS_FILE, build_backbone, is_onnx
from utils.precision import AUTOCAST_DTYPES

WEIGHTS_HELP = f"backbone state_dict (official insightface layout), or a run folder: its {WEIGHTS_FILE}"


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


def backbone_from_options(args: argparse.Namespace) -> nn.Module:
    """The model the checked options name (``eval.model_source.build_backbone``)."""
    return build_backbone(weights=args.weights, onnx=getattr(args, "onnx", None),
                          random_init=getattr(args, "random_init", None), network=args.network,
                          network_kwargs=args.network_kwargs, embedding_size=args.embedding_size,
                          device=getattr(args, "device", "cpu"), precision=getattr(args, "precision", "fp32"))


def model_flag(args: argparse.Namespace) -> str:
    """The option that names the model of this command line (``--onnx X`` or ``--weights X``), for a command a
    message suggests."""
    return f"--onnx {args.onnx}" if getattr(args, "onnx", None) is not None else f"--weights {args.weights}"
