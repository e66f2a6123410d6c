"""Which backbones may train in channels-last memory format on the CPU.

oneDNN's x64 kernel for the weight gradient of a strided 1x1 convolution (the IResNet downsample shortcut) writes
past its workspace when the input is channels-last and has fewer input channels than the kernel's channel block
(16 with AVX-512, 8 with AVX2): a crash, or a corrupted heap and wrong gradients (oneDNN issue 6035). Contiguous
tensors and CUDA take other kernels. Full-size backbones have 64 or more channels there; only narrow ``tiny``
networks meet it, and inductor lays CPU convolutions out channels-last by itself. The refusal names the strided 1x1
convolutions, which also covers the narrow 3x3 case: docs/backbones.md#memory-format-and-compilation.
"""
from __future__ import annotations

import torch
from torch import nn

# The largest input-channel block of oneDNN's x64 1x1 convolution kernels (AVX-512): below it, the bug.
SAFE_IN_CHANNELS = 16


def cpu_channels_last_hazards(model: nn.Module) -> list[str]:
    """Names of the convolutions whose weight gradient oneDNN computes wrongly in channels-last on the CPU:
    1x1 kernel, a stride above 1, one group, fewer than ``SAFE_IN_CHANNELS`` input channels."""
    return [f"{name} ({m.in_channels} -> {m.out_channels}, 1x1, stride {m.stride[0]})"
            for name, m in model.named_modules()
            if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and m.stride != (1, 1) and m.groups == 1
            and m.in_channels < SAFE_IN_CHANNELS]


def check_channels_last(model: nn.Module, device: torch.device, network: str, *,
                        setting: str = "channels_last = True", remedy: str = "set channels_last = False "
                        "(no effect on results)") -> None:
    """Raise ``ValueError`` naming the convolutions when training ``model`` channels-last on ``device`` would
    meet the oneDNN bug above; nothing on CUDA or for backbones without such a convolution. ``setting`` is the
    config choice that lays the convolutions out channels-last, ``remedy`` what avoids it."""
    if device.type != "cpu":
        return
    hazards = cpu_channels_last_hazards(model)
    if hazards:
        raise ValueError(
            f"{setting} on the CPU with network {network!r}: its convolution(s) {', '.join(hazards)} have fewer "
            f"than {SAFE_IN_CHANNELS} input channels, and oneDNN's CPU kernel for their weight gradient in "
            f"channels-last format writes out of bounds (a crash or wrong gradients); {remedy}, or give those "
            f"stages {SAFE_IN_CHANNELS} or more channels")
