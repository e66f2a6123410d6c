"""One command that checks the CUDA path on this machine and writes one report (``make gpu-check``).

    python3 scripts/gpu_check.py [--out work_dirs/gpu_check] [--wheels DIR]

Runs with the machine's own Python and torch and fetches nothing. Packages it needs beyond torch (``NEEDED``) that
are missing (on GPU nodes usually only ``easydict``) are named before any check runs, and installed from wheel
files in ``--wheels DIR`` into
``<out>/site``: on a machine with internet, ``python3 -m pip download --no-deps easydict -d DIR``, then
copy DIR over. The checks, about 6-8 minutes on one GPU:

1. ``pytest -m cuda``: the head on CUDA against the CPU (fp32, bf16), host synchronisations of a head
   step, a 1-rank NCCL group through train.py, fp16 (loss scaler) and bf16 trainer steps, the CUDA
   prefetch loader, DALI when installed, a compiled backbone.
2. ``bench/backbone.py`` for r50 and r100, bf16, without and with ``torch.compile``: training images/s
   and MFU against the bf16 matrix-product rate measured in the same run (target: r50 bf16 >= 5000
   images/s on one H200).
3. ``bench/head.py``: 10M classes, D = 512, sample rate 0.1, batch 512, one rank: step / floor (target
   <= 1.3) and peak memory / fp32 shard.
4. Two 300-step training runs on synthetic data (fp16 and bf16): the loss falls and no step is skipped
   (fp16: skips while the loss scale settles in the first 20 steps are allowed and reported).

Writes ``<out>/report.md`` and ``<out>/report.json`` (every figure, a pass/fail line per check) and exits
0 when every check passed, 1 otherwise; on a machine without CUDA it says so in one line and exits 1.
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
TARGET_R50_IMAGES_PER_S = 5000.0
TARGET_HEAD_RATIO = 1.3
TRAIN_STEPS = 300
FP16_SETTLE_STEPS = 20
FP16_GROWTH_INTERVAL = 100  # utils.precision.LossScaler's growth_interval, the trainer's


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


def render(report: dict[str, Any]) -> str:
    """report.md: the environment, one pass/fail line per check, then the figures."""
    lines = ["# GPU check", "", f"{report['date']} on {report['environment'].get('gpu', '?')}; torch "
             f"{report['environment'].get('torch', '?')}, CUDA {report['environment'].get('cuda', '?')}, Python "
             f"{report['environment'].get('python', '?')}; {report['seconds']:.0f} s in all.", "",
             "| check | result | detail |", "|---|---|---|"]
    for check in report["checks"]:
        detail = str(check["detail"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {check['name']} | {'PASS' if check['passed'] else 'FAIL'} | {detail} |")
    if report.get("backbones"):
        lines += ["", "| network | options | train img/s | train TFLOP/s | MFU (measured bf16 rate) |", "|---|---|---|---|---|"]
        for b in report["backbones"]:
            mfu = f"{b['mfu_measured']:.1%}" if b.get("mfu_measured") else "-"
            lines.append(f"| {b['network']} | bf16{' + compile' if b['compile'] else ''} | "
                         f"{b['train_images_per_s']:.0f} | {b['train_tflops']:.1f} | {mfu} |")
    if report.get("head"):
        h = report["head"]
        lines += ["", f"Head, {h['config']['num_classes']:,} classes, D = {h['config']['embedding_size']}, R = "
                  f"{h['config']['sample_rate']}, B = {h['config']['batch_size']}: step {h['step_s'] * 1e3:.1f} ms, "
                  f"floor {h['floor_s'] * 1e3:.1f} ms, step/floor {h['ratio']:.2f} (target <= {TARGET_HEAD_RATIO}); "
                  f"peak {h['peak_mem_bytes'] / 2**30:.2f} GiB = {h['peak_over_shard']:.2f} x the fp32 shard."]
    failed = [c for c in report["checks"] if not c["passed"]]
    lines += ["", f"**{len(report['checks']) - len(failed)} of {len(report['checks'])} checks passed.**"]
    for check in failed:
        if check.get("log_tail"):
            lines += ["", f"<details><summary>{check['name']}: end of output</summary>", "", "```",
                      check["log_tail"], "```", "</details>"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "work_dirs" / "gpu_check", help="report folder")
    parser.add_argument("--wheels", type=Path, help="folder of wheel files for missing pure-Python packages")
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
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "environment": {"gpu": f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB)",
                        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                        "packages": note},
        "checks": [], "backbones": [], "head": None,
    }

    def check(name: str, passed: bool, detail: Any, log: str = "") -> None:
        report["checks"].append({"name": name, "passed": bool(passed), "detail": detail,
                                 "log_tail": log[-3000:] if not passed else ""})
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)

    check("packages", not missing, note)
    if missing:
        return finish(out, report, start)

    code, log, secs = run_command([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                   "tests/test_cuda.py"], 240, env)
    counts = pytest_summary(log)
    check("pytest -m cuda", code == 0 and counts.get("passed", 0) > 0, f"{counts} in {secs:.0f} s", log)

    for network in ("r50", "r100"):
        for compiled in (False, True):
            json_path = out / f"backbone_{network}{'_compile' if compiled else ''}.json"
            cmd = [sys.executable, "bench/backbone.py", "--network", network, "--batch-size", "256", "--bf16",
                   "--device", "cuda", "--repeats", "10", "--warmup", "3", "--json", str(json_path)]
            code, log, secs = run_command(cmd + (["--compile"] if compiled else []), 150, env)
            if code != 0:
                check(f"backbone {network} bf16{' compile' if compiled else ''}", False, f"exit {code}", log)
                continue
            result = json.loads(json_path.read_text())["backbone"]
            report["backbones"].append(result)
            detail = (f"{result['train_images_per_s']:.0f} img/s, MFU {result['mfu_measured']:.1%} of the measured "
                      f"{result['bf16_matmul_tflops']:.0f} TFLOP/s")
            passed = network != "r50" or compiled or result["train_images_per_s"] >= TARGET_R50_IMAGES_PER_S
            check(f"backbone {network} bf16{' compile' if compiled else ''}"
                  + (f" (target >= {TARGET_R50_IMAGES_PER_S:.0f} img/s)" if network == "r50" and not compiled else ""),
                  passed, detail, log)

    head_json = out / "head.json"
    code, log, secs = run_command([sys.executable, "bench/head.py", "--num-classes", "10000000", "--sample-rate", "0.1",
                                   "--world-size", "1", "--batch-size", "512", "--embedding-size", "512",
                                   "--device", "cuda", "--repeats", "10", "--warmup", "3", "--json", str(head_json)],
                                  180, env)
    if code == 0:
        report["head"] = json.loads(head_json.read_text())
        ratio = report["head"]["ratio"]
        check(f"head 10M classes (target step/floor <= {TARGET_HEAD_RATIO})", ratio <= TARGET_HEAD_RATIO,
              f"step/floor {ratio:.2f}, peak/shard {report['head']['peak_over_shard']:.2f}", log)
    else:
        check("head 10M classes", False, f"exit {code}", log)

    for dtype in ("fp16", "bf16"):
        run_dir = out / f"train_{dtype}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of the last check's
        cmd = [sys.executable, "train.py", "configs/debug_cpu", "--set", f"output={run_dir}", "device=cuda",
               f"{dtype}=true", "network=r50", "network_kwargs={}", "embedding_size=512", "batch_size=128",
               "num_classes=1000", "num_image=38400", f"max_steps={TRAIN_STEPS}", "sample_rate=0.5", "num_workers=8",
               "margin_list=1,0,0.4", "frequent=10", "save_every_steps=0", "lr=0.1", "warmup_epoch=0"]
        code, log, secs = run_command(cmd, 180, env)
        text = (run_dir / "training.log").read_text() if (run_dir / "training.log").is_file() else ""
        parsed = parse_training_log(text)
        passed, detail = judge_training(parsed, dtype)
        check(f"train {TRAIN_STEPS} steps {dtype}", code == 0 and passed, f"{detail}; {secs:.0f} s", log)
    return finish(out, report, start)


def finish(out: Path, report: dict[str, Any], start: float) -> int:
    report["seconds"] = time.perf_counter() - start
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(render(report))
    print(f"gpu_check: report in {out / 'report.md'}")
    return 0 if all(c["passed"] for c in report["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
