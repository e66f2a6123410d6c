"""insightface's ONNX recognition models (``w600k_r50.onnx``, ``glintr100.onnx``, ``w600k_mbf.onnx``) read back
into our backbones: ``read_onnx`` gives the network's name and a state dict that loads strictly.

Graphs are recognised by their structure, never by initializer names (the exporter renames folded weights
``onnx::Conv_123``): IResNet and MobileFaceNet as arcface_torch's ``torch2onnx.py`` writes them (TorchScript
exporter, eval mode, constants folded). A batch norm the exporter folded into the convolution before it comes back
as that convolution and a batch norm at identity statistics carrying the bias, so the forward is the graph's; the
batch norms before a convolution, the PReLU slopes and the embedding layers are the graph's own. An input
``Sub``/``Mul`` inside the graph (older converted models) is folded into the first convolution, so the weights take
the normalisation the caller feeds. Any other file is one ``UsageError`` line. ``onnx`` and ``onnxruntime`` are
imported only when a file is read or checked. docs/finetuning.md describes the command and what is carried over.
"""
from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from utils.cli import UsageError
from utils.files import path_problem

from .iresnet import IResNet
from .mobilefacenet import MobileFaceNet
from .registry import get_model

__all__ = ["FOLDED_KEY", "SUPPORTED", "Imported", "Recognised", "fill", "max_relative_difference", "read_onnx",
           "recognise", "registered_network"]

# What model.json says of an imported model besides the architecture (eval.model_card's extra facts).
SOURCE_KEY, SHA256_KEY = "source", "source_sha256"
FOLDED_KEY = "batch_norms_folded"  # how many batch norms the exporter folded into convolutions (0: none)
GRAPH_NORMALISATION_KEY = "graph_normalisation"  # the graph's own input Sub/Mul, e.g. "(x - 127.5) * 0.0078125"

# The registered networks a recognised structure is: IResNet block counts per stage at the official widths (tiny:
# one block a stage, any widths), MobileFaceNet (block counts, width scale).
IRESNET_DEPTHS = {(2, 2, 2, 2): "r18", (3, 4, 6, 3): "r34", (3, 4, 14, 3): "r50", (3, 13, 30, 3): "r100",
                  (6, 26, 60, 6): "r200"}
OFFICIAL_WIDTHS = (64, 128, 256, 512)
TINY_LAYERS = (1, 1, 1, 1)
MOBILEFACENETS = {((1, 4, 6, 2), 2): "mbf", ((2, 8, 12, 4), 4): "mbf_large"}
SUPPORTED = (f"IResNet {', '.join(IRESNET_DEPTHS.values())} (and tiny) and MobileFaceNet "
             f"{', '.join(MOBILEFACENETS.values())}, as arcface_torch's torch2onnx.py exports them")
INPUT_SIDE = 112  # the faces every tool here feeds
_TOTAL_STRIDE = 16  # both families halve the side four times
_PASS_THROUGH = {"Identity", "Dropout"}  # nodes that leave the tensor as it is in eval mode (and Cast to float)
_FLOAT = 1  # onnx.TensorProto.FLOAT
_NOT_DATA = {"Shape"}  # consumers of a data tensor that read only its shape (a Reshape's target, computed)


class _Unrecognised(Exception):
    """Where the graph stops looking like the family being read; becomes one line in ``recognise``."""


@dataclass(frozen=True)
class _Layer:
    """One parameterised layer in forward order: "conv" (weight, bias None; stride, padding, groups), "bn"
    (weight, bias, running mean, running var, eps: a folded one is 1, b, 0, 1, 0), "prelu" (slope), "linear"
    (weight (out, in), bias or None)."""

    kind: str
    tensors: tuple[np.ndarray | None, ...]
    conv: tuple[int, int, int] = (0, 0, 0)  # (stride, padding, groups)


