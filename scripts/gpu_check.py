"""One command that checks the CUDA path on this machine and writes one report (``make gpu-check``).

    python3 scripts/gpu_check.py [--out work_dirs/gpu_check] [--wheels DIR] [--budget-s 360]

Runs with the machine's own Python and torch and fetches nothing. Packages it needs beyond torch (``NEEDED``) that
are missing (on GPU nodes usually only ``easydict``) are named before any check runs, and installed from wheel
files in ``--wheels DIR`` into ``<out>/site``: on a machine with internet, ``python3 -m pip download --no-deps
easydict -d DIR``, then copy DIR over. The checks, most important first, within ``--budget-s`` seconds in all
(6 minutes: a check that would not fit in what is left is reported as SKIP with the seconds it needed):

1. ``pytest -m cuda``, one report line per test: the head on CUDA against the CPU (fp32, bf16, fp16), the
   exact host synchronisations of a head step, two gloo ranks with CUDA tensors on one GPU against one
   process (DDP, the head's gather and early reduce-scatter, the skip decision, fp16 gradient compression),
   a 1-rank NCCL group through train.py, fp16 and bf16 trainer steps, checkpoints of CPU tensors, the CUDA
   prefetch loader, DALI when installed, a compiled backbone.
2. Two ``TRAIN_STEPS``-step training runs of r50 on synthetic data (fp16 and bf16): the loss falls and no
   step is skipped (fp16: skips while the loss scale settles are allowed and reported).
3. ``bench/head.py``: 5M classes, D = 512, sample rate 0.1, batch 512, one rank, eager and with
   ``compile_head`` (both heads live in one process: at 10M classes, 2 x 41 GB would not fit an 80 GB GPU):
   step / floor (target <= ``TARGET_HEAD_RATIO``), and the eager peak memory against ``bench/plan.py``'s figure
   (within ``PLAN_TOLERANCE``).
4. Two ranks with NCCL, 20 steps of ``train.py`` in fp16 and bf16, on a machine with 2 GPUs or more (SKIP
   on one).
5. ``bench/backbone.py`` r50, bf16, channels-last, eager and compiled: training images/s and MFU against
   the bf16 matrix-product rate measured in the same run; reported beside 5,000 images/s on one H200, a
   figure, not a verdict (the check passes when the benchmark runs).

Writes ``<out>/report.md`` and ``<out>/report.json`` (PASS / FAIL / SKIP and the reason for every check, then
the figures) and exits 0 when no check failed, 1 otherwise; on a machine without CUDA it says so in one line
and exits 1.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# What the checks import beyond torch (import name: pip name). A CUDA image of torch usually lacks only easydict
# (the configs import it, as arcface_torch's); anything missing stops the run before any check, in one line.
NEEDED = {"easydict": "easydict", "numpy": "numpy", "torchvision": "torchvision", "tensorboard": "tensorboard",
          "tqdm": "tqdm", "sklearn": "scikit-learn", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
R50_REFERENCE_IMAGES_PER_S = 5000.0  # one H200, bf16: a figure to report beside, not a verdict
TARGET_HEAD_RATIO = 1.3
PLAN_TOLERANCE = 0.10  # bench/plan.py's peak against the measured one (tests/test_bench.py holds it on the CPU)
TRAIN_STEPS = 200
FP16_SETTLE_STEPS = 20
FP16_GROWTH_INTERVAL = 100  # utils.precision.LossScaler's growth_interval, the trainer's
BUDGET_S = 360.0
# Seconds each check is given at most, and the least it needs to be worth starting (both estimates for one H100
# or H200; a check that needs more than the budget has left is a SKIP, not a timeout).
LIMITS = {"pytest": (210, 60), "train": (70, 30), "head": (90, 40), "nccl": (80, 40), "backbone": (60, 25),
          "backbone_compile": (130, 60)}


def run_command(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str, float]:
    """``(exit code, stdout + stderr, seconds)``; exit code 124 when ``timeout`` passed."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, out + f"\n(timed out after {timeout:.0f}s)", time.perf_counter() - start


def install_missing(wheels: Path | None, site: Path) -> tuple[list[str], str]:
    """Install the packages of NEEDED that do not import from ``wheels`` into ``site``; returns (missing pip
    names, note)."""
    missing = [pip_name for name, pip_name in NEEDED.items()
               if subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode != 0]
    if not missing:
        return [], "all present"
    if wheels is None:
        return missing, (f"missing {missing}; on a machine with internet run `python3 -m pip download --no-deps "
                         f"{' '.join(missing)} -d wheels`, copy wheels/ here and pass --wheels wheels")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--find-links", str(wheels), "--target", str(site), *missing],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return missing, f"pip could not install {missing} from {wheels}: {proc.stderr.strip()[-300:]}"
    return [], f"installed {missing} from {wheels}"


