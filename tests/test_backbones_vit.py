"""The ViT family: official settings and layout, official computation order, random patch masking.

The expected settings, layout and reference forward below are written from insightface arcface_torch's
``backbones/__init__.py`` (which keyword arguments each name passes) and ``backbones/vit.py`` (module
names, shapes, order of operations, the masking procedure), independently of ``backbones/vit.py``.
Full-size layouts are checked on the meta device (vit_h has 756 M parameters); forwards run on vit_t
(19 M) or on reduced instances of the same constructor.
"""
from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from backbones import get_model
from backbones.flops import count_flops
from backbones.vit import VisionTransformer
from tests.helpers import on_ranks

# Official constructor arguments per name: embed_dim, depth, num_heads, drop_path_rate, mask_ratio,
# using_checkpoint. Every variant: img_size 112, patch_size 9, norm_layer "ln", mlp_ratio 4.
OFFICIAL_VIT = {
    "vit_t": (256, 12, 8, 0.1, 0.1, False),
    "vit_t_dp005_mask0": (256, 12, 8, 0.05, 0.0, False),
    "vit_s": (512, 12, 8, 0.1, 0.1, False),
    "vit_s_dp005_mask_0": (512, 12, 8, 0.05, 0.0, False),
    "vit_b": (512, 24, 8, 0.1, 0.1, True),
    "vit_b_dp005_mask_005": (512, 24, 8, 0.05, 0.05, True),
    "vit_l_dp005_mask_005": (768, 24, 8, 0.05, 0.05, True),
    "vit_h": (1024, 48, 8, 0.1, 0.0, True),
}
TOKENS = 144  # (112 // 9) ** 2
# The official forward calls random_masking(x) without the model's ratio: its default 0.1 applies
# whenever the model's mask_ratio > 0, i.e. int(144 * 0.9) = 129 tokens are kept.
OFFICIAL_MASKING_RATIO = 0.1
KEPT = int(TOKENS * (1 - OFFICIAL_MASKING_RATIO))


def _bn(prefix: str, c: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{prefix}.weight", (c,)), (f"{prefix}.bias", (c,)), (f"{prefix}.running_mean", (c,)),
            (f"{prefix}.running_var", (c,)), (f"{prefix}.num_batches_tracked", ())]


def official_vit_layout(dim: int, depth: int, num_features: int = 512,
                        tokens: int = TOKENS) -> list[tuple[str, tuple[int, ...]]]:
    """Ordered (key, shape) list of an official VisionTransformer state_dict (the model's own parameters
    pos_embed and mask_token first, then patch_embed, blocks, norm, feature)."""
    keys = [("pos_embed", (1, tokens, dim)), ("mask_token", (1, 1, dim)),
            ("patch_embed.proj.weight", (dim, 3, 9, 9)), ("patch_embed.proj.bias", (dim,))]
    for i in range(depth):
        p = f"blocks.{i}"
        keys += [(f"{p}.norm1.weight", (dim,)), (f"{p}.norm1.bias", (dim,)),
                 (f"{p}.norm2.weight", (dim,)), (f"{p}.norm2.bias", (dim,)),
                 (f"{p}.attn.qkv.weight", (3 * dim, dim)),
                 (f"{p}.attn.proj.weight", (dim, dim)), (f"{p}.attn.proj.bias", (dim,)),
                 (f"{p}.mlp.fc1.weight", (4 * dim, dim)), (f"{p}.mlp.fc1.bias", (4 * dim,)),
                 (f"{p}.mlp.fc2.weight", (dim, 4 * dim)), (f"{p}.mlp.fc2.bias", (dim,))]
    keys += [("norm.weight", (dim,)), ("norm.bias", (dim,)), ("feature.0.weight", (dim, dim * tokens))]
    keys += _bn("feature.1", dim)
    keys += [("feature.2.weight", (num_features, dim))]
    keys += _bn("feature.3", num_features)
    return keys


