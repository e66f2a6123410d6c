"""Predicted Partial FC head memory per GPU (or per CPU rank), from the implementation's allocations.

    python bench/plan.py --num-classes 29000000 --gpus 8 --sample-rate 0.1 --embedding-size 512 \
        --batch-size 128 [--optimizer sgd|adamw] [--dtype fp32|bf16|fp16] [--device cuda|cpu] [--compile-head] \
        [--json PATH]

The model follows what ``partial_fc/`` allocates in one training step of the eager head (``compile_head =
False``; ``--compile-head``: the last item below), ``head_update = "sampled"``, with a target-only margin (ArcFace,
CosFace, ``CombinedMarginLoss`` without inter-class filtering: ``partial_fc.functions.MarginSoftmax``, whose logits
are never stored) on the rank with the largest shard (rank 0), with ``L = num_local``, ``C = sampled rows`` (``L``
at ``sample_rate = 1``), ``N = batch_size · gpus`` (the gathered batch), fp32 weights, and ``--dtype`` the step's
autocast dtype (``fp32``: none; the head's products then take bf16 or fp16 operands, which are 2 bytes either way,
so bf16 and fp16 allocate alike):

* persistent: ``weight (L, D)``; optimizer state (SGD ``momentum_buffer (L, D)``; AdamW ``exp_avg``,
  ``exp_avg_sq (L, D)`` and ``step (L,)``). Nothing else is kept between steps.
* sampling (``sample_rate < 1``, before the products): class ids, their hash keys and two temporaries of
  the hash ``(L,)`` int64, the top-k values and indices and the sorted index ``(C,)`` int64.
* forward: the gathered rows ``(C, D)`` fp32 (at ``sample_rate = 1`` the weight itself), up to four ``(C,)`` fp32
  vectors (the centres' inverse norms and their mask; in the backward ``Σ_b g⊙cos`` and the weight gradient's
  coefficient), then two ``(N, C)`` fp32 tensors: the cosines and their exponentials, kept for the backward. In
  bf16/fp16 the product is first an ``(N, C)`` half tensor, copied to the fp32 cosines (1.5 blocks; the half
  copies of the rows and embeddings are freed when the product returns).
* backward, fp32: the two ``(N, C)`` tensors while ``g = ∂L/∂cos`` (over the exponentials) and its sums are formed;
  then the exponentials are released and ``G`` (over the cosines) is the one ``(N, C)`` tensor left for the products.
  The weight gradient is written over the gathered rows (sampled), or is a fresh ``(L, D)`` tensor (``sample_rate =
  1``) that lives until the optimizer has used it.
* backward, bf16/fp16: the products' left operand, an ``(N, C)`` half tensor (bf16 ``G``, fp16 ``g``), and their
  right one, a ``(C, D)`` half copy of the rows (fp16: of the unit rows), are made while both fp32 ``(N, C)``
  tensors are alive: 2.5 blocks. On the CPU fp16's unit rows are computed in an fp32 ``(C, D)`` temporary first
  (PyTorch's CPU kernels cast a result to an output of another dtype through a temporary; CUDA's cast in the kernel:
  ``--device cpu``). Then both fp32 blocks are released, and the weight gradient's product is a ``(C, D)`` half
  tensor copied to a fresh ``(C, D)`` fp32 gradient (beside the gathered rows, which the backward still holds), with
  the left and right operands and the embeddings' half copy ``(N, D)`` alive.
* optimizer: the gradient is alive; SGD's sampled update gathers the rows' weights and then their momentum into
  one ``(C, D)`` work tensor (its decay term is written over the gradient), a dense update nothing; AdamW's
  sampled update gathers the rows of the weight and both moments and one ``(C, D)`` temporary, a dense update one
  ``(L, D)`` temporary.
* communication: the gathered embeddings ``(N, D)`` and their normalised copy, the embedding gradient
  ``(N, D)`` and the reduce-scatter output ``(B, D)``.
* ``--compile-head`` (config ``compile_head``): Inductor's graph of ``softmax_statistics`` materialises the logits
  and their scattered copy as two ``(N, C)`` fp32 buffers beside the cosines and the exponentials while it runs
  (4 blocks), and that of ``softmax_gradient`` one ``(N, C)`` buffer beside both (3 blocks).

The peak is the largest of the sampling, forward, backward and optimizer phases. ``tests/test_bench.py`` checks it
against ``bench/head.py``'s measured peak (RSS growth, ``--dtype`` for the autocast dtype) on small CPU runs: fp32
within 5 %, bf16 and fp16 within 10 % (three shapes); ``make gpu-check`` checks the eager and the compiled head on a
GPU (docs/gpu_check.md).
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
    of the step (``fp32``: none), ``device`` ``cuda`` or ``cpu`` (the CPU's fp16 adds one temporary, see above),
    ``compile_head`` the head with ``compile = True`` (its compiled graphs' buffers, see above)."""
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