@dataclass(frozen=True)
class Recognised:
    """A graph read as one of the families: its constructor's arguments (IResNet: ``layers``, ``widths``;
    MobileFaceNet: ``blocks``, ``scale``), its parameterised layers in the module's order, how many batch norms
    were folded, and the graph's own input normalisation as text (None: none, the caller normalises)."""

    family: type[nn.Module]
    structure: dict[str, Any]
    embedding_size: int
    layers: list[_Layer]
    folded: int
    graph_normalisation: str | None
    # The graph computes (A * x + B) per channel on its input before the first convolution: (A, B), or None.
    graph_affine: tuple[np.ndarray, np.ndarray] | None = None

    def build(self) -> nn.Module:
        """The family's module of this structure (any widths; ``registered_network`` names the registered ones)."""
        return self.family(**self.structure, num_features=self.embedding_size, input_size=INPUT_SIDE)


@dataclass(frozen=True)
class Imported:
    """What ``read_onnx`` gives: a registered network, its state dict (strict), and the facts model.json records
    of the source (``SOURCE_KEY``, ``SHA256_KEY``, ``FOLDED_KEY``, ``GRAPH_NORMALISATION_KEY``)."""

    network: str
    network_kwargs: dict[str, Any]
    embedding_size: int
    state_dict: dict[str, torch.Tensor]
    facts: dict[str, Any] = field(default_factory=dict)
    # What the ONNX file is fed for the images the weights take normalised: (mean, std) or None (the same input).
    onnx_input: tuple[float, float] | None = None


# ------------------------------------------------------------------------------------------------ the graph
@dataclass
class _Node:
    op: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]


class _Graph:
    """The ONNX graph with constants resolved (initializers, ``Constant`` nodes, and what pass-through nodes make
    of them) and pass-through nodes removed: each data tensor's consumers, each constant's array."""

    def __init__(self, model: Any) -> None:
        from onnx import helper, numpy_helper

        graph = model.graph
        self.consts: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        alias: dict[str, str] = {}
        self.nodes: list[_Node] = []
        for proto in graph.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in proto.attribute}
            node = _Node(proto.op_type, proto.name or proto.op_type, [alias.get(t, t) for t in proto.input],
                         list(proto.output), attrs)
            if node.op == "Constant" and "value" in attrs:
                self.consts[node.outputs[0]] = numpy_helper.to_array(attrs["value"])
            elif node.op in _PASS_THROUGH or (node.op == "Cast" and attrs.get("to") == _FLOAT):
                alias[node.outputs[0]] = node.inputs[0]
                if node.inputs[0] in self.consts:
                    self.consts[node.outputs[0]] = self.consts[node.inputs[0]]
            else:
                self.nodes.append(node)
        self.consumers: dict[str, list[_Node]] = defaultdict(list)
        for node in self.nodes:
            for t in node.inputs:
                if t and t not in self.consts and node.op not in _NOT_DATA:
                    self.consumers[t].append(node)
        initializers = {t.name for t in graph.initializer}
        self.inputs = [i.name for i in graph.input if i.name not in initializers]
        self.outputs = [alias.get(o.name, o.name) for o in graph.output]

    def after(self, tensor: str) -> list[_Node]:
        """The nodes computing on ``tensor`` (not its shape)."""
        return self.consumers.get(tensor, [])

    def only(self, tensor: str, *ops: str) -> _Node:
        """The one node computing on ``tensor``, of one of ``ops``; ``_Unrecognised`` otherwise."""
        nodes = self.after(tensor)
        if len(nodes) != 1 or nodes[0].op not in ops:
            raise _Unrecognised(f"{tensor!r} goes to {_ops(nodes)}, expected one {' or '.join(ops)}")
        return nodes[0]

    def const(self, node: _Node, index: int, ndim: int | None = None) -> np.ndarray | None:
        """Input ``index`` of ``node`` as an array (None when absent); ``_Unrecognised`` when it is computed."""
        if index >= len(node.inputs) or not node.inputs[index]:
            return None
        name = node.inputs[index]
        if name not in self.consts:
            raise _Unrecognised(f"{node.op} node {node.name!r}: input {name!r} is computed, expected a constant")
        value = self.consts[name]
        if ndim is not None and value.ndim != ndim:
            raise _Unrecognised(f"{node.op} node {node.name!r}: {name!r} has shape {value.shape}, expected "
                                f"{ndim} dimensions")
        return value