def _layout(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def random_official_state_dict(layout: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with O(1) activations: unit-variance-preserving matrices, scales near 1."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for key, shape in layout:
        if key.endswith("num_batches_tracked"):
            sd[key] = torch.tensor(7)
        elif key.endswith("running_var"):
            sd[key] = torch.rand(shape, generator=g) + 0.5
        elif key.endswith(("running_mean", "bias")):
            sd[key] = 0.1 * torch.randn(shape, generator=g)
        elif key in ("pos_embed", "mask_token"):
            sd[key] = torch.randn(shape, generator=g)
        elif len(shape) == 1:  # LayerNorm / BatchNorm scale
            sd[key] = 0.5 + torch.rand(shape, generator=g)
        else:  # conv / linear
            fan_in = int(torch.tensor(shape[1:]).prod())
            sd[key] = torch.randn(shape, generator=g) / fan_in ** 0.5
    return sd


def reference_vit_forward(sd: dict[str, torch.Tensor], x: torch.Tensor, num_heads: int, training: bool,
                          masked: bool = False, drop_path_rates: Sequence[float] = ()) -> torch.Tensor:
    """The official forward from plain functional ops, drawing random numbers in the official order:
    masking noise ``torch.rand(N, L)``, then per block with a drop-path rate > 0 one
    ``bernoulli_(1 - p)`` of shape (N, 1, 1) for the attention branch and one for the MLP branch."""
    dim = sd["pos_embed"].shape[-1]
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    n = x.shape[0]

    def drop_path(t: torch.Tensor, p: float) -> torch.Tensor:
        if not training or p == 0.0:
            return t
        keep = torch.empty(n, 1, 1).bernoulli_(1 - p).div_(1 - p)
        return t * keep

    def bn(t: torch.Tensor, p: str) -> torch.Tensor:
        return F.batch_norm(t, sd[f"{p}.running_mean"].clone(), sd[f"{p}.running_var"].clone(), sd[f"{p}.weight"],
                            sd[f"{p}.bias"], training=training, eps=2e-5)

    x = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=9)  # (N, D, 12, 12)
    x = x.flatten(2).transpose(1, 2) + sd["pos_embed"]  # (N, L, D)
    length = x.shape[1]
    if masked:
        noise = torch.rand(n, length)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        x = torch.gather(x, 1, ids_shuffle[:, :KEPT].unsqueeze(-1).repeat(1, 1, dim))  # (N, KEPT, D)
    rates = list(drop_path_rates) or [0.0] * depth
    for i in range(depth):
        p = f"blocks.{i}"
        t = x.shape[1]
        h = F.layer_norm(x, (dim,), sd[f"{p}.norm1.weight"], sd[f"{p}.norm1.bias"], 1e-5)
        qkv = F.linear(h, sd[f"{p}.attn.qkv.weight"]).reshape(n, t, 3, num_heads, dim // num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (dim // num_heads) ** -0.5).softmax(dim=-1)
        h = (attn @ v).transpose(1, 2).reshape(n, t, dim)
        x = x + drop_path(F.linear(h, sd[f"{p}.attn.proj.weight"], sd[f"{p}.attn.proj.bias"]), rates[i])
        h = F.layer_norm(x, (dim,), sd[f"{p}.norm2.weight"], sd[f"{p}.norm2.bias"], 1e-5)
        h = F.linear(F.relu6(F.linear(h, sd[f"{p}.mlp.fc1.weight"], sd[f"{p}.mlp.fc1.bias"])),
                     sd[f"{p}.mlp.fc2.weight"], sd[f"{p}.mlp.fc2.bias"])
        x = x + drop_path(h, rates[i])
    x = F.layer_norm(x, (dim,), sd["norm.weight"], sd["norm.bias"], 1e-5)
    if masked:
        mask_tokens = sd["mask_token"].repeat(n, length - x.shape[1], 1)
        x = torch.gather(torch.cat([x, mask_tokens], dim=1), 1, ids_restore.unsqueeze(-1).repeat(1, 1, dim))
    x = x.reshape(n, length * dim)
    x = bn(F.linear(x, sd["feature.0.weight"]), "feature.1")
    return bn(F.linear(x, sd["feature.2.weight"]), "feature.3")


# ----------------------------------------------------------------------------------------------------
# Settings and layout (meta device: no memory, vit_h included)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(OFFICIAL_VIT))
def test_vit_settings_match_official(name: str) -> None:
    dim, depth, heads, drop_path_rate, official_mask_ratio, checkpointing = OFFICIAL_VIT[name]
    with torch.device("meta"):
        model = get_model(name)
    assert len(model.blocks) == depth and model.pos_embed.shape == (1, TOKENS, dim)
    assert all(b.attn.num_heads == heads for b in model.blocks)
    assert [b.drop_path.p for b in model.blocks] == torch.linspace(0, drop_path_rate, depth).tolist()
    assert all(isinstance(b.mlp.act, torch.nn.ReLU6) for b in model.blocks)
    assert model.mask_ratio == (OFFICIAL_MASKING_RATIO if official_mask_ratio > 0 else 0.0)
    assert model.activation_checkpointing is checkpointing


@pytest.mark.parametrize("name", sorted(OFFICIAL_VIT))
def test_vit_state_dict_matches_official_layout(name: str) -> None:
    dim, depth = OFFICIAL_VIT[name][:2]
    with torch.device("meta"):
        model = get_model(name)
    assert _layout(model) == official_vit_layout(dim, depth)


def test_vit_t_layout_literal() -> None:
    """vit_t's official keys written out in full for one block, so the layout rule cannot drift with ours."""
    with torch.device("meta"):
        layout = _layout(get_model("vit_t"))
    head = [("pos_embed", (1, 144, 256)), ("mask_token", (1, 1, 256)), ("patch_embed.proj.weight", (256, 3, 9, 9)),
            ("patch_embed.proj.bias", (256,)), ("blocks.0.norm1.weight", (256,)), ("blocks.0.norm1.bias", (256,)),
            ("blocks.0.norm2.weight", (256,)), ("blocks.0.norm2.bias", (256,)),
            ("blocks.0.attn.qkv.weight", (768, 256)), ("blocks.0.attn.proj.weight", (256, 256)),
            ("blocks.0.attn.proj.bias", (256,)), ("blocks.0.mlp.fc1.weight", (1024, 256)),
            ("blocks.0.mlp.fc1.bias", (1024,)), ("blocks.0.mlp.fc2.weight", (256, 1024)),
            ("blocks.0.mlp.fc2.bias", (256,))]
    tail = [("blocks.11.mlp.fc2.bias", (256,)), ("norm.weight", (256,)), ("norm.bias", (256,)),
            ("feature.0.weight", (256, 36864)), ("feature.1.weight", (256,)), ("feature.1.bias", (256,)),
            ("feature.1.running_mean", (256,)), ("feature.1.running_var", (256,)),
            ("feature.1.num_batches_tracked", ()), ("feature.2.weight", (512, 256)), ("feature.3.weight", (512,)),
            ("feature.3.bias", (512,)), ("feature.3.running_mean", (512,)), ("feature.3.running_var", (512,)),
            ("feature.3.num_batches_tracked", ())]
    assert layout[:len(head)] == head and layout[-len(tail):] == tail
    assert len(layout) == 4 + 12 * 11 + 2 + 1 + 5 + 1 + 5


@pytest.mark.parametrize("name", ["vit_t", "vit_h"])
def test_vit_macs_match_the_formula(name: str) -> None:
    """Counted multiply-adds = patch embedding + per block (12·L·D² for qkv, proj and MLP, 2·L²·D for the
    attention products) + feature head: the attention products are counted too."""
    dim, depth = OFFICIAL_VIT[name][:2]
    with torch.device("meta"):
        params, macs = count_flops(get_model(name), 112)
    expected = TOKENS * dim * 3 * 81 + depth * (12 * TOKENS * dim * dim + 2 * TOKENS * TOKENS * dim)
    expected += TOKENS * dim * dim + dim * 512
    assert macs == expected
    layout = official_vit_layout(dim, depth)
    buffers = ("running_mean", "running_var", "num_batches_tracked")
    assert params == sum(int(torch.tensor(s).prod()) for k, s in layout if not k.endswith(buffers))


# ----------------------------------------------------------------------------------------------------
# Official computation order
# ----------------------------------------------------------------------------------------------------
def _vit_t_with_official_weights() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    sd = random_official_state_dict(official_vit_layout(256, 12))
    model = get_model("vit_t")
    model.load_state_dict(sd, strict=True)
    return model, sd


@pytest.mark.timeout(60)
def test_official_vit_weights_give_official_embeddings() -> None:
    """Eval mode: random weights in the official layout, loaded strictly into vit_t, give the reference
    forward's embeddings."""
    torch.manual_seed(1)
    model, sd = _vit_t_with_official_weights()
    x = torch.randn(2, 3, 112, 112)  # (N, 3, 112, 112)
    with torch.no_grad():
        ours = model.eval()(x)  # (2, 512)
        ref = reference_vit_forward(sd, x, num_heads=8, training=False)  # (2, 512)
    assert ref.abs().max() > 1e-2
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.timeout(60)
def test_vit_training_forward_is_the_official_one() -> None:
    """Training mode of vit_t (masking 15 of 144 tokens, drop path up to 0.1, batch statistics): with the
    same seed, the official procedure (noise → argsort → keep 129, mask tokens after the norm, then
    unshuffle; per-sample drop path) gives the same embeddings, so the random draws match too."""
    torch.manual_seed(1)
    model, sd = _vit_t_with_official_weights()
    model.train()
    x = torch.randn(4, 3, 112, 112)  # (N, 3, 112, 112)
    rates = torch.linspace(0, 0.1, 12).tolist()
    torch.manual_seed(7)
    with torch.no_grad():
        ours = model(x)  # (4, 512)
    torch.manual_seed(7)
    ref = reference_vit_forward(sd, x, num_heads=8, training=True, masked=True, drop_path_rates=rates)
    torch.manual_seed(8)
    other_draws = reference_vit_forward(sd, x, num_heads=8, training=True, masked=True, drop_path_rates=rates)
    assert not torch.allclose(other_draws, ref, rtol=1e-3, atol=1e-3)  # the draws matter
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


# ----------------------------------------------------------------------------------------------------
# Random patch masking: training only
# ----------------------------------------------------------------------------------------------------
def _small_vit(mask_ratio: float, dropout: float = 0.0) -> VisionTransformer:
    """vit_t's constructor settings at D = 32 and 2 blocks, without drop path (masking is the only draw)."""
    return VisionTransformer(32, 2, 8, drop_path_rate=0.0, mask_ratio=mask_ratio, num_features=16, dropout=dropout)


def _feature_input(model: VisionTransformer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, the (N, L, D) tokens the feature head received)."""
    seen: list[torch.Tensor] = []
    handle = model.feature.register_forward_pre_hook(lambda mod, inp: seen.append(inp[0]))
    y = model(x)
    handle.remove()
    return y, seen[0].reshape(x.shape[0], TOKENS, -1)


@pytest.mark.parametrize("name", ["vit_t", "vit_b_dp005_mask_005"])
def test_vit_masking_only_in_training(name: str) -> None:
    """Eval: deterministic, no random draw, the same output as the same weights without masking.
    Training: exactly 144 − 129 = 15 positions per sample (also for the *_mask_005 names) hold the
    mask token, different positions per sample and per call; the output differs from the unmasked
    model's and the mask token is trained."""
    torch.manual_seed(0)
    with torch.device("meta"):
        ratio = get_model(name).mask_ratio  # the variant's own setting
    model = _small_vit(ratio)
    unmasked = _small_vit(0.0)
    unmasked.load_state_dict(model.state_dict(), strict=True)
    x = torch.randn(3, 3, 112, 112)  # (N, 3, 112, 112)

    model.eval()
    unmasked.eval()
    state = torch.get_rng_state()
    with torch.no_grad():
        a, b = model(x), model(x)  # (3, 16)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(a, unmasked(x))

    model.train()
    unmasked.train()
    y, tokens = _feature_input(model, x)  # (3, 16), (3, 144, 32)
    is_mask = (tokens == model.mask_token.detach()).all(dim=-1)  # (3, 144)
    assert is_mask.sum(dim=1).tolist() == [TOKENS - KEPT] * 3
    assert len({tuple(row.nonzero().flatten().tolist()) for row in is_mask}) == 3
    _, tokens_again = _feature_input(model, x)
    assert not torch.equal((tokens_again == model.mask_token.detach()).all(dim=-1), is_mask)
    with torch.no_grad():
        assert not torch.allclose(y, unmasked(x))
    y.square().sum().backward()
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0

    model.zero_grad(set_to_none=True)
    model.eval()
    model(x).square().sum().backward()
    assert model.mask_token.grad is None or not model.mask_token.grad.any()


def test_vit_without_masking_sees_every_token_in_training() -> None:
    model = _small_vit(0.0).train()
    _, tokens = _feature_input(model, torch.randn(2, 3, 112, 112))
    assert not (tokens == model.mask_token.detach()).all(dim=-1).any()


def test_vit_dropout_acts_before_the_feature_head() -> None:
    torch.manual_seed(0)
    model = _small_vit(0.0, dropout=0.5).train()
    seen: list[torch.Tensor] = []
    model.feature[0].register_forward_pre_hook(lambda mod, inp: seen.append(inp[0]))
    x = torch.randn(2, 3, 112, 112)
    model(x)
    assert 0.4 < float((seen[0] == 0).float().mean()) < 0.6
    model.eval()
    model(x)
    assert not (seen[1] == 0).any()


def test_vit_rejects_other_input_sizes() -> None:
    model = _small_vit(0.0).eval()
    with pytest.raises(ValueError, match=r"expected \(N, 3, 112, 112\).*got shape \(1, 3, 128, 128\)"):
        model(torch.randn(1, 3, 128, 128))
    other = VisionTransformer(32, 1, 8, num_features=8, input_size=126).eval()  # 14 × 14 tokens
    assert other(torch.randn(1, 3, 126, 126)).shape == (1, 8)
    assert other.pos_embed.shape == (1, 196, 32)


@pytest.mark.parametrize("kwargs", [{"embed_dim": 30}, {"depth": 0}, {"mask_ratio": 1.0},
                                    {"drop_path_rate": -0.1}, {"input_size": 8}])
def test_vit_bad_settings_are_rejected(kwargs: dict) -> None:
    settings = {"embed_dim": 32, "depth": 1, "num_heads": 8, **kwargs}
    with pytest.raises(ValueError, match="VisionTransformer"):
        VisionTransformer(**settings)


def _ddp_steps(rank: int, world_size: int, mask_ratio: float) -> list[float]:
    """Three DDP training steps of a small ViT on this rank's own data, set up as train.py does."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = VisionTransformer(32, 2, 8, drop_path_rate=0.1, mask_ratio=mask_ratio, num_features=8)
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        loss = ddp(torch.randn(2, 3, 112, 112)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return [float(model.pos_embed.sum()), float(model.mask_token.sum())]


@pytest.mark.process
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mask_ratio", [0.0, OFFICIAL_MASKING_RATIO])
def test_vit_trains_under_ddp_with_and_without_masking(mask_ratio: float) -> None:
    """Without masking ``mask_token`` gets no gradient; it is frozen, so DDP (no find_unused_parameters,
    as in train.py) trains on; with masking it is trained and stays identical on both ranks."""
    results = on_ranks(_ddp_steps, 2, mask_ratio)
    assert results[0] == results[1]
    frozen = VisionTransformer(32, 2, 8, mask_ratio=mask_ratio).mask_token.requires_grad is False
    assert frozen is (mask_ratio == 0.0)
