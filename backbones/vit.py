"""Vision Transformer backbones for 112×112 faces, as insightface's ``arcface_torch`` names and builds them.

Dosovitskiy et al., ICLR 2021 (https://arxiv.org/abs/2010.11929), without a class token: a 9×9 patch embedding
(144 tokens) plus learnt positions, pre-norm blocks (attention, ReLU6 MLP, stochastic depth), a final LayerNorm
and a feature head Linear → BatchNorm1d → Linear → BatchNorm1d on the flattened tokens. Parameter names, shapes
and order are the official ones, so an official ``backbone.pth`` loads with ``strict=True`` and gives the
official embeddings. ``VIT_VARIANTS`` holds the registered variants (``get_model("vit_b")``).

In training mode a masked variant replaces random tokens by ``mask_token`` as the official forward does (which
masks 10 % whatever the variant's name says); eval mode is deterministic. The final norm, the mask-token restore
and the feature head run in full precision: the embedding is never rounded. The layers in detail, masking and
precision: docs/backbones.md#vit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .checkpointing import maybe_checkpoint
from .precision import full_precision
from .registry import register_model

__all__ = ["ViTSpec", "VIT_VARIANTS", "VisionTransformer"]

_LN_EPS = 1e-5
_FEATURE_BN_EPS = 2e-5
_INIT_STD = 0.02


class _DropPath(nn.Module):
    """Stochastic depth: zero a residual branch for a random subset of samples while training."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        # One draw per sample; survivors are scaled so the expected value of the branch is unchanged.
        scale = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)  # (N, 1, 1)
        return x * scale


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        qkv = self.qkv(x).reshape(n, length, 3, self.num_heads, dim // self.num_heads)  # (N, L, 3, H, D/H)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, N, H, L, D/H)
        # Scores and softmax in full precision, as the official model computes them; the scale is
        # 1/sqrt(D/H), scaled_dot_product_attention's default.
        with full_precision(qkv, self.qkv.weight.dtype) as qkv:
            out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (N, H, L, D/H)
        out = out.transpose(1, 2).reshape(n, length, dim)  # (N, L, D)
        return self.proj(out)  # (N, L, D)


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.ReLU6()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (N, L, D)


class _Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, drop_path: float) -> None:
        super().__init__()
        # Both norms are created before ``attn`` so that the state_dict lists them first, as the official one.
        self.norm1 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.attn = _Attention(dim, num_heads)
        self.drop_path = _DropPath(drop_path)
        self.mlp = _Mlp(dim, mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))  # (N, L, D)
        return x + self.drop_path(self.mlp(self.norm2(x)))  # (N, L, D)


class _PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (N, L, D), tokens in row-major patch order