def _ops(nodes: list[_Node]) -> str:
    return ", ".join(f"{n.op} {n.name!r}" for n in nodes) or "nothing"


# ------------------------------------------------------------------------------------------------ units
def _batch_norm(g: _Graph, node: _Node, bias_before: np.ndarray | None = None) -> _Layer:
    """An explicit BatchNormalization; a constant added before it (a convolution's bias) joins its mean."""
    gamma, beta, mean, var = (g.const(node, i, ndim=1).astype(np.float64) for i in range(1, 5))
    if bias_before is not None:
        mean = mean - bias_before  # BN(x + b) normalises x with mean - b
    return _Layer("bn", (gamma, beta, mean, var, np.array(node.attrs.get("epsilon", 1e-5))))


def _identity_bn(bias: np.ndarray) -> _Layer:
    """A folded batch norm: identity statistics (mean 0, var + eps = 1) carrying ``bias``."""
    n = bias.shape[0]
    return _Layer("bn", (np.ones(n), bias, np.zeros(n), np.ones(n), np.array(0.0)))


def _conv_unit(g: _Graph, conv: _Node, act: bool, kernel: int | None = None, stride: int | None = None
               ) -> tuple[list[_Layer], str, bool]:
    """``conv`` (with its batch norm, explicit or folded into it) and, with ``act``, the PReLU after it:
    ``(layers, output tensor, whether the batch norm was folded)``."""
    if conv.op != "Conv":
        raise _Unrecognised(f"{conv.op} node {conv.name!r} where a convolution was expected")
    weight, bias = g.const(conv, 1, ndim=4), g.const(conv, 2)
    k = conv.attrs.get("kernel_shape", list(weight.shape[2:]))
    strides, pads = conv.attrs.get("strides", [1, 1]), conv.attrs.get("pads", [0, 0, 0, 0])
    if (len(set(k)) != 1 or len(set(strides)) != 1 or len(set(pads)) != 1 or set(conv.attrs.get("dilations", [1]))
            != {1} or conv.attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")):
        raise _Unrecognised(f"Conv {conv.name!r}: kernel {k}, strides {strides}, pads {pads}: not square and "
                            f"symmetric")
    if (kernel is not None and k[0] != kernel) or (stride is not None and strides[0] != stride):
        raise _Unrecognised(f"Conv {conv.name!r}: kernel {k[0]}, stride {strides[0]}; expected kernel {kernel}, "
                            f"stride {stride}")
    layers = [_Layer("conv", (weight, None), (strides[0], pads[0], conv.attrs.get("group", 1)))]
    out, after = conv.outputs[0], g.after(conv.outputs[0])
    folded = not (len(after) == 1 and after[0].op == "BatchNormalization")
    if folded:
        layers.append(_identity_bn(bias if bias is not None else np.zeros(weight.shape[0])))
    else:
        layers.append(_batch_norm(g, after[0], bias))
        out = after[0].outputs[0]
    if act:
        prelu = g.only(out, "PRelu")
        slope = g.const(prelu, 1).reshape(-1)
        layers.append(_Layer("prelu", (np.broadcast_to(slope, (weight.shape[0],)).copy(),)))
        out = prelu.outputs[0]
    return layers, out, folded


def _flatten(g: _Graph, tensor: str) -> str:
    node = g.only(tensor, "Flatten", "Reshape")
    if node.op == "Flatten" and node.attrs.get("axis", 1) != 1:
        raise _Unrecognised(f"Flatten {node.name!r} at axis {node.attrs['axis']}, expected 1")
    return node.outputs[0]


def _embedding(g: _Graph, tensor: str) -> tuple[list[_Layer], str, bool]:
    """The linear layer (Gemm, or MatMul and Add) and its BatchNorm1d, explicit or folded into it:
    ``([linear, bn], output, whether folded)``."""
    node = g.only(tensor, "Gemm", "MatMul")
    if node.op == "Gemm":
        if node.attrs.get("transA", 0):
            raise _Unrecognised(f"Gemm {node.name!r} transposes its input")
        b = g.const(node, 1, ndim=2)
        b = b * node.attrs["alpha"] if node.attrs.get("alpha", 1.0) != 1.0 else b
        weight = b if node.attrs.get("transB", 0) else b.T
        c = g.const(node, 2)
        bias = None if c is None else np.broadcast_to(c * node.attrs.get("beta", 1.0), weight.shape[:1]).copy()
        out = node.outputs[0]
    else:
        weight, bias, out = g.const(node, 1, ndim=2).T, None, node.outputs[0]
        after = g.after(out)
        if len(after) == 1 and after[0].op == "Add":
            bias, out = g.const(after[0], 1 if after[0].inputs[0] == out else 0).reshape(-1), after[0].outputs[0]
    after = g.after(out)
    if len(after) == 1 and after[0].op == "BatchNormalization":
        return [_Layer("linear", (weight, None)), _batch_norm(g, after[0], bias)], after[0].outputs[0], False
    return [_Layer("linear", (weight, None)), _identity_bn(bias if bias is not None else np.zeros(len(weight)))], \
        out, True


# ------------------------------------------------------------------------------------------------ families
def _iresnet(g: _Graph, x: str) -> tuple[dict[str, Any], list[_Layer], int, str]:
    """IResNet (backbones/iresnet.py): conv1 (bn1 folded) → PReLU; IR blocks; bn2 → flatten → fc → features."""
    layers, t, folded = _conv_unit(g, g.only(x, "Conv"), act=True, kernel=3, stride=1)
    count = int(folded)
    blocks: list[tuple[int, int]] = []  # (stride, width) of each IR block
    while True:
        nodes = g.after(t)
        bns = [n for n in nodes if n.op == "BatchNormalization"]
        if len(bns) != 1:
            raise _Unrecognised(f"{t!r} goes to {_ops(nodes)}, expected a block's or the head's BatchNormalization")
        bn = bns[0]
        if len(nodes) == 1 and [n.op for n in g.after(bn.outputs[0])] in (["Flatten"], ["Reshape"]):
            break  # the head's bn2, the last block's output its only input
        shortcut = [n for n in nodes if n is not bn]
        block = [_batch_norm(g, bn)]
        unit, mid, f1 = _conv_unit(g, g.only(bn.outputs[0], "Conv"), act=True, kernel=3, stride=1)
        block += unit
        conv2 = g.only(mid, "Conv")
        unit, out, f2 = _conv_unit(g, conv2, act=False, kernel=3)
        block += unit
        stride, width = conv2.attrs.get("strides", [1])[0], unit[0].tensors[0].shape[0]
        other, f3, projection = t, False, [n for n in shortcut if n.op == "Conv"]
        if projection:  # 1x1 at the block's stride, with its batch norm
            unit, other, f3 = _conv_unit(g, projection[0], act=False, kernel=1, stride=stride)
            block += unit
        add = g.only(out, "Add")
        if sorted(add.inputs) != sorted([out, other]):
            raise _Unrecognised(f"Add {add.name!r} sums {add.inputs}, expected the block's output and its shortcut")
        layers += block
        count += f1 + f2 + f3
        blocks.append((stride, width))
        t = add.outputs[0]
    stages: list[list[int]] = []
    for stride, width in blocks:
        if stride == 2 or not stages:
            stages.append([])
        stages[-1].append(width)
    if len(stages) != 4 or blocks[0][0] != 2 or any(len(set(widths)) != 1 for widths in stages):
        raise _Unrecognised(f"IR blocks of (stride, width) {blocks}: expected four stages, each opened by a stride-2 "
                            f"block at one width")
    layers.append(_batch_norm(g, bn))
    head, out, f = _embedding(g, _flatten(g, bn.outputs[0]))
    structure = {"layers": tuple(len(s) for s in stages), "widths": tuple(s[0] for s in stages)}
    return structure, layers + head, count + f, out


def _bottleneck(g: _Graph, conv: _Node, stride: int) -> tuple[list[_Layer], str, int]:
    """MobileFaceNet's inverted residual from its first convolution ``conv``: expand 1x1 → PReLU → depthwise 3x3
    (``stride``) → PReLU → project 1x1: ``(layers, output, batch norms folded)``."""
    layers, count = [], 0
    for i, (kernel, conv_stride, act) in enumerate(((1, 1, True), (3, stride, True), (1, 1, False))):
        unit, out, folded = _conv_unit(g, conv, act, kernel=kernel, stride=conv_stride)
        layers, count = layers + unit, count + folded
        if i < 2:
            conv = g.only(out, "Conv")
    return layers, out, count


def _residuals(g: _Graph, t: str) -> tuple[list[_Layer], str, int, int]:
    """The residual bottlenecks from ``t`` on (each input goes to a Conv and to the Add after the bottleneck):
    ``(layers, output, how many, batch norms folded)``."""
    layers, n, count = [], 0, 0
    while sorted(node.op for node in g.after(t)) == ["Add", "Conv"]:
        block, out, folded = _bottleneck(g, next(node for node in g.after(t) if node.op == "Conv"), 1)
        add = g.only(out, "Add")
        if sorted(add.inputs) != sorted([t, out]):
            raise _Unrecognised(f"Add {add.name!r} sums {add.inputs}, expected a bottleneck's input and output")
        layers, t, n, count = layers + block, add.outputs[0], n + 1, count + folded
    return layers, t, n, count


def _mobilefacenet(g: _Graph, x: str) -> tuple[dict[str, Any], list[_Layer], int, str]:
    """MobileFaceNet (backbones/mobilefacenet.py): a stride-2 conv unit, a grouped conv unit or residual
    bottlenecks, three stages of a stride-2 bottleneck and residual ones, conv_sep, the GDC head."""
    layers, t, folded = _conv_unit(g, g.only(x, "Conv"), act=True, kernel=3, stride=2)
    count, stem_width = int(folded), layers[0].tensors[0].shape[0]
    if len(g.after(t)) == 1:  # one grouped 3x3 unit
        unit, t, folded = _conv_unit(g, g.only(t, "Conv"), act=True, kernel=3, stride=1)
        n = 1
    else:
        unit, t, n, folded = _residuals(g, t)
    layers, count, blocks = layers + unit, count + folded, [n]
    while True:
        conv = g.only(t, "Conv")  # a stage's stride-2 bottleneck, or conv_sep: both open with a 1x1 unit
        _, mid, _ = _conv_unit(g, conv, act=True, kernel=1, stride=1)
        if g.only(mid, "Conv").attrs.get("strides", [1])[0] != 2:
            break
        unit, t, folded = _bottleneck(g, conv, 2)
        residual, t, n, more = _residuals(g, t)
        layers, count = layers + unit + residual, count + folded + more
        blocks.append(n)
    if len(blocks) != 4 or stem_width % 64 or min(blocks) < 1:
        raise _Unrecognised(f"MobileFaceNet of blocks {blocks}, stem width {stem_width}: expected a stem and three "
                            f"stages of at least one residual block, a stem width of 64 x scale")
    sep, mid, f1 = _conv_unit(g, conv, act=True, kernel=1, stride=1)
    gdc, gdc_out, f2 = _conv_unit(g, g.only(mid, "Conv"), act=False, stride=1)
    head, out, f3 = _embedding(g, _flatten(g, gdc_out))
    structure = {"blocks": tuple(blocks), "scale": stem_width // 64}
    return structure, layers + sep + gdc + head, count + f1 + f2 + f3, out


# ------------------------------------------------------------------------------------------------ the input
_AFFINE = {  # (A, B) of the map so far, the constant c, whether c is the first operand -> the new (A, B)
    "Sub": lambda a, b, c, first: (-a, c - b) if first else (a, b - c),
    "Add": lambda a, b, c, first: (a, b + c),
    "Mul": lambda a, b, c, first: (a * c, b * c),
    "Div": lambda a, b, c, first: (a / c, b / c),
}
_SYMBOL = {"Sub": "-", "Add": "+", "Mul": "*", "Div": "/"}


def _per_channel(value: np.ndarray) -> np.ndarray | None:
    """``value`` as 3 per-channel numbers when it broadcasts over (N, 3, H, W) by channel alone, else None."""
    if value.size == 1:
        return np.full(3, float(value.reshape(())))
    if value.size == 3 and value.ndim >= 3 and value.shape[-3:] == (3, 1, 1):
        return value.reshape(3)
    return None


def _text(value: np.ndarray) -> str:
    return f"{value[0]:g}" if np.all(value == value[0]) else "[" + ", ".join(f"{v:g}" for v in value) + "]"


def _input_normalisation(g: _Graph, x: str) -> tuple[str, str | None, tuple[np.ndarray, np.ndarray] | None]:
    """The graph's own per-channel Sub/Add/Mul/Div chain on its input before the first convolution: (the tensor
    after it, the chain as text such as "(x - 127.5) * 0.0078125", the map as (A, B): A * x + B), or (x, None,
    None) when there is none."""
    a, b, text = np.ones(3), np.zeros(3), "x"
    while len(g.after(x)) == 1 and g.after(x)[0].op in _AFFINE:
        node = g.after(x)[0]
        first = node.inputs[1] == x
        value = g.const(node, 0 if first else 1)
        c = _per_channel(value)
        if c is None:
            raise _Unrecognised(f"{node.op} {node.name!r} on the input with a constant of shape {value.shape}, "
                                f"expected one number or one per channel")
        a, b = _AFFINE[node.op](a, b, c, first)
        inner = text if text == "x" else f"({text})"
        text = f"{_text(c)} {_SYMBOL[node.op]} {inner}" if first else f"{inner} {_SYMBOL[node.op]} {_text(c)}"
        x = node.outputs[0]
    return (x, None, None) if text == "x" else (x, text, (a, b))


def _fold_input(layers: list[_Layer], affine: tuple[np.ndarray, np.ndarray], mean: float, std: float,
                what: str) -> None:
    """Make the first convolution take ``(x - mean) / std`` for a graph that computes ``A * x + B`` on raw x:
    with x = std * y + mean, the convolution sees A * std * y + (A * mean + B), folded exactly (its input is
    zero-padded) only when the offset is 0; ``UsageError`` starting with ``what`` otherwise."""
    a, b = affine
    offset = a * mean + b
    if np.any(np.abs(offset) > 1e-6 * np.abs(a * std)):
        raise UsageError(f"{what} leaves an offset of {_text(offset)} on the images these tools feed, normalised "
                         f"(x - {mean:g}) / {std:g}; only a normalisation that subtracts {mean:g} folds exactly "
                         f"into the first convolution (its input is zero-padded)")
    conv = layers[0]
    weight = conv.tensors[0].astype(np.float64) * (a * std).reshape(1, 3, 1, 1)
    layers[0] = _Layer("conv", (weight, None), conv.conv)


# ------------------------------------------------------------------------------------------------ reading
def _shape(value_info: Any) -> str:
    dims = value_info.type.tensor_type.shape.dim
    return "(" + ", ".join(str(d.dim_value) if d.HasField("dim_value") else "N" for d in dims) + ")"


def _static(value_info: Any) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") else None for d in value_info.type.tensor_type.shape.dim]


_READERS = {1: (IResNet, _iresnet), 2: (MobileFaceNet, _mobilefacenet)}  # by the stride of the first convolution


def recognise(model: Any, mean: float, std: float, where: str = "the graph") -> Recognised:
    """The ONNX ``model`` (a ``ModelProto``) as one of the families, its weights made to take images normalised
    ``(x - mean) / std``; ``UsageError`` starting with ``where`` and saying what was found otherwise."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    found = (f"{len(inputs)} input{'s' * (len(inputs) != 1)} {', '.join(_shape(i) for i in inputs)} and "
             f"{len(graph.output)} output{'s' * (len(graph.output) != 1)} {', '.join(_shape(o) for o in graph.output)}")
    if len(inputs) != 1 or len(graph.output) != 1:
        raise UsageError(f"{where}: a graph with {found}; a recognition model has one input (N, 3, {INPUT_SIDE}, "
                         f"{INPUT_SIDE}) and one output (N, D) (a face detector has several outputs); supported: "
                         f"{SUPPORTED}")
    dims = _static(inputs[0])
    if len(dims) != 4 or dims[1] not in (3, None) or any(d not in (INPUT_SIDE, None) for d in dims[2:]):
        raise UsageError(f"{where}: a graph with input {_shape(inputs[0])}; a recognition model takes (N, 3, "
                         f"{INPUT_SIDE}, {INPUT_SIDE}) faces (a landmark, attribute or detection model takes another "
                         f"size); supported: {SUPPORTED}")
    try:
        g = _Graph(model)
        x, text, affine = _input_normalisation(g, g.inputs[0])
        first = [n for n in g.after(x) if n.op == "Conv"]
        stride = first[0].attrs.get("strides", [1])[0] if len(first) == 1 else None
        if stride not in _READERS:
            raise _Unrecognised(f"the input goes to {_ops(g.after(x))}, expected one Conv of stride 1 (IResNet) or "
                                f"2 (MobileFaceNet)")
        family, reader = _READERS[stride]
        structure, layers, folded, out = reader(g, x)
        if out != g.outputs[0]:
            raise _Unrecognised(f"the embedding {out!r} is not the graph's output {g.outputs[0]!r}")
        side = (round((layers[-2].tensors[0].shape[1] / structure["widths"][-1]) ** 0.5) if family is IResNet
                else layers[-4].tensors[0].shape[-1])  # fc's input, C * side * side; the GDC's kernel
        if side * _TOTAL_STRIDE != INPUT_SIDE:
            raise _Unrecognised(f"a network for {side * _TOTAL_STRIDE}x{side * _TOTAL_STRIDE} inputs; these tools "
                                f"feed {INPUT_SIDE}x{INPUT_SIDE} faces")
    except _Unrecognised as exc:
        raise UsageError(f"{where}: a graph with {found} that is not one this tool imports: {exc}; supported: "
                         f"{SUPPORTED}") from None
    except (ValueError, TypeError) as exc:  # numpy's, on a tensor whose stored size does not match its shape
        raise UsageError(f"{where}: a damaged ONNX file ({exc})") from None
    if affine is not None:
        _fold_input(layers, affine, mean, std, f"{where}: the graph's own input normalisation {text}")
    return Recognised(family, structure, layers[-2].tensors[0].shape[0], layers, folded, text, affine)


def registered_network(recognised: Recognised, where: str = "the graph") -> tuple[str, dict[str, Any]]:
    """The registered network (``backbones.get_model``'s name and keyword arguments) of ``recognised``;
    ``UsageError`` when none is that structure."""
    s = recognised.structure
    if recognised.family is IResNet:
        if s["layers"] == TINY_LAYERS:
            return "tiny", {"widths": list(s["widths"])}
        if s["layers"] in IRESNET_DEPTHS and s["widths"] == OFFICIAL_WIDTHS:
            return IRESNET_DEPTHS[s["layers"]], {}
    elif (s["blocks"], s["scale"]) in MOBILEFACENETS:
        return MOBILEFACENETS[s["blocks"], s["scale"]], {}
    found = ", ".join(f"{k} {v}" for k, v in s.items() if k != "input_size")
    raise UsageError(f"{where}: an {recognised.family.__name__} of {found}, which is no registered network; "
                     f"supported: {SUPPORTED}")


_MODULES: dict[str, tuple[type[nn.Module], ...]] = {
    "conv": (nn.Conv2d,), "bn": (nn.BatchNorm1d, nn.BatchNorm2d), "prelu": (nn.PReLU,), "linear": (nn.Linear,)}


def fill(model: nn.Module, layers: list[_Layer]) -> dict[str, torch.Tensor]:
    """Copy ``layers`` (``Recognised.layers``) into ``model``'s convolutions, batch norms, PReLUs and linear layers,
    taken in the order the module holds them (its forward's), and return its state dict; ``UsageError`` at the
    first module whose kind, shape or convolution arguments differ."""
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, sum(_MODULES.values(), ()))]
    if len(modules) != len(layers):
        raise UsageError(f"{len(layers)} layers in the graph, {len(modules)} in the {type(model).__name__}")

    def put(target: torch.Tensor, value: np.ndarray, name: str) -> None:
        if tuple(value.shape) != tuple(target.shape):
            raise UsageError(f"{name}: the graph's tensor has shape {tuple(value.shape)}, the module's "
                             f"{tuple(target.shape)}")
        target.copy_(torch.from_numpy(np.require(value, requirements=("C", "W"))).to(target.dtype))

    with torch.no_grad():
        for (name, m), layer in zip(modules, layers, strict=True):
            if not isinstance(m, _MODULES[layer.kind]):
                raise UsageError(f"{name}: a {type(m).__name__} in the module, a {layer.kind} in the graph")
            if layer.kind == "bn":
                gamma, beta, mean, var, eps = layer.tensors
                for target, value in ((m.weight, gamma), (m.bias, beta), (m.running_mean, mean),
                                      (m.running_var, var + eps - m.eps)):  # the same var + eps as the graph's
                    put(target, value, name)
                continue
            put(m.weight, layer.tensors[0], name)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()  # the bias a graph had went to the batch norm after it
            if layer.kind == "conv" and (m.stride[0], m.padding[0], m.groups) != layer.conv:
                raise UsageError(f"{name}: stride, padding, groups {(m.stride[0], m.padding[0], m.groups)} in the "
                                 f"module, {layer.conv} in the graph")
    return {k: v.detach() for k, v in model.state_dict().items()}


def _load(path: Path) -> Any:
    """The ONNX model in ``path``; ``UsageError`` for a file that is not one or is cut short."""
    import onnx

    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf's DecodeError and onnx's own errors: no common type to name
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"{path}: not an ONNX model, or a truncated one ({detail}); supported: {SUPPORTED}") \
            from None
    graph = model.graph
    if not graph.node:
        raise UsageError(f"{path}: not an ONNX model (it holds no graph); supported: {SUPPORTED}")
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    for node in graph.node:
        missing = [t for t in node.input if t not in defined]
        if missing:
            raise UsageError(f"{path}: a truncated or damaged ONNX file: node {node.name or node.op_type!r} reads "
                             f"{missing[0]!r}, which nothing before it defines")
        defined.update(node.output)
    return model


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_onnx(path: str | os.PathLike, mean: float, std: float) -> Imported:
    """The ONNX recognition model at ``path`` as a registered backbone whose weights take images normalised
    ``(x - mean) / std``; ``UsageError`` naming the file and what was found for anything else."""
    path = Path(path)
    if (problem := path_problem(path)) is not None:
        raise UsageError(f"{path}: {problem}")
    recognised = recognise(_load(path), mean, std, str(path))
    network, kwargs = registered_network(recognised, str(path))
    with torch.device("meta"):  # no random initialisation (seconds for an r200): fill writes every weight
        model = get_model(network, num_features=recognised.embedding_size, **kwargs)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()  # the batch norms' num_batches_tracked, which the graph does not hold
    state = fill(model, recognised.layers)
    facts = {SOURCE_KEY: path.name, SHA256_KEY: _sha256(path), FOLDED_KEY: recognised.folded,
             GRAPH_NORMALISATION_KEY: recognised.graph_normalisation}
    return Imported(network, kwargs, recognised.embedding_size, state, facts,
                    None if recognised.graph_affine is None else (mean, std))


def max_relative_difference(imported: Imported, path: str | os.PathLike, images: int = 2, seed: int = 0) -> float:
    """max |onnxruntime - torch| / max |onnxruntime| over the embeddings of ``images`` random images in [-1, 1]
    (the ONNX file fed what its own normalisation expects), one at a time (a file may fix its batch at 1)."""
    import onnxruntime

    with torch.device("meta"):  # no random initialisation: the state dict holds every parameter and buffer
        model = get_model(imported.network, num_features=imported.embedding_size, **imported.network_kwargs)
    model.load_state_dict(imported.state_dict, strict=True, assign=True)
    batch = torch.rand(images, 3, INPUT_SIDE, INPUT_SIDE, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    with torch.no_grad():
        expected = model.eval()(batch).numpy()
    fed = batch if imported.onnx_input is None else batch * imported.onnx_input[1] + imported.onnx_input[0]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    got = np.concatenate([session.run(None, {name: fed[i:i + 1].numpy()})[0] for i in range(images)])
    return float(np.abs(got - expected).max() / np.abs(got).max())