def pytest_summary(output: str) -> dict[str, int]:
    """Counts from pytest's last summary line (``3 passed, 1 skipped in 12.3s``)."""
    counts: dict[str, int] = {}
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", lines[-1] if lines else ""):
        counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return counts


def parse_training_log(text: str) -> dict[str, Any]:
    """Logged losses and the skipped-step count of a train.py log."""
    losses = [(int(s), float(v)) for s, v in re.findall(r"step (\d+)/\d+ epoch \d+ \| loss (\S+)", text)
              if v not in ("nan", "inf")]
    skips = [int(s) for s in re.findall(r"step (\d+): non-finite", text)]
    done = re.search(r"done: (\d+) steps, (\d+) skipped", text)
    return {"losses": losses, "skipped_at": skips, "steps": int(done.group(1)) if done else 0,
            "skipped": int(done.group(2)) if done else None}


def judge_training(parsed: dict[str, Any], dtype: str) -> tuple[bool, str]:
    """Pass when the run finished, the mean loss of the last fifth is below the first fifth's, and no step
    was skipped. fp16 may skip while its loss scale settles (the first FP16_SETTLE_STEPS) and, after that,
    once per growth: the scale doubles after FP16_GROWTH_INTERVAL good steps in a row and may overflow right
    then, so a later skip passes when the previous skip (or the start, for the first) is at least that many
    steps before it (closer means the scale overflowed without having grown)."""
    losses = [v for _, v in parsed["losses"]]
    if parsed["steps"] != TRAIN_STEPS or len(losses) < 5:
        return False, f"finished {parsed['steps']} of {TRAIN_STEPS} steps"
    fifth = max(1, len(losses) // 5)
    first, last = sum(losses[:fifth]) / fifth, sum(losses[-fifth:]) / fifth
    skips = parsed["skipped_at"]
    if dtype == "fp16":
        bad = [s for i, s in enumerate(skips)
               if s >= FP16_SETTLE_STEPS and s - (skips[i - 1] if i else 0) < FP16_GROWTH_INTERVAL]
        rule = f" (allowed below step {FP16_SETTLE_STEPS}, then one per {FP16_GROWTH_INTERVAL} steps)"
    else:
        bad, rule = skips, ""
    return last < first and not bad, f"loss {first:.3f} -> {last:.3f}; skipped steps {skips or 'none'}{rule}"


def pytest_results(output: str) -> list[tuple[str, str, str]]:
    """``(status, test, reason)`` per test from pytest's ``-rA`` short summary: PASS, FAIL (failed or error) or
    SKIP; a skipped test is named by its location."""
    results = []
    for line in output.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?:\[\d+\] )?(\S+?)(?::? - |: |$)(.*)", line)
        if not m:
            continue
        word, test, reason = m.groups()
        status = {"PASSED": "PASS", "XPASS": "FAIL", "SKIPPED": "SKIP", "XFAIL": "SKIP"}.get(word, "FAIL")
        results.append((status, test.rstrip(":"), reason.strip()))
    return results


