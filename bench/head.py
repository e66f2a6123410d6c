"""Partial FC head step against its floor: the three matrix products no implementation can avoid.

    python bench/head.py --num-classes 1000000 --sample-rate 0.1 --world-size 2 --batch-size 128 \\
        --embedding-size 512 --threads 1 [--optimizer sgd|adamw] [--update sampled|all] [--compile] \\
        [--dtype fp32|bf16|fp16] [--no-huge-pages] [--device cpu|cuda] [--json PATH]

Spawns ``--world-size`` ranks (gloo on CPU, NCCL on CUDA); each builds the head as ``train.py`` does (``PartialFC``
+ ``build_head_optimizer``) and times one step (forward under the ``--dtype`` autocast, backward, optimizer,
``zero_grad``) alternately with the FLOOR, ``logits = E_global @ W_sᵀ``, ``∂E = G @ W_s``, ``∂W = Gᵀ @ E_global``
at the step's shapes and dtype. ``ratio = step_s / floor_s``, each repeat counting its slowest rank's step and
floor (the ranks run in lockstep). With ``--compile`` the head with ``compile_head`` is timed beside the eager one. Peak
memory per rank is the growth of the resident set (CUDA: allocated bytes) from just before a head is built,
against the fp32 shard. What each figure means, and the figures: bench/README.md#classification-head-partial-fc.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import Timing, current_rss_bytes, markdown_table, peak_rss_bytes, time_call, write_json
from bench.local_ranks import run_on_local_ranks
from utils.distributed import barrier
from utils.precision import AUTOCAST_DTYPES, autocast


@dataclass(frozen=True)
class HeadConfig:
    """One benchmark case; ``batch_size`` is per rank."""

    num_classes: int
    sample_rate: float
    batch_size: int
    embedding_size: int = 512
    optimizer: str = "sgd"
    update: str = "sampled"  # the head's update mode (PartialFC `update`, config `head_update`)
    dtype: str = "fp32"  # the step's autocast dtype: fp32 (none), bf16 or fp16 (utils.precision.AUTOCAST_DTYPES)
    device: str = "cpu"
    threads: int = 1
    repeats: int = 5
    warmup: int = 1
    floor: bool = True
    compile: bool = False  # also time the head with compile = True
    huge_pages: bool = True  # THP_MEM_ALLOC_ENABLE=1 for the ranks
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"HeadConfig: dtype={self.dtype!r}; expected one of {tuple(AUTOCAST_DTYPES)}")


class PeakMemory:
    """High-water mark of this process's memory growth since ``start()``, in bytes.

    CPU: resident set size. Linux's ``VmHWM`` is reset by writing ``5`` to ``/proc/self/clear_refs``;
    where that is not allowed, the lifetime peak (``ru_maxrss``) is used, which is right as long as
    nothing before ``start()`` used more memory than the measured code (true in a fresh benchmark
    process). CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0
        self.hwm_reset = False

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            return
        self.baseline = current_rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False  # peak() falls back to the lifetime peak, see the class docstring

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return (_vm_hwm_bytes() if self.hwm_reset else peak_rss_bytes()) - self.baseline


