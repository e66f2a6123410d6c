"""MobileFaceNet (Chen et al., 2018, https://arxiv.org/abs/1804.07573) in insightface's two configurations:
``mbf`` (width scale 2, blocks (1, 4, 6, 2)) and ``mbf_large`` (scale 4, blocks (2, 8, 12, 4)).

Inverted-residual bottlenecks (1×1 expand → PReLU → depthwise 3×3 → PReLU → 1×1 linear projection, with
an identity shortcut when shapes match), a 1×1 conv to 512 channels (``conv_sep``), and a global
depthwise conv (GDC) head: 7×7 depthwise conv → flatten → linear → BatchNorm1d. Module attribute names
give the state_dict keys of insightface's files (``layers.N.…``, ``conv_sep.…``,
``features.layers.{0,2,3}.…``). ``conv_sep`` and the GDC head run in full precision outside autocast, as
in the official models. Sizes: docs/backbones.md.
"""
from __future__ import annotations

import torch
from torch import nn

from .checkpointing import maybe_checkpoint
from .precision import full_precision
from .registry import register_model

__all__ = ["MobileFaceNet", "mbf", "mbf_large"]

_TOTAL_STRIDE = 16


class _ConvUnit(nn.Module):
    """conv (no bias) → BN → optional per-channel PReLU, held in ``self.layers`` (keys ``layers.0/1/2``)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int = 1, padding: int = 0,
                 groups: int = 1, act: bool = True) -> None:
        super().__init__()
        units: list[nn.Module] = [
            nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_ch),
        ]
        if act:
            units.append(nn.PReLU(out_ch))
        self.layers = nn.Sequential(*units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class _Bottleneck(nn.Module):
    """Inverted residual: expand 1×1 → depthwise 3×3 (stride) → linear 1×1 projection (+ identity)."""

    def __init__(self, in_ch: int, out_ch: int, hidden: int, stride: int, residual: bool) -> None:
        super().__init__()
        if residual and (stride != 1 or in_ch != out_ch):
            raise ValueError(f"_Bottleneck: a residual block needs stride 1 and in_ch == out_ch, "
                             f"got stride={stride}, {in_ch} -> {out_ch}")
        self.residual = residual
        self.layers = nn.Sequential(
            _ConvUnit(in_ch, hidden, 1),
            _ConvUnit(hidden, hidden, 3, stride=stride, padding=1, groups=hidden),
            _ConvUnit(hidden, out_ch, 1, act=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)  # (N, out_ch, H/stride, W/stride)
        return x + out if self.residual else out


class _ResidualStage(nn.Module):
    """``n`` residual bottlenecks at constant width, held in ``self.layers``."""

    def __init__(self, ch: int, hidden: int, n: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(_Bottleneck(ch, ch, hidden, 1, residual=True) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class _GDCHead(nn.Module):
    """Global depthwise conv head; ``layers.1`` (flatten + dropout) has no parameters, as in the
    official layout, so the keys stay ``layers.0`` (depthwise conv + BN), ``layers.2`` (linear) and
    ``layers.3`` (BatchNorm1d)."""

    def __init__(self, ch: int, side: int, num_features: int, dropout: float) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            _ConvUnit(ch, ch, side, groups=ch, act=False),  # (N, ch, 1, 1)
            nn.Sequential(nn.Flatten(1), nn.Dropout(p=dropout)),  # (N, ch)
            nn.Linear(ch, num_features, bias=False),
            nn.BatchNorm1d(num_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


# Per down-sampling stage: (output width in units of ``scale``, expanded width of its stride-2 bottleneck,
# expanded width of its residual bottlenecks). The expanded widths do not follow ``scale`` in the official
# models (they are the ``groups`` argument of insightface's DepthWise/Residual modules).
_STAGES: tuple[tuple[int, int, int], ...] = ((64, 128, 128), (128, 256, 256), (128, 512, 256))
_STEM_WIDTH = 64  # in units of ``scale``
_STEM_GROUPS = 64  # the grouped 3x3 conv when the stem has one block
_STEM_HIDDEN = 128  # expanded width of the stem's residual bottlenecks when it has more than one
_SEP_CH = 512  # width of conv_sep and of the GDC head, for every scale


class MobileFaceNet(nn.Module):
    """MobileFaceNet mapping (N, 3, input_size, input_size) images to (N, num_features).

    Args:
        blocks: ``(stem, stage1, stage2, stage3)`` block counts. A stem count of 1 gives one grouped
            3x3 conv unit (``groups=64``); more gives that many residual bottlenecks (expanded width 128),
            the official rule. Each stage is a stride-2 bottleneck followed by its count of residual ones.
        scale: width multiplier: the stem and first stage have ``64 * scale`` channels, the last two
            ``128 * scale``.
        num_features: embedding size.
        dropout: dropout probability on the flattened GDC output, before the linear layer.
        input_size: square input side, a multiple of 16 (the official models use 112).
        activation_checkpointing: recompute each unit of ``layers`` in backward (only while training).
    """

    def __init__(
        self,
        blocks: tuple[int, int, int, int] = (1, 4, 6, 2),
        scale: int = 2,
        num_features: int = 512,
        dropout: float = 0.0,
        input_size: int = 112,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if len(blocks) != 4 or any(int(n) < 1 for n in blocks):
            raise ValueError(f"MobileFaceNet: blocks must be 4 positive block counts, got {tuple(blocks)}")
        if scale < 1:
            raise ValueError(f"MobileFaceNet: scale must be >= 1, got {scale}")
        if input_size < _TOTAL_STRIDE or input_size % _TOTAL_STRIDE:
            raise ValueError(f"MobileFaceNet: input_size must be a positive multiple of {_TOTAL_STRIDE}, "
                             f"got {input_size}")
        self.activation_checkpointing = activation_checkpointing
        stem_ch = _STEM_WIDTH * scale
        body: list[nn.Module] = [_ConvUnit(3, stem_ch, 3, stride=2, padding=1)]
        if blocks[0] == 1:
            body.append(_ConvUnit(stem_ch, stem_ch, 3, padding=1, groups=_STEM_GROUPS))
        else:
            body.append(_ResidualStage(stem_ch, _STEM_HIDDEN, blocks[0]))
        in_ch = stem_ch
        for (width, down_hidden, res_hidden), n_res in zip(_STAGES, blocks[1:]):
            out_ch = width * scale
            body.append(_Bottleneck(in_ch, out_ch, down_hidden, stride=2, residual=False))
            body.append(_ResidualStage(out_ch, res_hidden, n_res))
            in_ch = out_ch
        self.layers = nn.Sequential(*body)
        self.conv_sep = _ConvUnit(in_ch, _SEP_CH, 1)
        self.features = _GDCHead(_SEP_CH, input_size // _TOTAL_STRIDE, num_features, dropout)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def stages(self) -> list[tuple[str, tuple[str, ...]]]:
        """The network from the input, stem first, as (stage, names of its modules): the stem's two units, then
        each stride-2 bottleneck with its residual blocks (``blocks``' stage1..stage3); what ``freeze_stages``
        freezes the first of (trainer/finetune.py)."""
        return [("stem", ("layers.0", "layers.1"))] + [
            (f"stage{i}", (f"layers.{2 * i}", f"layers.{2 * i + 1}")) for i in range(1, len(self.layers) // 2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.layers:
            x = maybe_checkpoint(unit, x, self.activation_checkpointing)  # (N, C, H', W')
        # conv_sep and the GDC head run in full precision outside autocast, as in the official models
        # (their autocast region ends after ``layers``): the embedding is never rounded to bf16/fp16.
        with full_precision(x, self.conv_sep.layers[0].weight.dtype) as x:
            x = self.conv_sep(x)  # (N, 512, H/16, W/16)
            return self.features(x)  # (N, num_features)


def _mbf(blocks: tuple[int, int, int, int], scale: int, num_features: int, dropout: float, input_size: int,
         activation_checkpointing: bool) -> MobileFaceNet:
    return MobileFaceNet(blocks, scale, num_features=num_features, dropout=dropout, input_size=input_size,
                         activation_checkpointing=activation_checkpointing)


@register_model
def mbf(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
        activation_checkpointing: bool = False) -> MobileFaceNet:
    """insightface's ``mbf``: scale 2, blocks (1, 4, 6, 2)."""
    return _mbf((1, 4, 6, 2), 2, num_features, dropout, input_size, activation_checkpointing)


@register_model
def mbf_large(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
              activation_checkpointing: bool = False) -> MobileFaceNet:
    """insightface's ``mbf_large``: scale 4, blocks (2, 8, 12, 4) (the stem is two residual bottlenecks)."""
    return _mbf((2, 8, 12, 4), 4, num_features, dropout, input_size, activation_checkpointing)
