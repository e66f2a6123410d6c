"""Predicted Partial FC head memory per GPU (or per CPU rank), from the implementation's allocations.

    python bench/plan.py --num-classes 29000000 --gpus 8 --sample-rate 0.1 --embedding-size 512 \
        --batch-size 128 [--optimizer sgd|adamw] [--dtype fp32|bf16] [--json PATH]

The model follows what ``partial_fc/`` allocates in one training step on
the rank with the largest shard (rank 0), with ``L = num_local``, ``C = sampled rows`` (``L`` at
``sample_rate = 1``), ``N = batch_size · gpus`` (the gathered batch) and fp32 weights:

* persistent: ``weight (L, D)``; optimizer state (SGD ``momentum_buffer (L, D)``; AdamW ``exp_avg``,
  ``exp_avg_sq (L, D)`` and ``step (L,)``). Nothing else is kept between steps.
* sampling (``sample_rate < 1``, before the products): class ids, their hash keys and two temporaries of
  the hash ``(L,)`` int64, the top-k values and indices and the sorted index ``(C,)`` int64.
* forward: the gathered rows ``(C, D)`` (at ``sample_rate = 1`` the weight itself) and the cosines
  ``(N, C)`` fp32; the margin (ArcFace, CosFace, ``CombinedMarginLoss`` without inter-class filtering) and
  the cross-entropy are fused into them (``partial_fc.functions.MarginSoftmax``), so the logits are never stored; their
  exponentials ``(N, C)`` are kept for the backward (with ``compile_head`` too). Under bf16 autocast the products
  add bf16 copies (rows ``(C, D)``, embeddings, the product ``(N, C)``).
* backward: the same two ``(N, C)`` tensors while ``g = ∂L/∂cos`` (over the exponentials) and its sums are
  formed; then only ``G`` (over the cosines; bf16 adds its ``(N, C)`` copy) is kept for the products, and the
  weight gradient is written over the gathered rows (sampled, fp32), or is a fresh ``(L, D)`` (dense) or
  ``(C, D)`` (bf16) tensor that lives until the optimizer has used it.
* optimizer: the gradient is alive; SGD's sampled update gathers the rows' weights and then their momentum into
  one ``(C, D)`` work tensor (its decay term is written over the gradient), a dense update nothing; AdamW's
  sampled update gathers the rows of the weight and both moments and one ``(C, D)`` temporary, a dense update one
  ``(L, D)`` temporary.
* communication: the gathered embeddings ``(N, D)`` and their normalised copy, the embedding gradient
  ``(N, D)`` and the reduce-scatter output ``(B, D)``.

The peak is the largest of the forward, backward and optimizer phases. ``tests/test_bench.py`` checks
it against ``bench/head.py``'s measured peak (RSS growth) on small CPU runs.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, write_json  # noqa: E402
from partial_fc import class_partition, sample_size  # noqa: E402

FP32, BF16, INT64 = 4, 2, 8


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
            optimizer: str = "sgd", dtype: str = "fp32") -> Plan:
    """Predicted head memory of rank 0 (the largest shard); ``batch_size`` is per rank."""
    if optimizer not in ("sgd", "adamw") or dtype not in ("fp32", "bf16"):
        raise ValueError(f"bench/plan.py: optimizer={optimizer!r} dtype={dtype!r}; expected sgd|adamw and fp32|bf16")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"bench/plan.py: sample_rate={sample_rate} must be in (0, 1]")
    _, L = class_partition(num_classes, world_size, 0)
    D, B = embedding_size, batch_size
    N = B * world_size
    sampled = sample_rate < 1.0
    C = sample_size(L, sample_rate, min(N, L))  # at most: every sample of the global batch a positive here
    bf16 = dtype == "bf16"
    weights = L * D * FP32
    state = L * D * FP32 if optimizer == "sgd" else 2 * L * D * FP32 + L * FP32
    rows = C * D * FP32 if sampled else 0  # the gathered rows, later the sparse gradient's values
    # The weight gradient beside the rows: dense (L, D), or fresh fp32 values under bf16 (+ bf16 operands).
    grad = 0 if sampled and not bf16 else (L if not sampled else C) * D * FP32
    bf16_operands = (C * D + N * D) * BF16 if bf16 else 0
    block = N * C * FP32  # one (N, C) fp32 tensor
    logits_fwd = 2 * block + (N * C * BF16 if bf16 else 0)  # cosines, exponentials (+ the bf16 product)
    logits_bwd = block + (N * C * BF16 if bf16 else 0)  # G over the cosines (+ its bf16 copy) for the products
    comm = 3 * N * D * FP32 + B * D * FP32
    sampling = (4 * L * INT64 + 3 * C * INT64) if sampled else 0
    grad_rows = C * D * FP32 if sampled else L * D * FP32  # the gradient the optimizer reads
    if optimizer == "sgd":
        opt_work = C * D * FP32 if sampled else 0
    else:
        opt_work = (4 * C * D + 2 * C) * FP32 if sampled else L * D * FP32
    persistent = weights + state
    phases = {
        "sampling": persistent + sampling,
        "forward": persistent + rows + bf16_operands + logits_fwd + comm,
        "backward": persistent + rows + comm + max(2 * block, bf16_operands + grad + logits_bwd),
        "optimizer": persistent + grad_rows + opt_work,
    }
    components = {
        "weights": weights, "optimizer_state": state, "sampled_rows_and_grad": rows + grad + bf16_operands,
        "logits_and_grad": max(logits_fwd, logits_bwd), "communication": comm, "sampling_index": sampling,
        "optimizer_work": opt_work,
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
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="autocast dtype of the products")
    parser.add_argument("--json", help="write the prediction here")
    args = parser.parse_args(argv)
    plan = predict(args.num_classes, args.gpus, args.sample_rate, args.embedding_size, args.batch_size,
                   args.optimizer, args.dtype)
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