def _vm_hwm_bytes() -> int:
    """``VmHWM`` (peak resident set since the last reset) from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise ValueError("bench/head.py: /proc/self/status has no VmHWM line")


@contextmanager
def measure_peak(device: torch.device) -> Iterator[PeakMemory]:
    """``with measure_peak(dev) as m: ...`` then ``m.peak()``: memory growth high-water mark inside the block."""
    meter = PeakMemory(device)
    meter.start()
    yield meter


def head_rank(rank: int, world_size: int, cfg: HeadConfig) -> dict[str, Any]:
    """Time the head step (and its floor) on this rank of an initialised process group; returns figures.

    Keys: ``step`` and ``floor`` (Timing dicts, seconds), ``step_samples`` and ``floor_samples`` (each repeat's
    seconds), ``peak_mem_bytes``, ``shard_bytes``, ``num_local``, ``num_sampled`` (rows in the step's matrix
    products), ``batch_global``; with ``cfg.compile`` also ``compiled``: the compiled head's ``step``,
    ``step_samples``, ``peak_mem_bytes`` and ``first_step_s`` (the step that compiles).
    """
    from losses import ArcFace
    from partial_fc import PartialFC, build_head_optimizer, class_partition, sample_size

    torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device, rank) if cfg.device == "cuda" else torch.device(cfg.device)
    amp = AUTOCAST_DTYPES[cfg.dtype]  # None: fp32
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(cfg.seed)  # the same per-step sampling seed on every rank, as in training
    gen = torch.Generator().manual_seed(cfg.seed * 1009 + rank)
    D, B = cfg.embedding_size, cfg.batch_size
    # Stand-ins for the backbone's output: a leaf that receives the embedding gradient, fresh labels per step.
    embeddings = torch.randn(B, D, generator=gen).to(device).requires_grad_()  # (B, D)
    label_sets = [torch.randint(0, cfg.num_classes, (B,), generator=gen).to(device) for _ in range(4)]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None

    # One step of a tiny head first: the first optimizer and the first backward load library code (hundreds
    # of MB of RSS, e.g. torch._dynamo via torch.optim) that a trainer has already paid for its backbone; the
    # figure below is the head's own memory.
    tiny = PartialFC(ArcFace(), D, 4 * world_size, cfg.sample_rate, seed=cfg.seed, update=cfg.update, device=device)
    tiny_opt = build_head_optimizer(tiny, cfg.optimizer, lr=0.1, momentum=0.9, weight_decay=5e-4)
    with autocast(device, amp):
        tiny_loss = tiny(embeddings, label_sets[0] % (4 * world_size))
    tiny_loss.backward()
    tiny_opt.step()
    embeddings.grad = None
    del tiny, tiny_opt, tiny_loss

    # The floor's operands are allocated before the peak measurement starts, so they count as baseline.
    _, num_local = class_partition(cfg.num_classes, world_size, rank)
    n = B * world_size
    num_sampled = sample_size(num_local, cfg.sample_rate, min(n, num_local))  # at most: every sample a positive
    if cfg.floor:
        dt = amp or torch.float32  # the products' operand and output dtype in the step
        e = torch.randn(n, D, generator=gen).to(device, dt)  # (B_global, D)
        w = torch.randn(num_sampled, D, generator=gen).to(device, dt)  # (C_s, D)
        g = torch.randn(n, num_sampled, generator=gen).to(device, dt)  # (B_global, C_s)
        logits = torch.empty(n, num_sampled, device=device, dtype=dt)  # (B_global, C_s)
        d_e, d_w = torch.empty_like(e), torch.empty_like(w)

    def floor() -> None:
        torch.mm(e, w.t(), out=logits)  # (B_global, C_s)
        torch.mm(g, w, out=d_e)  # (B_global, D)
        torch.mm(g.t(), e, out=d_w)  # (C_s, D)

    def build_and_warm(compiled: bool) -> tuple[Any, int, float]:
        """(a step function of a new head, its peak memory, its first step's seconds)."""
        with measure_peak(device) as meter:
            head = PartialFC(ArcFace(), D, cfg.num_classes, cfg.sample_rate, seed=cfg.seed, update=cfg.update,
                             compile=compiled, device=device)
            opt = build_head_optimizer(head, cfg.optimizer, lr=0.1, momentum=0.9, weight_decay=5e-4)
            assert head.num_local == num_local, (head.num_local, num_local)
            calls = [0]

            def step() -> None:
                labels = label_sets[calls[0] % len(label_sets)]
                calls[0] += 1
                with autocast(device, amp):  # the forward only, as the trainer's
                    loss = head(embeddings, labels)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                embeddings.grad = None  # the backbone optimizer's zero_grad(set_to_none=True)

            barrier()
            # The peak covers construction and the warm-up steps (at least two: the second is the steady
            # state); the floor's products run after it, so their own work memory is not counted.
            first = time_call(step, repeats=1, warmup=0, sync=sync).median
            for _ in range(max(cfg.warmup, 2) - 1):
                step()
            return step, meter.peak(), first

    steps_of = {"eager": build_and_warm(False)}
    if cfg.compile:
        steps_of["compiled"] = build_and_warm(True)
    if cfg.floor:
        floor()  # its warm-up: the first call writes its outputs' fresh pages (seconds at R = 1), as a step's first did
    # Steps and floor alternate, so load from other processes on a shared machine hits them alike. Every rank
    # starts each timed call together (the barrier is not timed): without it a rank's step would also time its
    # wait, in the step's first collective, for another rank still in its floor.
    samples: dict[str, list[float]] = {name: [] for name in steps_of}
    floors = []
    for _ in range(cfg.repeats):
        for name, (step, _, _) in steps_of.items():
            barrier()
            samples[name].append(time_call(step, repeats=1, warmup=0, sync=sync).median)
        barrier()
        floors.append(time_call(floor, repeats=1, warmup=0, sync=sync).median if cfg.floor else 0.0)
    steps = samples["eager"]
    out: dict[str, Any] = {"step": _timing(steps), "step_samples": steps, "peak_mem_bytes": steps_of["eager"][1],
                           "shard_bytes": num_local * D * 4, "num_local": num_local, "num_sampled": num_sampled,
                           "batch_global": n}
    if cfg.floor:
        out["floor"], out["floor_samples"] = _timing(floors), floors
        out["pair_ratios"] = [a / b for a, b in zip(steps, floors)]
    if cfg.compile:
        _, peak, first = steps_of["compiled"]
        out["compiled"] = {"step": _timing(samples["compiled"]), "step_samples": samples["compiled"],
                           "peak_mem_bytes": peak, "first_step_s": first}
    return out


def _timing(samples: list[float]) -> dict[str, float]:
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples)).as_dict()


