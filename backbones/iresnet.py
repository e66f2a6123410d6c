"""IResNet (improved residual network) backbones for face recognition.

The block is the "IR" unit of ArcFace (Deng et al., CVPR 2019, https://arxiv.org/abs/1801.07698, Fig. 7):
BN → conv3×3 → BN → PReLU → conv3×3 (stride) → BN, added to the shortcut with no activation after the
sum. Attribute names, shapes, BatchNorm eps (1e-5) and momentum (PyTorch's default 0.1) follow the
insightface ``arcface_torch`` state_dict layout (keys from the attribute names: ``conv1``, ``bn1``, ``prelu``,
``layer1.0.bn1`` ..., ``bn2``, ``fc``, ``features``), so an official ``backbone.pth`` loads with ``strict=True``
and gives the same embeddings.
``fc`` and ``features`` (the embedding layers) run in full precision outside autocast, as in the
official models, whose autocast region ends after the dropout.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .checkpointing import maybe_checkpoint
from .precision import full_precision
from .registry import register_model

__all__ = ["IBasicBlock", "IResNet", "r18", "r34", "r50", "r100", "r200", "r2060", "tiny"]

_BN_EPS = 1e-5
# Every stage halves the resolution with its first block: 112 → 56 → 28 → 14 → 7.
_TOTAL_STRIDE = 16


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    """IR block: ``bn3(conv2(prelu(bn2(conv1(bn1(x)))))) + shortcut(x)``; conv2 carries the stride."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch, eps=_BN_EPS)
        self.conv1 = _conv3x3(in_ch, out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch, eps=_BN_EPS)
        self.prelu = nn.PReLU(out_ch)
        self.conv2 = _conv3x3(out_ch, out_ch, stride)
        self.bn3 = nn.BatchNorm2d(out_ch, eps=_BN_EPS)
        # The official layout has a projection exactly when the shape changes; the key ``downsample``
        # must be absent otherwise, or strict loading of official weights fails.
        self.downsample: nn.Sequential | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch, eps=_BN_EPS),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))  # (N, C_out, H/s, W/s)
        shortcut = x if self.downsample is None else self.downsample(x)  # (N, C_out, H/s, W/s)
        return out + shortcut