class VisionTransformer(nn.Module):
    """ViT mapping (N, 3, input_size, input_size) normalised images to (N, num_features).

    Args:
        embed_dim: token width D.
        depth: number of transformer blocks.
        num_heads: attention heads; must divide ``embed_dim``.
        drop_path_rate: stochastic-depth rate of the last block (linear from 0 over the blocks).
        mask_ratio: fraction of tokens masked while training (kept: ``int(L * (1 - mask_ratio))``); 0 = off.
        num_features: embedding size.
        dropout: dropout probability on the flattened tokens before the feature head.
        input_size: square input side (the official models use 112); tokens: ``(input_size // 9) ** 2``.
        patch_size: side of the square patches (9 in every official variant).
        mlp_ratio: MLP hidden width over ``embed_dim``.
        activation_checkpointing: recompute each block in backward (only while training).
    """

    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_heads: int,
        drop_path_rate: float = 0.0,
        mask_ratio: float = 0.0,
        num_features: int = 512,
        dropout: float = 0.0,
        input_size: int = 112,
        patch_size: int = 9,
        mlp_ratio: float = 4.0,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if embed_dim < 1 or num_heads < 1 or embed_dim % num_heads:
            raise ValueError(f"VisionTransformer: embed_dim must be a positive multiple of num_heads, "
                             f"got embed_dim={embed_dim}, num_heads={num_heads}")
        if depth < 1:
            raise ValueError(f"VisionTransformer: depth must be >= 1, got {depth}")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ValueError(f"VisionTransformer: drop_path_rate must be in [0, 1), got {drop_path_rate}")
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"VisionTransformer: mask_ratio must be in [0, 1), got {mask_ratio}")
        if patch_size < 1 or input_size < patch_size:
            raise ValueError(f"VisionTransformer: input_size must be >= patch_size >= 1, "
                             f"got input_size={input_size}, patch_size={patch_size}")
        self.input_size = input_size
        self.mask_ratio = mask_ratio
        self.activation_checkpointing = activation_checkpointing
        self.num_tokens = (input_size // patch_size) ** 2

        self.patch_embed = _PatchEmbed(patch_size, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, embed_dim))
        # float32 linspace on the CPU, as the official model: the same rates, also when built on ``meta``.
        rates = torch.linspace(0.0, drop_path_rate, depth, device="cpu").tolist()
        self.blocks = nn.ModuleList(
            _Block(embed_dim, num_heads, int(embed_dim * mlp_ratio), rate) for rate in rates
        )
        self.norm = nn.LayerNorm(embed_dim, eps=_LN_EPS)
        self.dropout = nn.Dropout(p=dropout)
        self.feature = nn.Sequential(
            nn.Linear(embed_dim * self.num_tokens, embed_dim, bias=False),
            nn.BatchNorm1d(embed_dim, eps=_FEATURE_BN_EPS),
            nn.Linear(embed_dim, num_features, bias=False),
            nn.BatchNorm1d(num_features, eps=_FEATURE_BN_EPS),
        )
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self._init_weights()
        # Without masking the token is never used (official files still store it). Frozen, it is left out
        # of DDP's gradient reduction, which would otherwise stop at the first step waiting for its grad.
        self.mask_token.requires_grad_(mask_ratio > 0)

    def _init_weights(self) -> None:
        # The official scheme (truncated normal, std 0.02, for linear layers and positions), so training
        # from scratch behaves like arcface_torch.
        nn.init.trunc_normal_(self.pos_embed, std=_INIT_STD)
        nn.init.normal_(self.mask_token, std=_INIT_STD)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=_INIT_STD)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _keep_random_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep ``int(L * (1 - mask_ratio))`` random tokens per sample, in random order."""
        n, length, dim = x.shape
        n_keep = int(length * (1 - self.mask_ratio))
        noise = torch.rand(n, length, device=x.device)  # (N, L)
        keep = noise.argsort(dim=1)[:, :n_keep]  # (N, L_keep) token ids with the smallest noise
        return x.gather(1, keep.unsqueeze(-1).expand(-1, -1, dim)), keep  # (N, L_keep, D), (N, L_keep)

    def _restore_tokens(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Put the kept tokens back at their positions and ``mask_token`` everywhere else."""
        n, _, dim = x.shape
        filled = self.mask_token.expand(n, self.num_tokens, dim)  # (N, L, D)
        return filled.scatter(1, keep.unsqueeze(-1).expand(-1, -1, dim), x)  # (N, L, D)

    def stages(self) -> list[tuple[str, tuple[str, ...]]]:
        """The network from the input, stem first, as (stage, names of its modules and parameters): the patch
        embedding with the positions, then each transformer block; what ``freeze_stages`` freezes the first of
        (trainer/finetune.py)."""
        return [("stem", ("patch_embed", "pos_embed"))] + [(f"blocks.{i}", (f"blocks.{i}",))
                                                           for i in range(len(self.blocks))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != (self.input_size, self.input_size):
            raise ValueError(f"VisionTransformer: expected (N, 3, {self.input_size}, {self.input_size}) images "
                             f"(input_size={self.input_size}), got shape {tuple(x.shape)}")
        x = self.patch_embed(x) + self.pos_embed  # (N, L, D)
        keep = None
        if self.training and self.mask_ratio > 0:
            x, keep = self._keep_random_tokens(x)  # (N, L_keep, D)
        for block in self.blocks:
            x = maybe_checkpoint(block, x, self.activation_checkpointing)  # (N, L_keep, D)
        # The official model leaves autocast here: norm, restore and feature head in full precision.
        with full_precision(x, self.norm.weight.dtype) as x:
            x = self.norm(x)  # (N, L_keep, D)
            if keep is not None:
                x = self._restore_tokens(x, keep)  # (N, L, D)
            x = self.dropout(x.flatten(1))  # (N, L * D)
            return self.feature(x)  # (N, num_features)


@dataclass(frozen=True)
class ViTSpec:
    """One arcface_torch ViT variant: what its official constructor call sets."""

    embed_dim: int
    depth: int
    num_heads: int
    drop_path_rate: float
    mask_ratio: float  # the ratio the official forward actually masks (see the module docstring)
    activation_checkpointing: bool  # the official default for this variant


VIT_VARIANTS: dict[str, ViTSpec] = {
    "vit_t": ViTSpec(256, 12, 8, 0.1, 0.1, False),
    "vit_t_dp005_mask0": ViTSpec(256, 12, 8, 0.05, 0.0, False),
    "vit_s": ViTSpec(512, 12, 8, 0.1, 0.1, False),
    "vit_s_dp005_mask_0": ViTSpec(512, 12, 8, 0.05, 0.0, False),
    "vit_b": ViTSpec(512, 24, 8, 0.1, 0.1, True),
    # The official constructor asks for mask_ratio=0.05, but its forward masks with the default 0.1.
    "vit_b_dp005_mask_005": ViTSpec(512, 24, 8, 0.05, 0.1, True),
    "vit_l_dp005_mask_005": ViTSpec(768, 24, 8, 0.05, 0.1, True),
    "vit_h": ViTSpec(1024, 48, 8, 0.1, 0.0, True),
}


def _register_variant(name: str, spec: ViTSpec) -> None:
    def builder(num_features: int = 512, dropout: float = 0.0, input_size: int = 112,
                activation_checkpointing: bool = spec.activation_checkpointing) -> VisionTransformer:
        return VisionTransformer(
            spec.embed_dim, spec.depth, spec.num_heads, drop_path_rate=spec.drop_path_rate,
            mask_ratio=spec.mask_ratio, num_features=num_features, dropout=dropout, input_size=input_size,
            activation_checkpointing=activation_checkpointing,
        )

    builder.__name__ = builder.__qualname__ = name
    builder.__doc__ = (f"arcface_torch's {name}: D={spec.embed_dim}, depth {spec.depth}, {spec.num_heads} heads, "
                       f"drop path {spec.drop_path_rate}, masking {spec.mask_ratio}, patch 9, official layout.")
    register_model(builder)


for _name, _spec in VIT_VARIANTS.items():
    _register_variant(_name, _spec)