def run(cfg: HeadConfig, world_size: int, timeout: float = 3600.0) -> list[dict[str, Any]]:
    """Run ``head_rank`` on ``world_size`` spawned local ranks (gloo on CPU, NCCL on CUDA); every rank's figures.
    The ranks start with PyTorch's transparent huge pages for large CPU tensors (``THP_MEM_ALLOC_ENABLE=1``, as
    docs/cpu.md recommends for CPU training; ``--no-huge-pages`` leaves the environment as it is)."""
    if cfg.huge_pages:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    return run_on_local_ranks(head_rank, world_size, cfg, backend="nccl" if cfg.device == "cuda" else "gloo",
                              timeout=timeout)


def slowest_rank(ranks: list[dict[str, Any]], key: str) -> list[float]:
    """Each repeat's longest time over the ranks: ``key`` is ``"step_samples"`` or ``"floor_samples"``."""
    return [max(times) for times in zip(*(r[key] for r in ranks))]


def summarise(cfg: HeadConfig, world_size: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON payload: the job's medians at the top level (each repeat's slowest rank, see the module
    docstring), rank 0's memory and its own ratio, every rank's figures below; with ``cfg.compile`` the compiled
    head's figures under ``compiled``."""
    r0 = ranks[0]
    steps, floors = slowest_rank(ranks, "step_samples"), slowest_rank(ranks, "floor_samples")
    step, floor = _timing(steps), _timing(floors)
    result = {
        "config": {**asdict(cfg), "world_size": world_size},
        "step_s": step["median_s"], "floor_s": floor["median_s"], "ratio": step["median_s"] / floor["median_s"],
        "pair_ratios": [a / b for a, b in zip(steps, floors)],
        "rank0_ratio": r0["step"]["median_s"] / r0["floor"]["median_s"],
        "peak_mem_bytes": r0["peak_mem_bytes"], "shard_bytes": r0["shard_bytes"],
        "peak_over_shard": r0["peak_mem_bytes"] / r0["shard_bytes"],
        "step": step, "floor": floor, "num_local": r0["num_local"], "num_sampled": r0["num_sampled"],
        "ranks": ranks,
    }
    if cfg.compile:
        compiled = slowest_rank([r["compiled"] for r in ranks], "step_samples")
        timing = _timing(compiled)
        first = max(r["compiled"]["first_step_s"] for r in ranks)
        result["compiled"] = {
            "step_s": timing["median_s"], "ratio": timing["median_s"] / floor["median_s"],
            "pair_ratios": [a / b for a, b in zip(compiled, floors)], "step": timing,
            "peak_mem_bytes": r0["compiled"]["peak_mem_bytes"],
            "peak_over_shard": r0["compiled"]["peak_mem_bytes"] / r0["shard_bytes"],
            "compile_s": first - timing["median_s"],
        }
    return result