class IResNet(nn.Module):
    """IResNet mapping (N, 3, input_size, input_size) normalised images to (N, num_features).

    Args:
        layers: blocks per stage (four stages).
        widths: channels per stage; the stem has ``widths[0]`` channels.
        num_features: embedding size.
        dropout: dropout probability on the flattened feature map before ``fc``.
        input_size: square input side, a multiple of 16 (the official models use 112).
        activation_checkpointing: recompute each block in backward instead of storing its activations
            (only while training); outputs, gradients and BatchNorm statistics are unchanged.
    """

    def __init__(
        self,
        layers: Sequence[int],
        widths: Sequence[int] = (64, 128, 256, 512),
        num_features: int = 512,
        dropout: float = 0.0,
        input_size: int = 112,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or any(int(n) < 1 for n in layers):
            raise ValueError(f"IResNet: layers must be 4 positive block counts, got {tuple(layers)}")
        if len(widths) != 4 or any(int(w) < 1 for w in widths):
            raise ValueError(f"IResNet: widths must be 4 positive channel counts, got {tuple(widths)}")
        if input_size < _TOTAL_STRIDE or input_size % _TOTAL_STRIDE:
            raise ValueError(f"IResNet: input_size must be a positive multiple of {_TOTAL_STRIDE}, got {input_size}")
        self.activation_checkpointing = activation_checkpointing
        final_side = input_size // _TOTAL_STRIDE

        self.conv1 = _conv3x3(3, widths[0])
        self.bn1 = nn.BatchNorm2d(widths[0], eps=_BN_EPS)
        self.prelu = nn.PReLU(widths[0])
        in_ch = widths[0]
        for i, (n_blocks, out_ch) in enumerate(zip(layers, widths), start=1):
            blocks = [IBasicBlock(in_ch, out_ch, stride=2)]
            blocks += [IBasicBlock(out_ch, out_ch, stride=1) for _ in range(n_blocks - 1)]
            self.add_module(f"layer{i}", nn.Sequential(*blocks))
            in_ch = out_ch
        self.bn2 = nn.BatchNorm2d(in_ch, eps=_BN_EPS)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(in_ch * final_side * final_side, num_features)
        # Embedding BatchNorm with its scale frozen at 1 (only the shift is learnt), as in the official
        # models; official files store that 1, and loading keeps requires_grad False.
        self.features = nn.BatchNorm1d(num_features, eps=_BN_EPS)
        self._init_weights()

    def _init_weights(self) -> None:
        # Same scheme as the official models, so training from scratch behaves like arcface_torch.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, mean=0.0, std=0.1)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.ones_(self.features.weight)
        self.features.weight.requires_grad_(False)

    def stages(self) -> list[tuple[str, tuple[str, ...]]]:
        """The network from the input, stem first, as (stage, names of its modules): what ``freeze_stages``
        freezes the first of (trainer/finetune.py)."""
        return [("stem", ("conv1", "bn1", "prelu"))] + [(f"layer{i}", (f"layer{i}",)) for i in range(1, 5)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prelu(self.bn1(self.conv1(x)))  # (N, C0, H, W)
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in stage:
                x = maybe_checkpoint(block, x, self.activation_checkpointing)  # (N, C_i, H/2^i, W/2^i)
        x = self.dropout(torch.flatten(self.bn2(x), 1))  # (N, C3 * H/16 * W/16)
        # The embedding layers run in full precision outside autocast, as in the official models (their
        # autocast region ends after the dropout): the embedding is never rounded to bf16/fp16.
        with full_precision(x, self.fc.weight.dtype) as x:
            x = self.fc(x)  # (N, num_features)
            return self.features(x)  # (N, num_features)


def _iresnet(
    layers: Sequence[int],
    num_features: int,
    dropout: float,
    input_size: int,
    activation_checkpointing: bool,
    widths: Sequence[int] = (64, 128, 256, 512),
) -> IResNet:
    return IResNet(
        layers,
        widths=tuple(int(w) for w in widths),
        num_features=num_features,
        dropout=dropout,
        input_size=input_size,
        activation_checkpointing=activation_checkpointing,
    )


@register_model
def r18(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
        activation_checkpointing: bool = False) -> IResNet:
    """IResNet-18, official layout."""
    return _iresnet((2, 2, 2, 2), num_features, dropout, input_size, activation_checkpointing)


@register_model
def r34(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
        activation_checkpointing: bool = False) -> IResNet:
    """IResNet-34, official layout."""
    return _iresnet((3, 4, 6, 3), num_features, dropout, input_size, activation_checkpointing)


@register_model
def r50(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
        activation_checkpointing: bool = False) -> IResNet:
    """IResNet-50, official layout."""
    return _iresnet((3, 4, 14, 3), num_features, dropout, input_size, activation_checkpointing)


@register_model
def r100(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
         activation_checkpointing: bool = False) -> IResNet:
    """IResNet-100, official layout."""
    return _iresnet((3, 13, 30, 3), num_features, dropout, input_size, activation_checkpointing)


@register_model
def r200(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
         activation_checkpointing: bool = False) -> IResNet:
    """IResNet-200, official layout."""
    return _iresnet((6, 26, 60, 6), num_features, dropout, input_size, activation_checkpointing)


@register_model
def r2060(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
          activation_checkpointing: bool = True) -> IResNet:
    """IResNet-2060, official layout: blocks (3, 128, 896, 3), otherwise the same network as r18…r200.

    The official model always recomputes stages 2 and 3 in backward while training (1.1 G parameters;
    without it the activations of 1024 blocks do not fit a GPU), so activation checkpointing is on by
    default here; pass ``activation_checkpointing=False`` to store activations instead.
    """
    return _iresnet((3, 128, 896, 3), num_features, dropout, input_size, activation_checkpointing)


@register_model
def tiny(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
         activation_checkpointing: bool = False, widths: Sequence[int] = (16, 32, 64, 128)) -> IResNet:
    """Narrow IResNet with one block per stage, for tests and CPU demos (no official weights)."""
    return _iresnet((1, 1, 1, 1), num_features, dropout, input_size, activation_checkpointing, widths)
