"""Precision: the autocast context, TF32, and the dynamic loss scale of fp16 training.

The trainer runs the backbone's body under ``torch.autocast`` in its dtype (bf16 or fp16); the models hold no
precision flag, and which part runs in which dtype is the table in docs/partial_fc.md#precision. ``LossScaler``
replaces ``torch.amp.GradScaler`` because the trainer makes one skip-or-step decision for both optimizers on every
rank (``nonfinite_parts``), where GradScaler decides for each optimizer alone; its scale rule and its state_dict
keys are GradScaler's, so checkpoints of either load into the other (docs/partial_fc.md#one-decision-per-step).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from utils.distributed import all_reduce, to_host

__all__ = ["AUTOCAST_DTYPES", "AutocastModule", "LossScaler", "NonFiniteLossError", "autocast", "configure_cuda",
           "cpu_computes_bf16", "nonfinite_parts"]

# The precisions the evaluation tools accept (``--precision``) and the autocast dtype of each (None: fp32).
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast(device.type, dtype)``, or a context that changes nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class AutocastModule(torch.nn.Module):
    """``module`` whose forward runs under ``autocast(its device, dtype)``: a backbone evaluated in the precision
    it was trained in (the evaluation tools' ``--precision``, the trainer's verification during a bf16/fp16
    run). The backbones keep their embedding layers in fp32 either way (``backbones.precision``)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        with autocast(x.device, self.dtype):
            return self.module(x)


# CPU features that compute bfloat16 in hardware: x86 AVX512-BF16 and AMX-BF16, Arm BF16 (NEON and SVE).
_BF16_FEATURES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")


def cpu_computes_bf16(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 in hardware, so that bf16 autocast makes a CPU run faster (on other
    CPUs oneDNN emulates bf16 or falls back to slow kernels: fp32 is the better choice there).

    Reads ``torch.cpu.get_capabilities()`` where torch has it, else the flags of ``cpuinfo`` (Linux); False
    when neither says."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        found = capabilities()
        return any(bool(found.get(feature, False)) for feature in _BF16_FEATURES)
    try:
        words = set(Path(cpuinfo).read_text().split())
    except OSError:
        return False
    return any(feature in words for feature in _BF16_FEATURES)


def configure_cuda(device: torch.device, tf32: bool, cudnn_benchmark: bool) -> None:
    """On CUDA: let fp32 matrix products and convolutions use TF32 tensor cores (``tf32``) or forbid it, and
    let cuDNN time its convolution algorithms on the first batches and keep the fastest per shape
    (``cudnn_benchmark``) or use its heuristics.

    Process-wide torch settings; on the CPU they change nothing, and are left alone.
    """
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark


class LossScaler:
    """Dynamic loss scaling for fp16 (disabled: the scale is 1 and nothing changes).

    The loss is multiplied by ``scale`` before backward so that small fp16 gradients do not flush to zero;
    the trainer divides the gradients by it before the update. After each step the trainer calls
    ``update(skipped)``: a skipped step (non-finite gradients anywhere) multiplies the scale by
    ``backoff_factor`` once, and ``growth_interval`` good steps in a row multiply it by ``growth_factor``.
    The defaults are GradScaler's, except ``growth_interval = 100`` (GradScaler: 2000), the value the
    reference trainer uses for this workload.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 100) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"LossScaler: init_scale={init_scale} growth_factor={growth_factor} backoff_factor="
                             f"{backoff_factor} growth_interval={growth_interval}; need init_scale > 0, "
                             f"growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0  # good steps in a row since the last change of scale

    def is_enabled(self) -> bool:
        return self.enabled

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss · scale`` (``loss`` itself when disabled)."""
        return loss * self.scale if self.enabled else loss

    def update(self, skipped: bool) -> None:
        """Back off after a skipped step; grow after ``growth_interval`` good steps in a row."""
        if not self.enabled:
            return
        if skipped:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys; ``{}`` when disabled (as GradScaler)."""
        if not self.enabled:
            return {}
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` (ours or GradScaler's). An empty state (saved while disabled) leaves the
        initial scale; a disabled scaler ignores the state."""
        if not self.enabled or not state:
            return
        missing = [k for k in ("scale", "_growth_tracker") if k not in state]
        if missing:
            raise ValueError(f"LossScaler.load_state_dict: keys {missing} missing from {sorted(state)}")
        scale = state["scale"]
        self.scale = float(scale.item() if isinstance(scale, Tensor) else scale)
        tracker = state["_growth_tracker"]
        self.growth_tracker = int(tracker.item() if isinstance(tracker, Tensor) else tracker)
        for key in ("growth_factor", "backoff_factor", "growth_interval"):
            if key in state:
                setattr(self, key, type(getattr(self, key))(state[key]))


class NonFiniteLossError(RuntimeError):
    """``max_nonfinite_steps`` optimizer steps in a row were skipped for non-finite values: the job stops."""

    def __init__(self, in_row: int, step: int, checkpoints: object) -> None:
        super().__init__(f"the loss or the gradients were not finite for {in_row} optimizer steps in a row (up to "
                         f"step {step}); stopping. Weights were not updated on those steps and the newest complete "
                         f"checkpoint in {checkpoints} is intact. Lower `lr`, check the data, or use fp16/bf16 "
                         f"with care")


def nonfinite_parts(loss: Tensor, backbone_grads: list[Tensor], head_grad: Tensor | None,
                    bad_samples: int = 0, short_batch: bool = False) -> tuple[list[str], Tensor, bool, bool]:
    """One decision for both optimizers on every rank: which of the loss, the backbone's gradients and this rank's
    head gradient (dense, or the values of a sparse one) are not finite on any rank, whether a rank's loader left
    out a sample it could not read (``bad_samples`` here), and whether a rank's batch was too small to train on
    (``short_batch`` here).

    Returns ``(names of the non-finite parts, [] when all are finite; the backbone's gradient norm; a sample left
    out; a batch too small)``. The head's gradients and the batches are each rank's own, so the flags are
    all-reduced (MAX): every rank skips or steps, or stops, together. Reading them is the one host-device
    synchronisation of the trainer's step.
    """
    norm = torch.nn.utils.get_total_norm(backbone_grads) if backbone_grads else loss.new_zeros(())  # ()
    head = head_grad.sum() if head_grad is not None else loss.new_zeros(())  # () non-finite iff an entry is
    flags = (~torch.isfinite(torch.stack([loss.float(), norm.float(), head.float()]))).float()  # (3,)
    # Filled on the device (new_full), not copied from a host list, which would wait for the queued kernels.
    flags = torch.cat([flags, flags.new_full((1,), float(bad_samples > 0)), flags.new_full((1,), float(short_batch))])
    bad = to_host(all_reduce(flags, dist.ReduceOp.MAX))
    return ([name for name, b in zip(("loss", "backbone gradients", "head gradients"), bad) if b], norm, bool(bad[3]),
            bool(bad[4]))
