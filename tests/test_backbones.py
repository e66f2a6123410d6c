"""Backbones: registry, official state_dict layout, official computation order, checkpointing, FLOPs,
full-precision embedding tail under autocast.

The expected layouts and the reference forwards below are written from shared/FORMATS.md ("Backbone
weights in circulation") and the insightface ``iresnet``/``iresnet2060``/``mobilefacenet`` structure
(block counts, widths, the MobileFaceNet stem rule), independently of ``backbones/``: if our modules drift
from the official layout or order, official weight files stop loading or stop giving the official
embeddings, and these tests fail. The ViT family has its own file, tests/test_backbones_vit.py.
"""
from __future__ import annotations

import functools
import re
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

from backbones import get_model, list_models
from backbones.flops import count_flops
from backbones.iresnet import IResNet
from backbones.mobilefacenet import MobileFaceNet
from backbones.vit import VisionTransformer
from tests.helpers import ROOT

# Names the team contract promises: every backbone of arcface_torch, plus our `tiny`.
VIT_NAMES = {"vit_t", "vit_t_dp005_mask0", "vit_s", "vit_s_dp005_mask_0", "vit_b", "vit_b_dp005_mask_005",
             "vit_l_dp005_mask_005", "vit_h"}
CONTRACT_NAMES = {"r18", "r34", "r50", "r100", "r200", "r2060", "mbf", "mbf_large", "tiny"} | VIT_NAMES
# Official block counts (insightface iresnet.py / iresnet2060.py: r2060 is [3, 128, 1024 - 128, 3]).
IRESNET_BLOCKS = {"r18": (2, 2, 2, 2), "r34": (3, 4, 6, 3), "r50": (3, 4, 14, 3), "r100": (3, 13, 30, 3),
                  "r200": (6, 26, 60, 6), "r2060": (3, 128, 896, 3)}
OFFICIAL_WIDTHS = (64, 128, 256, 512)
# Official MobileFaceNet settings (insightface get_mbf / get_mbf_large): (blocks, scale).
MBF_SETTINGS = {"mbf": ((1, 4, 6, 2), 2), "mbf_large": ((2, 8, 12, 4), 4)}
# Measured on one CPU thread, batch 2 at 112×112 (build + forward + backward): these take at most 4 s
# (r50); r100 7 s, vit_b 6 s, r200 10 s, vit_l 16 s, and vit_h / r2060 hold 0.76 / 1.1 G parameters
# (6-9 GB with gradients; not run). The others are checked at reduced size (see `reduced_instance`)
# and, at full size, on the meta device (layout tests below and in test_backbones_vit.py).
FULL_SIZE = {"tiny", "mbf", "mbf_large", "r18", "r34", "r50", "vit_t", "vit_t_dp005_mask0", "vit_s",
             "vit_s_dp005_mask_0"}


# ----------------------------------------------------------------------------------------------------
# Expected layouts, from the format description (not from our modules)
# ----------------------------------------------------------------------------------------------------
def _bn(prefix: str, c: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{prefix}.weight", (c,)), (f"{prefix}.bias", (c,)), (f"{prefix}.running_mean", (c,)),
            (f"{prefix}.running_var", (c,)), (f"{prefix}.num_batches_tracked", ())]


def official_iresnet_layout(blocks: Sequence[int], widths: Sequence[int] = OFFICIAL_WIDTHS,
                            num_features: int = 512, side: int = 7) -> list[tuple[str, tuple[int, ...]]]:
    """Ordered (key, shape) list of an official IResNet state_dict."""
    keys = [("conv1.weight", (widths[0], 3, 3, 3)), *_bn("bn1", widths[0]), ("prelu.weight", (widths[0],))]
    c_in = widths[0]
    for s, (n, c) in enumerate(zip(blocks, widths), start=1):
        for b in range(n):
            p = f"layer{s}.{b}"
            keys += _bn(f"{p}.bn1", c_in)
            keys += [(f"{p}.conv1.weight", (c, c_in, 3, 3))]
            keys += _bn(f"{p}.bn2", c)
            keys += [(f"{p}.prelu.weight", (c,)), (f"{p}.conv2.weight", (c, c, 3, 3))]
            keys += _bn(f"{p}.bn3", c)
            if b == 0:  # stride 2: the shape changes, so a 1×1 projection
                keys += [(f"{p}.downsample.0.weight", (c, c_in, 1, 1)), *_bn(f"{p}.downsample.1", c)]
            c_in = c
    keys += _bn("bn2", c_in)
    keys += [("fc.weight", (num_features, c_in * side * side)), ("fc.bias", (num_features,))]
    keys += _bn("features", num_features)
    return keys