def render(report: dict[str, Any]) -> str:
    """report.md: the environment, PASS / FAIL / SKIP and the reason per check, then the figures."""
    env = report["environment"]
    lines = ["# GPU check", "", f"{report['date']} on {env.get('gpu', '?')}; torch {env.get('torch', '?')}, CUDA "
             f"{env.get('cuda', '?')}, Python {env.get('python', '?')}; {report['seconds']:.0f} s in all (budget "
             f"{report.get('budget_s', BUDGET_S):.0f} s).", "", "| check | result | detail |", "|---|---|---|"]
    for check in report["checks"]:
        detail = str(check["detail"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {check['name']} | {check['status']} | {detail} |")
    if report.get("backbones"):
        lines += ["", f"Backbone training (bf16, channels-last), beside {R50_REFERENCE_IMAGES_PER_S:.0f} images/s for "
                  "r50 on one H200:", "", "| network | options | train img/s | train TFLOP/s | MFU (measured bf16 rate) |",
                  "|---|---|---|---|---|"]
        for b in report["backbones"]:
            mfu = f"{b['mfu_measured']:.1%}" if b.get("mfu_measured") else "-"
            lines.append(f"| {b['network']} | bf16{' + compile' if b['compile'] else ''} | "
                         f"{b['train_images_per_s']:.0f} | {b['train_tflops']:.1f} | {mfu} |")
    if report.get("head"):
        h = report["head"]
        lines += ["", f"Head, {h['config']['num_classes']:,} classes, D = {h['config']['embedding_size']}, R = "
                  f"{h['config']['sample_rate']}, B = {h['config']['batch_size']}:", "",
                  "| head | step ms | floor ms | step/floor | peak GiB | planned GiB | peak/shard |", "|---|---|---|---|---|---|---|",
                  f"| eager | {h['step_s'] * 1e3:.1f} | {h['floor_s'] * 1e3:.1f} | {h['ratio']:.2f} | "
                  f"{h['peak_mem_bytes'] / 2**30:.2f} | {h.get('planned_peak_bytes', 0) / 2**30:.2f} | "
                  f"{h['peak_over_shard']:.2f} |"]
        if h.get("compiled"):
            c = h["compiled"]
            lines.append(f"| compile_head | {c['step_s'] * 1e3:.1f} | {h['floor_s'] * 1e3:.1f} | {c['ratio']:.2f} | "
                         f"{c['peak_mem_bytes'] / 2**30:.2f} | - | {c['peak_over_shard']:.2f} |")
    counts = {status: sum(c["status"] == status for c in report["checks"]) for status in ("PASS", "FAIL", "SKIP")}
    lines += ["", f"**{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped.**"]
    for check in report["checks"]:
        if check["status"] == "FAIL" and check.get("log_tail"):
            lines += ["", f"<details><summary>{check['name']}: end of output</summary>", "", "```",
                      check["log_tail"], "```", "</details>"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "work_dirs" / "gpu_check", help="report folder")
    parser.add_argument("--wheels", type=Path, help="folder of wheel files for missing pure-Python packages")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for every check together")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device on this machine (torch {torch.__version__}, "
              f"torch.cuda.is_available() is False); nothing checked", file=sys.stderr)
        return 1
    start = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    site = out / "site"
    missing, note = install_missing(args.wheels, site)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    props = torch.cuda.get_device_properties(0)
    gpus = torch.cuda.device_count()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "budget_s": args.budget_s,
        "environment": {"gpu": f"{gpus} x {props.name} ({props.total_memory / 2**30:.0f} GiB)",
                        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                        "packages": note},
        "checks": [], "backbones": [], "head": None,
    }

    def check(name: str, status: str, detail: Any, log: str = "") -> None:
        report["checks"].append({"name": name, "status": status, "detail": detail,
                                 "log_tail": log[-3000:] if status == "FAIL" else ""})
        print(f"{status} {name}: {detail}", flush=True)

    def verdict(passed: bool) -> str:
        return "PASS" if passed else "FAIL"

    def run(name: str, limit: str, cmd: list[str]) -> tuple[int, str, float] | None:
        """Run ``cmd`` with the check's time limit, or report ``name`` as SKIP when the budget has too little left."""
        most, least = LIMITS[limit]
        left = args.budget_s - (time.perf_counter() - start)
        if left < least:
            check(name, "SKIP", f"{left:.0f} s of the {args.budget_s:.0f} s budget left; this check needs about {least} s")
            return None
        return run_command(cmd, min(most, left), env)

    check("packages", verdict(not missing), note)
    if missing:
        return finish(out, report, start)

    cuda_tests = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("test_*.py"))
                  if "pytest.mark.cuda" in p.read_text()]  # not the whole suite: its imports are not all here
    result = run("pytest -m cuda", "pytest", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rA",
                                               "-p", "no:cacheprovider", *cuda_tests])
    if result is not None:
        code, log, secs = result
        tests = pytest_results(log)
        for status, test, reason in tests:
            check(f"pytest {test.split('::')[-1]}", status, reason or test, log if status == "FAIL" else "")
        counts = pytest_summary(log)
        if code not in (0, 1) or not tests:  # a crash, a timeout, or nothing collected: no per-test lines
            check("pytest -m cuda", "FAIL", f"exit {code}, {counts} in {secs:.0f} s", log)

    for dtype in ("fp16", "bf16"):
        run_dir = out / f"train_{dtype}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of the last check's
        name = f"train r50 {TRAIN_STEPS} steps {dtype}"
        result = run(name, "train", [
            sys.executable, "train.py", "configs/debug_cpu", "--set", f"output={run_dir}", "device=cuda",
            f"{dtype}=true", "network=r50", "network_kwargs={}", "embedding_size=512", "batch_size=128",
            "num_classes=1000", f"num_image={128 * TRAIN_STEPS}", f"max_steps={TRAIN_STEPS}", "sample_rate=0.5",
            "num_workers=8", "margin_list=1,0,0.4", "frequent=10", "save_every_steps=0", "lr=0.1", "warmup_epoch=0"])
        if result is not None:
            code, log, secs = result
            text = (run_dir / "training.log").read_text() if (run_dir / "training.log").is_file() else ""
            passed, detail = judge_training(parse_training_log(text), dtype)
            check(name, verdict(code == 0 and passed), f"{detail}; {secs:.0f} s", log)

    head_json = out / "head.json"
    head_cfg = dict(num_classes=5_000_000, sample_rate=0.1, batch_size=512, embedding_size=512)
    result = run("head 5M classes", "head", [
        sys.executable, "bench/head.py", "--num-classes", str(head_cfg["num_classes"]), "--sample-rate",
        str(head_cfg["sample_rate"]), "--world-size", "1", "--batch-size", str(head_cfg["batch_size"]),
        "--embedding-size", str(head_cfg["embedding_size"]), "--device", "cuda", "--repeats", "10", "--warmup", "3",
        "--compile", "--json", str(head_json)])
    if result is not None:
        code, log, secs = result
        plan_json = out / "plan.json"
        plan_code, plan_log, _ = run_command([
            sys.executable, "bench/plan.py", "--num-classes", str(head_cfg["num_classes"]), "--gpus", "1",
            "--sample-rate", str(head_cfg["sample_rate"]), "--embedding-size", str(head_cfg["embedding_size"]),
            "--batch-size", str(head_cfg["batch_size"]), "--json", str(plan_json)], 60, env)
        if code == 0 and plan_code != 0:
            check("head 5M classes: bench/plan.py", "FAIL", f"exit {plan_code}", plan_log)
        elif code == 0:
            head = report["head"] = json.loads(head_json.read_text())
            planned = head["planned_peak_bytes"] = json.loads(plan_json.read_text())["plan"]["peak_bytes"]
            ratio, off = head["ratio"], head["peak_mem_bytes"] / planned - 1
            check(f"head step/floor (target <= {TARGET_HEAD_RATIO})", verdict(ratio <= TARGET_HEAD_RATIO),
                  f"{ratio:.2f} eager, {head['compiled']['ratio']:.2f} with compile_head", log)
            check(f"head peak memory against bench/plan.py (within {PLAN_TOLERANCE:.0%})",
                  verdict(abs(off) <= PLAN_TOLERANCE), f"measured {head['peak_mem_bytes'] / 2**30:.2f} GiB, planned "
                  f"{planned / 2**30:.2f} GiB ({off:+.1%})", log)
        else:
            check("head 5M classes", "FAIL", f"exit {code}", log)

    for dtype in ("fp16", "bf16"):
        name = f"train 2 ranks NCCL 20 steps {dtype}"
        if gpus < 2:
            check(name, "SKIP", "one GPU: NCCL needs a GPU per rank (the collectives ran on CUDA tensors over gloo "
                  "in pytest above)")
            continue
        run_dir = out / f"nccl_{dtype}"
        shutil.rmtree(run_dir, ignore_errors=True)
        result = run(name, "nccl", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc_per_node=2", "train.py", "configs/debug_cpu", "--set",
                                    f"output={run_dir}", "device=cuda", f"{dtype}=true", "max_steps=20",
                                    "frequent=5", "save_every_steps=0"])
        if result is not None:
            code, log, secs = result
            text = (run_dir / "training.log").read_text() if (run_dir / "training.log").is_file() else ""
            losses = parse_training_log(text)["losses"]
            ok = code == 0 and "backend nccl" in text and "step 20/20" in text and len(losses) >= 2
            check(name, verdict(ok), f"losses {[round(v, 3) for _, v in losses]}; {secs:.0f} s", log)

    for compiled in (False, True):
        name = f"backbone r50 bf16 channels-last{' compile' if compiled else ''}"
        json_path = out / f"backbone_r50{'_compile' if compiled else ''}.json"
        result = run(name, "backbone_compile" if compiled else "backbone", [
            sys.executable, "bench/backbone.py", "--network", "r50", "--batch-size", "256", "--bf16", "--channels-last",
            "--device", "cuda", "--repeats", "10", "--warmup", "3", "--json", str(json_path)]
            + (["--compile"] if compiled else []))
        if result is None:
            continue
        code, log, secs = result
        if code != 0:
            check(name, "FAIL", f"exit {code}", log)
            continue
        b = json.loads(json_path.read_text())["backbone"]
        report["backbones"].append(b)
        check(name, "PASS", f"{b['train_images_per_s']:.0f} img/s (beside {R50_REFERENCE_IMAGES_PER_S:.0f} on one "
              f"H200), MFU {b['mfu_measured']:.1%} of the measured {b['bf16_matmul_tflops']:.0f} TFLOP/s; {secs:.0f} s")
    return finish(out, report, start)


def finish(out: Path, report: dict[str, Any], start: float) -> int:
    report["seconds"] = time.perf_counter() - start
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(render(report))
    print(f"gpu_check: report in {out / 'report.md'}")
    return 1 if any(c["status"] == "FAIL" for c in report["checks"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
