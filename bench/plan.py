"""Predicted Partial FC head memory per GPU (or per CPU rank), from the implementation's allocations.

    python bench/plan.py --num-classes 29000000 --gpus 8 --sample-rate 0.1 --embedding-size 512 \\
        --batch-size 128 [--optimizer sgd|adamw] [--dtype fp32|bf16|fp16] [--device cuda|cpu] [--compile-head] \\
        [--json PATH]

``predict`` follows what ``partial_fc/`` allocates in one training step of the eager head (``--compile-head``: the
buffers the compiled graphs add), ``head_update = "sampled"``, a target-only margin (``MarginSoftmax``, whose logits
are never stored), on rank 0 (the largest shard): ``L = num_local``, ``C`` the sampled rows, ``N = batch_size ·
gpus`` the gathered batch, fp32 weights, ``--dtype`` the step's autocast. Each phase (sampling, forward, backward,
optimizer) adds its tensors to the persistent weight and optimizer state; the peak is the largest phase.
``tests/test_bench.py`` holds it to ``bench/head.py``'s measured peak on the CPU, ``make gpu-check`` on a GPU. Every
tensor the plan counts, phase by phase: bench/README.md#head-memory-plan.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, write_json
from partial_fc import class_partition, sample_size

FP32, HALF, INT64 = 4, 2, 8
OPTIMIZERS = ("sgd", "adamw")
DTYPES = ("fp32", "bf16", "fp16")  # the autocast dtype of the step (fp32: none); bf16 and fp16 allocate alike
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Plan:
    """Bytes per rank by component, the phase totals and the peak."""

    components: dict[str, int]
    phases: dict[str, int]
    peak_bytes: int
    shard_bytes: int
    num_local: int
    num_sampled: int

    def as_dict(self) -> dict[str, Any]:
        return {"components": self.components, "phases": self.phases, "peak_bytes": self.peak_bytes,
                "shard_bytes": self.shard_bytes, "peak_over_shard": self.peak_bytes / self.shard_bytes,
                "num_local": self.num_local, "num_sampled": self.num_sampled}


def predict(num_classes: int, world_size: int, sample_rate: float, embedding_size: int, batch_size: int,
            optimizer: str = "sgd", dtype: str = "fp32", device: str = "cuda", compile_head: bool = False) -> Plan:
    """Predicted head memory of rank 0 (the largest shard); ``batch_size`` is per rank, ``dtype`` the autocast dtype
    of the step (``fp32``: none), ``device`` ``cuda`` or ``cpu`` (the CPU's fp16 casts through one more fp32
    ``(C, D)`` temporary), ``compile_head`` the head with ``compile = True`` (its compiled graphs' ``(N, C)``
    buffers)."""
    if optimizer not in OPTIMIZERS or dtype not in DTYPES or device not in DEVICES:
        raise ValueError(f"bench/plan.py: optimizer={optimizer!r} dtype={dtype!r} device={device!r}; expected "
                         f"{'|'.join(OPTIMIZERS)}, {'|'.join(DTYPES)} and {'|'.join(DEVICES)}")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"bench/plan.py: sample_rate={sample_rate} must be in (0, 1]")
    _, L = class_partition(num_classes, world_size, 0)
    D, B = embedding_size, batch_size
    N = B * world_size
    sampled = sample_rate < 1.0
    C = sample_size(L, sample_rate, min(N, L))  # at most: every sample of the global batch a positive here
    half = dtype != "fp32"
    weights = L * D * FP32
    state = L * D * FP32 if optimizer == "sgd" else 2 * L * D * FP32 + L * FP32
    rows = C * D * FP32 if sampled else 0  # the gathered rows (fp32: later the sparse gradient's values)
    # The weight gradient beside the rows: a fresh (L, D) at R = 1, and a fresh (C, D) beside the rows in bf16/fp16.
    grad = 0 if sampled and not half else C * D * FP32
    block = N * C * FP32  # one (N, C) fp32 tensor
    half_block = N * C * HALF if half else 0  # the product before its fp32 copy; the backward's left operand
    # Half copies: the rows (fp16: the unit rows), the weight gradient's product before its fp32 copy, the embeddings.
    half_rows, half_emb = (C * D * HALF, N * D * HALF) if half else (0, 0)
    cast_tmp = C * D * FP32 if dtype == "fp16" and device == "cpu" else 0  # the unit rows in fp32 before the cast
    comm = 3 * N * D * FP32 + B * D * FP32
    vectors = 4 * C * FP32  # per row: 1/|w| and its mask, then Σ_b g⊙cos and the weight gradient's coefficient
    sampling = (4 * L * INT64 + 3 * C * INT64) if sampled else 0
    grad_rows = C * D * FP32  # the gradient the optimizer reads (at R = 1, C = L)
    if optimizer == "sgd":
        opt_work = C * D * FP32 if sampled else 0
    else:
        opt_work = (4 * C * D + 2 * C) * FP32 if sampled else L * D * FP32
    persistent = weights + state
    # forward: the cosines and the exponentials; in bf16/fp16 the product and its fp32 copy (1.5 blocks) come first.
    forward = max(2 * block, half_block + block, half_block + half_rows + half_emb)
    if half:  # backward: the two blocks and the left operand, then the left operand and the weight gradient's product
        backward = max(2 * block + half_block + half_rows + cast_tmp, half_block + 2 * half_rows + half_emb + grad)
    else:  # backward: the two blocks, then G (over the cosines) beside the weight gradient
        backward = max(2 * block, block + grad)
    compiled = 2 * block if compile_head else 0  # the compiled graphs' (N, C) buffers beside the two blocks
    forward, backward = max(forward, 2 * block + compiled), max(backward, 2 * block + compiled // 2)
    phases = {
        "sampling": persistent + sampling,
        "forward": persistent + rows + comm + vectors + forward,
        "backward": persistent + rows + comm + vectors + backward,
        "optimizer": persistent + grad_rows + opt_work,
    }
    components = {
        "weights": weights, "optimizer_state": state, "sampled_rows_and_grad": rows + grad,
        "logits_and_grad": 2 * block + half_block, "half_copies": 2 * half_rows + half_emb + cast_tmp,
        "communication": comm, "row_vectors": vectors, "sampling_index": sampling, "optimizer_work": opt_work,
        "compiled_buffers": compiled,
    }
    peak = max(phases.values())
    return Plan(components, phases, peak, L * D * FP32, L, C)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-classes", type=int, required=True)
    parser.add_argument("--gpus", type=int, required=True, help="ranks (world size)")
    parser.add_argument("--sample-rate", type=float, default=1.0)
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=128, help="per rank")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="autocast dtype of the step (the trainer's fp16/bf16 keys); fp32: none")
    parser.add_argument("--device", choices=DEVICES, default="cuda",
                        help="cpu: a rank on the CPU, whose fp16 casts through one more fp32 temporary")
    parser.add_argument("--compile-head", action="store_true", help="the head with compile_head = True")
    parser.add_argument("--json", help="write the prediction here")
    args = parser.parse_args(argv)
    plan = predict(args.num_classes, args.gpus, args.sample_rate, args.embedding_size, args.batch_size,
                   args.optimizer, args.dtype, args.device, args.compile_head)
    gib = float(1 << 30)
    rows = [[name, f"{value / gib:.3f}"] for name, value in plan.components.items()]
    rows += [[f"phase: {name}", f"{value / gib:.3f}"] for name, value in plan.phases.items()]
    rows += [["**peak**", f"**{plan.peak_bytes / gib:.3f}**"],
             ["fp32 shard", f"{plan.shard_bytes / gib:.3f} ({plan.num_local} rows, {plan.num_sampled} sampled)"],
             ["peak / shard", f"{plan.peak_bytes / plan.shard_bytes:.2f}"]]
    print(markdown_table(["component (rank 0)", "GiB"], rows))
    write_json(args.json, {"config": vars(args), "plan": plan.as_dict()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