def official_mbf_layout(blocks: Sequence[int] = (1, 4, 6, 2), scale: int = 2,
                        num_features: int = 512) -> list[tuple[str, tuple[int, ...]]]:
    """Ordered (key, shape) list of insightface's MobileFaceNet(blocks, scale).

    The official rule: widths 64·scale (stem, stage 1) and 128·scale (stages 2, 3); expanded widths 128,
    128, 256, 256, 512, 256 whatever the scale; a one-block stem is a 3×3 conv with groups=64, a longer
    one is that many residual bottlenecks of expanded width 128; conv_sep and the GDC head are 512 wide.
    """
    def unit(p: str, c_in: int, c_out: int, k: int, groups: int = 1, act: bool = True):
        out = [(f"{p}.layers.0.weight", (c_out, c_in // groups, k, k)), *_bn(f"{p}.layers.1", c_out)]
        return out + ([(f"{p}.layers.2.weight", (c_out,))] if act else [])

    def bottleneck(p: str, c_in: int, c_out: int, hidden: int):
        return (unit(f"{p}.layers.0", c_in, hidden, 1) + unit(f"{p}.layers.1", hidden, hidden, 3, hidden)
                + unit(f"{p}.layers.2", hidden, c_out, 1, act=False))

    def residual(p: str, c: int, hidden: int, n: int):
        return [kv for i in range(n) for kv in bottleneck(f"{p}.layers.{i}", c, c, hidden)]

    c1, c2 = 64 * scale, 128 * scale
    keys = unit("layers.0", 3, c1, 3)
    keys += unit("layers.1", c1, c1, 3, groups=64) if blocks[0] == 1 else residual("layers.1", c1, 128, blocks[0])
    keys += bottleneck("layers.2", c1, c1, 128) + residual("layers.3", c1, 128, blocks[1])
    keys += bottleneck("layers.4", c1, c2, 256) + residual("layers.5", c2, 256, blocks[2])
    keys += bottleneck("layers.6", c2, c2, 512) + residual("layers.7", c2, 256, blocks[3])
    keys += unit("conv_sep", c2, 512, 1)
    keys += unit("features.layers.0", 512, 512, 7, groups=512, act=False)
    keys += [("features.layers.2.weight", (num_features, 512)), *_bn("features.layers.3", num_features)]
    return keys


def _layout(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def random_official_state_dict(layout: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with plausible BN statistics (so eval-mode activations stay O(1))."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for key, shape in layout:
        if key.endswith("num_batches_tracked"):
            sd[key] = torch.tensor(7)
        elif key.endswith("running_var"):
            sd[key] = torch.rand(shape, generator=g) + 0.5
        elif key.endswith(("running_mean", "bias")):
            sd[key] = 0.1 * torch.randn(shape, generator=g)
        elif key == "features.weight":
            sd[key] = torch.ones(shape)
        elif len(shape) == 1:  # BN scale or PReLU slope
            sd[key] = 0.5 + torch.rand(shape, generator=g)
        else:  # conv / linear: variance-preserving scale
            fan_in = int(torch.tensor(shape[1:]).prod())
            sd[key] = torch.randn(shape, generator=g) / fan_in ** 0.5
    return sd


def reference_iresnet_forward(sd: dict[str, torch.Tensor], blocks: Sequence[int], x: torch.Tensor) -> torch.Tensor:
    """Eval-mode IResNet forward in the order FORMATS.md gives, from plain functional ops."""
    def bn(t: torch.Tensor, p: str) -> torch.Tensor:
        return F.batch_norm(t, sd[f"{p}.running_mean"], sd[f"{p}.running_var"], sd[f"{p}.weight"],
                            sd[f"{p}.bias"], training=False, eps=1e-5)

    x = F.prelu(bn(F.conv2d(x, sd["conv1.weight"], padding=1), "bn1"), sd["prelu.weight"])
    for s, n in enumerate(blocks, start=1):
        for b in range(n):
            p = f"layer{s}.{b}"
            stride = 2 if b == 0 else 1
            out = F.conv2d(bn(x, f"{p}.bn1"), sd[f"{p}.conv1.weight"], padding=1)
            out = F.prelu(bn(out, f"{p}.bn2"), sd[f"{p}.prelu.weight"])
            out = bn(F.conv2d(out, sd[f"{p}.conv2.weight"], stride=stride, padding=1), f"{p}.bn3")
            if b == 0:
                short = bn(F.conv2d(x, sd[f"{p}.downsample.0.weight"], stride=stride), f"{p}.downsample.1")
            else:
                short = x
            x = out + short
    x = torch.flatten(bn(x, "bn2"), 1)
    x = F.linear(x, sd["fc.weight"], sd["fc.bias"])
    return bn(x, "features")


def reference_mbf_forward(sd: dict[str, torch.Tensor], blocks: Sequence[int], x: torch.Tensor) -> torch.Tensor:
    """Eval-mode MobileFaceNet forward in the official order, from plain functional ops."""
    def bn(t: torch.Tensor, p: str) -> torch.Tensor:
        return F.batch_norm(t, sd[f"{p}.running_mean"], sd[f"{p}.running_var"], sd[f"{p}.weight"],
                            sd[f"{p}.bias"], training=False, eps=1e-5)

    def unit(t: torch.Tensor, p: str, stride: int = 1, padding: int = 0, groups: int = 1, act: bool = True):
        t = bn(F.conv2d(t, sd[f"{p}.layers.0.weight"], stride=stride, padding=padding, groups=groups),
               f"{p}.layers.1")
        return F.prelu(t, sd[f"{p}.layers.2.weight"]) if act else t

    def depthwise(t: torch.Tensor, p: str, stride: int, residual: bool) -> torch.Tensor:
        hidden = sd[f"{p}.layers.0.layers.0.weight"].shape[0]
        out = unit(t, f"{p}.layers.0")
        out = unit(out, f"{p}.layers.1", stride=stride, padding=1, groups=hidden)
        out = unit(out, f"{p}.layers.2", act=False)
        return t + out if residual else out

    def residual_stage(t: torch.Tensor, p: str, n: int) -> torch.Tensor:
        for i in range(n):
            t = depthwise(t, f"{p}.layers.{i}", 1, True)
        return t

    x = unit(x, "layers.0", stride=2, padding=1)
    x = unit(x, "layers.1", padding=1, groups=64) if blocks[0] == 1 else residual_stage(x, "layers.1", blocks[0])
    for s, n in enumerate(blocks[1:]):
        x = depthwise(x, f"layers.{2 + 2 * s}", 2, False)
        x = residual_stage(x, f"layers.{3 + 2 * s}", n)
    x = unit(x, "conv_sep")
    x = torch.flatten(unit(x, "features.layers.0", groups=512, act=False), 1)
    return bn(F.linear(x, sd["features.layers.2.weight"]), "features.layers.3")


@functools.cache
def meta_model(name: str) -> torch.nn.Module:
    """The full-size model on the meta device (shapes only, no memory), built once: r2060 takes ~3 s."""
    with torch.device("meta"):
        return get_model(name)


def reduced_instance(name: str, num_features: int = 16) -> torch.nn.Module:
    """The variant's own family constructor with its settings, at reduced depth and width.

    IResNet: at most 2 blocks per stage, widths (8, 16, 16, 32); ViT: D = 32, 2 blocks, the variant's
    heads, last-block drop-path rate, masking and checkpointing default. Settings are read from the
    full-size model built on the meta device (which also proves that it builds).
    """
    full = meta_model(name)
    if isinstance(full, IResNet):
        blocks = tuple(min(len(getattr(full, f"layer{i}")), 2) for i in range(1, 5))
        return IResNet(blocks, widths=(8, 16, 16, 32), num_features=num_features,
                       activation_checkpointing=full.activation_checkpointing)
    if isinstance(full, VisionTransformer):
        return VisionTransformer(32, 2, full.blocks[0].attn.num_heads, drop_path_rate=full.blocks[-1].drop_path.p,
                                 mask_ratio=full.mask_ratio, num_features=num_features,
                                 activation_checkpointing=full.activation_checkpointing)
    raise AssertionError(f"no reduced instance for {name!r} ({type(full).__name__})")


def small_instance(name: str) -> torch.nn.Module:
    """A cheap instance of every registered name (MobileFaceNets are cheap at full size)."""
    if name == "tiny":
        return get_model("tiny", num_features=16, widths=(4, 8, 8, 16))
    if name in MBF_SETTINGS:
        return get_model(name, num_features=16)
    return reduced_instance(name)


# ----------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------
def test_registry_names_match_contract() -> None:
    assert set(list_models()) == CONTRACT_NAMES
    assert list_models() == sorted(list_models())


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown backbone 'r51'") as info:
        get_model("r51")
    for name in CONTRACT_NAMES:
        assert name in str(info.value)


def test_unknown_kwarg_is_rejected_with_accepted_list() -> None:
    with pytest.raises(ValueError, match=r"unknown keyword argument\(s\) \['widht'\].*widths"):
        get_model("tiny", widht=(4, 8, 8, 16))
    with pytest.raises(ValueError, match=r"\['widths'\]"):  # only tiny's widths are free
        get_model("r50", widths=(4, 8, 8, 16))


@pytest.mark.parametrize("value", [True, False])
def test_fp16_kwarg_points_to_the_trainer(value: bool) -> None:
    with pytest.raises(ValueError, match="precision is the trainer's choice"):
        get_model("tiny", fp16=value)


@pytest.mark.parametrize("kwargs", [{"num_features": 0}, {"dropout": 1.0}, {"input_size": 100},
                                    {"widths": (4, 8, 8)}])
def test_bad_values_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        get_model("tiny", **kwargs)


# ----------------------------------------------------------------------------------------------------
# Every registered model
# ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list_models())
def test_every_model_trains_and_round_trips(name: str) -> None:
    """Forward + backward in training mode at batch 2, finite outputs and gradients, then an exact
    state_dict round trip into a differently initialised instance (same tensors, same outputs).

    Names in FULL_SIZE run at full size on 112×112 images. The others (r100, r200, r2060, vit_b*, vit_l,
    vit_h) run as `reduced_instance`: the same family constructor with the variant's settings at reduced
    depth/width; their full-size layout (keys, shapes, parameter count) is checked on the meta device by
    the layout tests, and `test_deep_models_full_size_forward` runs r100/r200/vit_b at full size.
    """
    torch.manual_seed(0)
    build: Callable[[], torch.nn.Module] = (
        (lambda: get_model(name, num_features=16)) if name in FULL_SIZE else (lambda: reduced_instance(name)))
    model = build().train()
    x = torch.randn(2, 3, 112, 112)  # (N, 3, 112, 112); BN in training mode needs N > 1
    y = model(x)  # (2, 16)
    assert y.shape == (2, 16) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    y.square().mean().backward()
    for key, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), key
    assert any(p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)

    sd = model.state_dict()
    torch.manual_seed(1)
    other = build().train()
    assert any(not torch.equal(a, b) for a, b in zip(sd.values(), other.state_dict().values()))
    other.load_state_dict(sd, strict=True)
    back = other.state_dict()
    assert list(back) == list(sd)
    for key in sd:
        assert back[key].dtype == sd[key].dtype and torch.equal(back[key], sd[key]), key
    outs = []
    for m in (model, other):
        torch.manual_seed(2)  # same drop-path and masking draws in both
        with torch.no_grad():
            outs.append(m(x))  # (2, 16)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["r100", "r200", "vit_b"])
def test_deep_models_full_size_forward(name: str) -> None:
    """Full-size forward (no backward: too slow on a shared CPU). Training mode, because with the official
    init (conv std 0.1) and fresh running statistics an eval-mode forward of a deep untrained IResNet
    overflows, as the official one does."""
    torch.manual_seed(0)
    with torch.no_grad():
        y = get_model(name, num_features=64).train()(torch.randn(2, 3, 112, 112))  # (2, 64)
    assert y.shape == (2, 64)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", sorted(IRESNET_BLOCKS) + ["tiny"])
def test_iresnet_embedding_scale_is_frozen(name: str) -> None:
    """The embedding BN's scale is frozen at 1, as in the official IResNets."""
    assert not meta_model(name).features.weight.requires_grad
    if name == "tiny":
        assert torch.equal(get_model("tiny", num_features=64).features.weight, torch.ones(64))


def test_other_input_size() -> None:
    model = get_model("tiny", widths=(4, 8, 8, 16), num_features=8, input_size=128).eval()
    assert model(torch.randn(1, 3, 128, 128)).shape == (1, 8)


# ----------------------------------------------------------------------------------------------------
# Official layout and computation order
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(IRESNET_BLOCKS))
def test_iresnet_state_dict_matches_official_layout(name: str) -> None:
    model = meta_model(name)  # shapes only: r200 and r2060 (1.1 G parameters) cost no memory
    assert _layout(model) == official_iresnet_layout(IRESNET_BLOCKS[name])
    assert tuple(len(getattr(model, f"layer{i}")) for i in range(1, 5)) == IRESNET_BLOCKS[name]


def test_r2060_size() -> None:
    """1030 IR blocks (3 + 128 + 896 + 3): 1,122,301,120 parameters, on the meta device."""
    params = sum(p.numel() for p in meta_model("r2060").parameters())
    assert params == _param_count(official_iresnet_layout(IRESNET_BLOCKS["r2060"])) == 1_122_301_120


@pytest.mark.parametrize("name", sorted(MBF_SETTINGS))
def test_mbf_state_dict_matches_official_layout(name: str) -> None:
    model = meta_model(name)
    assert _layout(model) == official_mbf_layout(*MBF_SETTINGS[name])


def test_mbf_large_layout_literal() -> None:
    """A few official mbf_large keys written out, so that the layout rule above cannot drift with ours:
    a 256-wide stem made of two residual bottlenecks (expanded width 128), 512-wide last stages."""
    layout = dict(official_mbf_layout(*MBF_SETTINGS["mbf_large"]))
    ours = dict(_layout(meta_model("mbf_large")))
    expected = {
        "layers.0.layers.0.weight": (256, 3, 3, 3),
        "layers.1.layers.0.layers.0.layers.0.weight": (128, 256, 1, 1),
        "layers.1.layers.1.layers.1.layers.0.weight": (128, 1, 3, 3),
        "layers.1.layers.1.layers.2.layers.0.weight": (256, 128, 1, 1),
        "layers.2.layers.1.layers.0.weight": (128, 1, 3, 3),
        "layers.3.layers.7.layers.2.layers.1.weight": (256,),
        "layers.4.layers.2.layers.0.weight": (512, 256, 1, 1),
        "layers.5.layers.11.layers.0.layers.0.weight": (256, 512, 1, 1),
        "layers.6.layers.1.layers.0.weight": (512, 1, 3, 3),
        "layers.7.layers.3.layers.2.layers.0.weight": (512, 256, 1, 1),
        "conv_sep.layers.0.weight": (512, 512, 1, 1),
        "features.layers.0.layers.0.weight": (512, 1, 7, 7),
        "features.layers.2.weight": (512, 512),
        "features.layers.3.running_var": (512,),
    }
    for key, shape in expected.items():
        assert layout[key] == shape and ours[key] == shape, key
    assert "layers.3.layers.8.layers.0.layers.0.weight" not in ours  # 8 residual blocks in stage 1: 0..7


@pytest.mark.parametrize("name", sorted(MBF_SETTINGS))
def test_official_mbf_weights_give_official_embeddings(name: str) -> None:
    blocks, scale = MBF_SETTINGS[name]
    torch.manual_seed(1)
    sd = random_official_state_dict(official_mbf_layout(blocks, scale))
    model = get_model(name)
    model.load_state_dict(sd, strict=True)
    model.eval()
    x = torch.randn(2, 3, 112, 112)  # (N, 3, 112, 112)
    with torch.no_grad():
        ours = model(x)  # (2, 512)
        ref = reference_mbf_forward(sd, blocks, x)  # (2, 512)
    assert ref.abs().max() > 1e-2
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


def test_tiny_layout_follows_its_widths() -> None:
    model = get_model("tiny", widths=(4, 8, 8, 16), num_features=32)
    assert _layout(model) == official_iresnet_layout((1, 1, 1, 1), (4, 8, 8, 16), num_features=32)


def test_official_weights_give_official_embeddings() -> None:
    """Random weights in the official layout, loaded strictly, give the reference forward's embeddings."""
    torch.manual_seed(1)
    sd = random_official_state_dict(official_iresnet_layout(IRESNET_BLOCKS["r18"]))
    model = get_model("r18")
    model.load_state_dict(sd, strict=True)
    model.eval()
    x = torch.randn(2, 3, 112, 112)  # (N, 3, 112, 112)
    with torch.no_grad():
        ours = model(x)  # (2, 512)
        ref = reference_iresnet_forward(sd, IRESNET_BLOCKS["r18"], x)  # (2, 512)
    assert ref.abs().max() > 1e-2  # a meaningful comparison, not two vectors of zeros
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
    assert not model.features.weight.requires_grad  # loading keeps the official frozen scale


def test_strict_loading_rejects_missing_and_extra_keys() -> None:
    model = get_model("tiny", widths=(4, 8, 8, 16))
    sd = model.state_dict()
    missing = {k: v for k, v in sd.items() if k != "layer2.0.prelu.weight"}
    with pytest.raises(RuntimeError, match="layer2.0.prelu.weight"):
        model.load_state_dict(missing, strict=True)
    extra = dict(sd, **{"layer1.1.bn1.weight": torch.ones(4)})
    with pytest.raises(RuntimeError, match="layer1.1.bn1.weight"):
        model.load_state_dict(extra, strict=True)


# ----------------------------------------------------------------------------------------------------
# Activation checkpointing
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kwargs", [("tiny", {"widths": (4, 8, 8, 16)}), ("mbf", {}),
                                         ("mbf_large", {}), ("vit_t", {})])
def test_activation_checkpointing_changes_nothing_but_memory(name: str, kwargs: dict) -> None:
    """vit_t also draws drop-path masks inside the checkpointed blocks and masks tokens: the recompute must
    replay the same random draws."""
    torch.manual_seed(0)
    plain = get_model(name, num_features=16, dropout=0.2, activation_checkpointing=False, **kwargs).train()
    ckpt = get_model(name, num_features=16, dropout=0.2, activation_checkpointing=True, **kwargs).train()
    ckpt.load_state_dict(plain.state_dict(), strict=True)
    x = torch.randn(3, 3, 112, 112)
    outs = []
    for model in (plain, ckpt):
        torch.manual_seed(123)  # same dropout mask in both
        y = model(x)  # (3, 16)
        y.square().sum().backward()
        outs.append(y.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for (key, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    # The recompute in backward must not update BatchNorm statistics a second time.
    for (key, b), c in zip(plain.named_buffers(), ckpt.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["tiny", "vit"])
def test_a_checkpointed_backbone_compiles_and_trains_as_eager(name: str) -> None:
    """``compile = True`` with activation checkpointing (the default of vit_b/l/h and r2060): torch.compile traces
    the checkpointed blocks, and one training step gives eager's output, gradients and BatchNorm statistics.
    The backend is aot_eager: dynamo and AOT autograd trace it as for inductor (the failure was dynamo's, before any
    backend), without inductor's C++ for the whole network, which takes minutes on two cores."""
    from backbones.vit import VisionTransformer

    def build(checkpointing: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        if name == "tiny":
            return get_model("tiny", num_features=16, widths=(4, 8, 8, 16), activation_checkpointing=checkpointing)
        return VisionTransformer(32, 2, 8, num_features=16, activation_checkpointing=checkpointing)

    x = torch.randn(3, 3, 112, 112, generator=torch.Generator().manual_seed(1))
    runs = []
    for model, compiled in ((build(False), False), (build(True), True)):
        step = torch.compile(model, backend="aot_eager") if compiled else model
        y = step(x)  # (3, 16)
        y.square().sum().backward()
        runs.append((y.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None},
                     {k: b.clone() for k, b in model.named_buffers()}))
    (y0, g0, b0), (y1, g1, b1) = runs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and g0
    for key in g0:
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    for key in b0:  # the recompute in the compiled backward updates no statistics a second time
        torch.testing.assert_close(b1[key], b0[key], rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", sorted(CONTRACT_NAMES))
def test_activation_checkpointing_default_is_the_official_one(name: str) -> None:
    """The official r2060, vit_b, vit_b_dp005_mask_005, vit_l_dp005_mask_005 and vit_h always recompute
    in training; the others never do. The argument overrides the default (r2060 is left out of that
    check only because building it takes ~3 s: its builder is r200's with other block counts)."""
    official = name in {"r2060", "vit_b", "vit_b_dp005_mask_005", "vit_l_dp005_mask_005", "vit_h"}
    assert meta_model(name).activation_checkpointing is official
    if name != "r2060":
        with torch.device("meta"):
            assert get_model(name, activation_checkpointing=not official).activation_checkpointing is not official


def test_activation_checkpointing_is_off_in_eval() -> None:
    model = get_model("tiny", widths=(4, 8, 8, 16), activation_checkpointing=True).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 112, 112)).shape == (1, 512)


# ----------------------------------------------------------------------------------------------------
# Parameters and multiply-adds
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,published_gmacs", [("r50", 6.3), ("r100", 12.1)])
def test_macs_match_published_figures(name: str, published_gmacs: float) -> None:
    with torch.device("meta"):
        model = get_model(name)
    params, macs = count_flops(model, 112)
    assert abs(macs / 1e9 - published_gmacs) / published_gmacs < 0.05, macs
    assert params == _param_count(official_iresnet_layout(IRESNET_BLOCKS[name]))


def _param_count(layout: list[tuple[str, tuple[int, ...]]]) -> int:
    """Elements of the parameters (not the BN buffers) in a layout."""
    buffers = ("running_mean", "running_var", "num_batches_tracked")
    return sum(int(torch.tensor(s).prod()) for k, s in layout if not k.endswith(buffers))


def test_mbf_size() -> None:
    """insightface's mbf: 2,059,520 parameters (the paper's ~1 M is its 128-d configuration), ~0.44 GMACs;
    mbf_large: 6,314,880 parameters, 1.82 GMACs."""
    params, macs = count_flops(meta_model("mbf"), 112)
    assert params == _param_count(official_mbf_layout()) == 2_059_520
    assert 0.35e9 < macs < 0.55e9, macs
    params, macs = count_flops(meta_model("mbf_large"), 112)
    assert params == _param_count(official_mbf_layout(*MBF_SETTINGS["mbf_large"])) == 6_314_880
    assert round(macs / 1e9, 2) == 1.82, macs


@pytest.mark.timeout(120)
def test_docs_backbone_table_matches_the_counter() -> None:
    """Every registered backbone has a row in docs/backbones.md whose parameters and GMACs are what
    ``python -m backbones.flops NAME`` prints, to the digits written (r2060's GMACs, which take ~10 s
    to count, are left to the CLI)."""
    section = (ROOT / "docs" / "backbones.md").read_text().split("## The networks", 1)[1].split("\n## ", 1)[0]
    row = re.compile(r"^\| `(\w+)`[^|]*\| ([\d.]+) M \| ([\d.]+) \|", re.M)
    rows = {m[1]: (m[2], m[3]) for m in row.finditer(section)}
    assert sorted(rows) == list_models()
    for name, (params_text, gmacs_text) in rows.items():
        model = meta_model(name)
        params = sum(p.numel() for p in model.parameters())
        decimals = len(params_text.split(".")[1])
        assert f"{params / 1e6:.{decimals}f}" == params_text, (name, params)
        if name != "r2060":
            _, macs = count_flops(model, 112)
            assert f"{macs / 1e9:.2f}" == gmacs_text, (name, macs)


def test_count_flops_on_a_real_model_restores_training_mode() -> None:
    model = get_model("tiny", widths=(4, 8, 8, 16)).train()
    params, macs = count_flops(model, 112)
    assert model.training
    assert params == sum(p.numel() for p in model.parameters())
    # Stem conv alone: 3·4·9 multiply-adds at each of 112² positions.
    assert macs > 3 * 4 * 9 * 112 * 112


@pytest.mark.process
@pytest.mark.timeout(60)
def test_flops_cli_prints_published_r50_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "backbones.flops", "r50"], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("GMACs"))
    gmacs = float(line.split(":")[-1])
    assert abs(gmacs - 6.3) / 6.3 < 0.05, proc.stdout
    assert "GFLOPs (2 per multiply-add" in proc.stdout
    assert "parameters: 43," in proc.stdout
    assert "RuntimeWarning" not in proc.stderr


