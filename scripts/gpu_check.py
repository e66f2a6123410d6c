"""One command that checks the CUDA path on this machine and writes one report (``make gpu-check``).

    python3 scripts/gpu_check.py [--out work_dirs/gpu_check] [--wheels DIR] [--budget-s 360]

Runs with the machine's own Python and torch and fetches nothing: missing packages are named before any check
runs, and installed from the wheel files in ``--wheels DIR`` into ``<out>/site``. The checks (``bench/gpu_checks.py``),
most important first, within ``--budget-s`` seconds (one that would not fit in what is left is NOT VERIFIED):
``pytest -m cuda``, two 200-step r50 training runs (fp16, bf16), the head at 5M classes, 2 ranks with NCCL (on 2
GPUs or more), the r50 backbone benchmark. What each runs and how it is judged: docs/gpu_check.md.

Writes ``<out>/report.md`` and ``<out>/report.json``: every check PASS, FAIL or NOT VERIFIED with its reason, the
figures, and last the verdict. Exit status: 0 verified (the CUDA tests and at least one training run passed, no
check failed); 1 failed (a check failed, or no CUDA device: one line); 3 not verified (nothing failed, but the CUDA
tests or the training runs did not run or every one of them was skipped).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_checks
from utils.cli import run_tool

ROOT = Path(__file__).resolve().parents[1]


def check(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device on this machine (torch {torch.__version__}, "
              f"torch.cuda.is_available() is False); nothing checked", file=sys.stderr)
        return gpu_checks.EXIT["failed"]
    out = args.out.resolve()
    report = gpu_checks.run_checks(out, args.wheels, args.budget_s)
    report.write(out)
    word, why = report.verdict()
    print(f"gpu_check: report in {out / 'report.md'}\n{word}: {why}")
    return gpu_checks.EXIT[word]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "work_dirs" / "gpu_check", help="report folder")
    parser.add_argument("--wheels", type=Path, help="folder of wheel files for missing packages (and nvidia-dali)")
    parser.add_argument("--budget-s", type=float, default=gpu_checks.BUDGET_S, help="seconds for every check together")
    args = parser.parse_args(argv)
    return run_tool("gpu_check", lambda: check(args), on_interrupt="; no report written")


if __name__ == "__main__":
    sys.exit(main())