def _ratio_cell(result: dict[str, Any]) -> str:
    """``ratio (pairs min-max)`` of a summary or of its ``compiled`` part."""
    pairs = result["pair_ratios"]
    return f"{result['ratio']:.2f} ({min(pairs):.2f}-{max(pairs):.2f})"


def table(args: argparse.Namespace, result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The printed table: the case, step and floor seconds, the eager step/floor, rank 0's own ratio and memory;
    with ``--compile`` the compiled head's step/floor, memory and compile seconds in columns beside them."""
    s, f = result["step"], result["floor"]
    mib = 1 << 20
    header = ["classes", "R", "ranks x threads", "B/rank", "D", "opt/update", "dtype", "step s (min-max)",
              "floor s (min-max)", "eager step/floor (pairs min-max)", "rank 0 / own floor", "peak MiB/rank",
              "shard MiB", "eager peak/shard"]
    row = [args.num_classes, args.sample_rate, f"{args.world_size} x {args.threads}", args.batch_size,
           args.embedding_size, f"{args.optimizer}/{args.update}", args.dtype,
           f"{s['median_s']:.4f} ({s['min_s']:.4f}-{s['max_s']:.4f})",
           f"{f['median_s']:.4f} ({f['min_s']:.4f}-{f['max_s']:.4f})",
           _ratio_cell(result), f"{result['rank0_ratio']:.2f}", f"{result['peak_mem_bytes'] / mib:.0f}",
           f"{result['shard_bytes'] / mib:.0f}", f"{result['peak_over_shard']:.2f}"]
    if "compiled" in result:
        c = result["compiled"]
        header += ["compiled step/floor (pairs min-max)", "compiled peak/shard", "compile s"]
        row += [_ratio_cell(c), f"{c['peak_over_shard']:.2f}", f"{c['compile_s']:.1f}"]
    return header, [row]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-classes", type=int, required=True)
    parser.add_argument("--sample-rate", type=float, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128, help="per rank")
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--update", choices=("sampled", "all"), default="sampled",
                        help="head update: only the sampled rows (default) or every row (arcface_torch's)")
    parser.add_argument("--dtype", choices=tuple(AUTOCAST_DTYPES), default="fp32",
                        help="autocast dtype of the step's forward (the trainer's fp16/bf16 keys); fp32: none")
    parser.add_argument("--compile", action="store_true",
                        help="also time the head with compile = True (config compile_head), side by side")
    parser.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                        help="do not set THP_MEM_ALLOC_ENABLE=1 for the ranks (4 KiB pages for every fresh tensor)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.batch_size < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error(f"need --world-size, --batch-size, --repeats >= 1 and --warmup >= 0; got "
                     f"{args.world_size}, {args.batch_size}, {args.repeats}, {args.warmup}")
    cfg = HeadConfig(num_classes=args.num_classes, sample_rate=args.sample_rate, batch_size=args.batch_size,
                     embedding_size=args.embedding_size, optimizer=args.optimizer, update=args.update, dtype=args.dtype,
                     device=args.device, threads=args.threads, repeats=args.repeats, warmup=args.warmup,
                     compile=args.compile, huge_pages=args.huge_pages)
    result = summarise(cfg, args.world_size, run(cfg, args.world_size))
    print(markdown_table(*table(args, result)))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