# ----------------------------------------------------------------------------------------------------
# The embedding tail runs in full precision under autocast
# ----------------------------------------------------------------------------------------------------
# Per family, from the official forwards (what runs after their autocast region ends): the module whose
# output ends the body, a body module whose output autocast makes bf16 (the ViT's residual stream stays
# fp32 because pos_embed is fp32, as in the official model), the tail modules, and the tail recomputed
# from the body's output.
TAILS: dict[type, tuple[Callable, Callable, tuple[str, ...], Callable]] = {
    IResNet: (lambda m: m.dropout, lambda m: m.dropout, ("fc", "features"), lambda m, t: m.features(m.fc(t))),
    MobileFaceNet: (lambda m: m.layers[-1], lambda m: m.layers[-1], ("conv_sep", "features"),
                    lambda m, t: m.features(m.conv_sep(t))),
    VisionTransformer: (lambda m: m.blocks[-1], lambda m: m.blocks[-1].mlp, ("norm", "feature"),
                        lambda m, t: m.feature(m.norm(t).flatten(1))),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list_models())
def test_embedding_tail_is_full_precision_under_autocast(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CPU bfloat16 autocast (a small instance of every name, eval mode): the body runs in bf16,
    every layer of the tail gets float32 inputs with autocast off, the embedding is float32 and equals
    the tail run in fp32 on the body's output, which the tail under autocast would not give. In the ViT,
    attention scores and softmax also run in fp32 (as the official model)."""
    torch.manual_seed(0)
    model = small_instance(name).eval()
    body_end, probe, tail_names, tail = TAILS[type(model)]
    captured: dict[str, torch.Tensor] = {}
    seen: list[tuple[str, torch.dtype, bool]] = []
    body_end(model).register_forward_hook(lambda mod, inp, out: captured.setdefault("body", out))
    probe(model).register_forward_hook(lambda mod, inp, out: captured.setdefault("probe", out))

    def record(key: str) -> Callable:
        return lambda mod, inp: seen.append((key, inp[0].dtype, torch.is_autocast_enabled("cpu")))

    for tail_name in tail_names:
        for key, leaf in getattr(model, tail_name).named_modules(prefix=tail_name):
            if not list(leaf.children()):
                leaf.register_forward_pre_hook(record(key))
    attention: list[tuple[torch.dtype, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        attention.append((q.dtype, torch.is_autocast_enabled("cpu")))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)

    x = torch.randn(2, 3, 112, 112)  # (N, 3, 112, 112)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)  # (2, 16)
    assert captured["probe"].dtype == torch.bfloat16  # autocast did reach the body
    assert y.dtype == torch.float32
    assert seen and all(dtype == torch.float32 and not on for _, dtype, on in seen), seen
    with torch.no_grad():
        ref = tail(model, captured["body"].float())  # (2, 16), fp32, no autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = tail(model, captured["body"])  # the same tail left under autocast: (2, 16)
    assert torch.equal(y, ref)
    assert not torch.equal(low.float(), ref)  # the tail under autocast differs: the check above can fail
    if isinstance(model, VisionTransformer):
        assert attention and all(d == torch.float32 and not on for d, on in attention), attention


def test_full_precision_follows_the_parameter_dtype() -> None:
    """A model converted as a whole keeps working: in float64 the tail computes in float64."""
    model = get_model("tiny", num_features=8, widths=(4, 8, 8, 16)).double().eval()
    with torch.no_grad():
        y = model(torch.randn(1, 3, 112, 112, dtype=torch.float64))
    assert y.dtype == torch.float64


# ---------------------------------------------------------------------------------------- channels-last on the CPU
def test_channels_last_hazards_are_the_narrow_strided_1x1_convolutions() -> None:
    from backbones.memory_format import cpu_channels_last_hazards

    narrow = cpu_channels_last_hazards(get_model("tiny", num_features=32, widths=(8, 16, 16, 32)))
    assert narrow == ["layer1.0.downsample.0 (8 -> 8, 1x1, stride 2)", "layer2.0.downsample.0 (8 -> 16, 1x1, stride 2)"]
    assert cpu_channels_last_hazards(get_model("tiny", num_features=32, widths=(16, 16, 16, 32))) == []
    assert cpu_channels_last_hazards(get_model("r18", num_features=32)) == []
    assert cpu_channels_last_hazards(get_model("mbf", num_features=32)) == []


def test_channels_last_check_refuses_the_cpu_only() -> None:
    from backbones.memory_format import check_channels_last

    model = get_model("tiny", num_features=32, widths=(8, 16, 16, 32))
    with pytest.raises(ValueError, match=r"network 'tiny'.*layer1\.0\.downsample\.0 \(8 -> 8.*channels_last = False"):
        check_channels_last(model, torch.device("cpu"), "tiny")
    check_channels_last(model, torch.device("cuda"), "tiny")  # other kernels there: allowed (nothing allocated)
    check_channels_last(get_model("tiny", num_features=32, widths=(16, 16, 16, 32)), torch.device("cpu"), "tiny")


def test_the_networks_are_built_of_torch_s_own_layers() -> None:
    """Every convolution and PReLU of every registered network is torch's own class: one implementation on every
    device, and exactly what the official files' modules are."""
    for name in list_models():
        with torch.device("meta"):  # the modules' types only: no memory for the weights of r2060 or vit_h
            model = get_model(name, num_features=32)
        kinds = {type(m) for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.PReLU))}
        assert kinds <= {torch.nn.Conv2d, torch.nn.PReLU}, (name, kinds)
