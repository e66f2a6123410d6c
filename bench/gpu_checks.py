"""The checks of ``make gpu-check`` (``scripts/gpu_check.py`` is its command line): what each runs on the GPU, how
its output is judged, the verdict and the report.

Each check ends PASS, FAIL or NOT VERIFIED (it did not run, with the reason: over the budget, one GPU, a package
missing, every test in it skipped). The verdict, the report's last line, is ``failed`` when a check failed,
``verified`` when the CUDA tests and at least one training run passed, and ``not verified`` otherwise; ``EXIT``
maps it to the command's exit status. The commands run with the machine's own Python through ``run_command``;
``run_checks`` takes another and a clock, so that tests can run every check on a pretend GPU. The head's peak
memory, eager and with ``compile_head``, is judged against ``bench.plan.predict``. What each check runs and why:
docs/gpu_check.md.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.plan import predict
from utils.files import atomic_write

ROOT = Path(__file__).resolve().parents[1]
# What the checks import beyond torch (import name: pip name). A CUDA image of torch usually lacks only easydict
# (the configs import it, as arcface_torch's); anything missing stops the run before any check, in one line.
NEEDED = {"easydict": "easydict", "numpy": "numpy", "torchvision": "torchvision", "tensorboard": "tensorboard",
          "tqdm": "tqdm", "sklearn": "scikit-learn", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
DALI_MODULE, DALI_TESTS = "nvidia.dali", "tests/test_dali.py"  # optional: its CUDA tests skip without it
R50_REFERENCE_IMAGES_PER_S = 5000.0  # one H200, bf16: a figure to report beside, not a verdict
TARGET_HEAD_RATIO = 1.3
PLAN_TOLERANCE = 0.10  # bench/plan.py's peak against the measured one (tests/test_bench.py holds it on the CPU)
HEAD = {"num_classes": 5_000_000, "sample_rate": 0.1, "batch_size": 512, "embedding_size": 512}
TRAIN_STEPS = 200
FP16_SETTLE_STEPS = 20
FP16_GROWTH_INTERVAL = 100  # utils.precision.LossScaler's growth_interval, the trainer's
BUDGET_S = 360.0
# Seconds each check is given at most, and the least it needs to be worth starting (both estimates for one H100
# or H200; a check that needs more than the budget has left is NOT VERIFIED, not a timeout).
LIMITS = {"pytest": (210, 60), "train": (70, 30), "head": (90, 40), "nccl": (80, 40), "backbone": (60, 25),
          "backbone_compile": (130, 60)}
PASS, FAIL, NOT_VERIFIED = "PASS", "FAIL", "NOT VERIFIED"
EXIT = {"verified": 0, "failed": 1, "not verified": 3}

RunCommand = Callable[[list[str], float, dict[str, str]], tuple[int, str, float]]


def run_command(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str, float]:
    """``(exit code, stdout + stderr, seconds)`` of ``cmd`` run in the repository; exit code 124 after ``timeout``."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, out + f"\n(timed out after {timeout:.0f}s)", time.perf_counter() - start


def importable(module: str, env: dict[str, str] | None = None) -> bool:
    """Whether this Python imports ``module`` (in a fresh process, with ``env``'s PYTHONPATH)."""
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True).returncode == 0


def _pip_install(wheels: Path, site: Path, *what: str, deps: bool) -> str:
    """pip's last words when installing ``what`` from the wheel folder into ``site`` fails, else ""."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", *([] if deps else ["--no-deps"]),
                           "--find-links", str(wheels), "--target", str(site), *what], capture_output=True, text=True)
    return "" if proc.returncode == 0 else proc.stderr.strip()[-300:]


def install_missing(wheels: Path | None, site: Path) -> tuple[list[str], str]:
    """Install the packages of NEEDED that do not import from ``wheels`` into ``site``; returns (missing pip
    names, note)."""
    missing = [pip_name for name, pip_name in NEEDED.items() if not importable(name)]
    if not missing:
        return [], "all present"
    if wheels is None:
        return missing, (f"missing {missing}; on a machine with internet run `python3 -m pip download --no-deps "
                         f"{' '.join(missing)} -d wheels`, copy wheels/ here and pass --wheels wheels")
    if error := _pip_install(wheels, site, *missing, deps=False):
        return missing, f"pip could not install {missing} from {wheels}: {error}"
    return [], f"installed {missing} from {wheels}"


def install_dali(wheels: Path | None, site: Path, cuda: str | None, env: dict[str, str]) -> str:
    """Why DALI's CUDA tests cannot run ("" when ``nvidia.dali`` imports with ``env``): without it, the
    ``nvidia_dali_cuda<major>0`` wheel for torch's CUDA ``cuda`` in ``wheels`` is installed, with the dependencies
    found there, into ``site``."""
    if importable(DALI_MODULE, env):
        return ""
    if wheels is None:
        return "nvidia-dali not installed"
    pattern = f"nvidia_dali_cuda{(cuda or '?').split('.')[0]}0-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        return f"nvidia-dali not installed: no {pattern} in {wheels}"
    if error := _pip_install(wheels, site, str(found[-1]), deps=True):
        return f"nvidia-dali not installed: pip could not install {found[-1].name} from {wheels}: {error}"
    return "" if importable(DALI_MODULE, env) else f"nvidia-dali not installed: {found[-1].name} does not import"


def pytest_results(output: str) -> list[tuple[str, str, str]]:
    """``(status, test, reason)`` per test from pytest's ``-rA`` short summary: PASS, FAIL (failed or error) or
    NOT VERIFIED (skipped); a skipped test is named by its location."""
    results = []
    for line in output.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?:\[\d+\] )?(\S+?)(?::? - |: |$)(.*)", line)
        if m:
            word, test, reason = m.groups()
            status = {"PASSED": PASS, "SKIPPED": NOT_VERIFIED, "XFAIL": NOT_VERIFIED}.get(word, FAIL)
            results.append((status, test.rstrip(":"), reason.strip()))
    return results


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


def judge_peak(measured: float, planned: float) -> tuple[bool, str]:
    """A measured peak against the plan's: within PLAN_TOLERANCE either way."""
    off = measured / planned - 1
    return abs(off) <= PLAN_TOLERANCE, f"measured {measured / 2**30:.2f} GiB, planned {planned / 2**30:.2f} GiB " \
                                       f"({off:+.1%})"


@dataclass
class Report:
    """Every check's ``kind`` (``cuda test``, ``train``, ...), name, status, detail and, for a failure, the end
    of its output; the figures of the head and backbone benchmarks."""

    environment: dict[str, Any]
    budget_s: float
    date: str
    checks: list[dict[str, str]] = field(default_factory=list)
    backbones: list[dict[str, Any]] = field(default_factory=list)
    head: dict[str, Any] | None = None
    seconds: float = 0.0
    echo: Callable[[str], None] | None = field(default=None, repr=False)

    def add(self, kind: str, name: str, status: str, detail: Any, log: str = "") -> None:
        self.checks.append({"kind": kind, "name": name, "status": status, "detail": str(detail),
                            "log_tail": log[-3000:] if status == FAIL else ""})
        if self.echo:
            self.echo(f"{status} {name}: {detail}")

    def verdict(self) -> tuple[str, str]:
        """``(verified | not verified | failed, why)``."""
        failed = [c["name"] for c in self.checks if c["status"] == FAIL]
        unverified = sum(c["status"] == NOT_VERIFIED for c in self.checks)
        listed = f"{unverified} check{'s' * (unverified != 1)} not verified (listed above)" if unverified else ""
        if failed:
            return "failed", f"{len(failed)} check{'s' * (len(failed) != 1)} failed: {', '.join(failed)}"
        passed = {kind: sum(c["status"] == PASS and c["kind"] == kind for c in self.checks)
                  for kind in ("cuda test", "train")}
        missing = [what for kind, what in (("cuda test", "no CUDA test passed"), ("train", "no training run passed"))
                   if not passed[kind]]
        if missing:
            return "not verified", "; ".join(missing + [listed] if listed else missing)
        return "verified", (f"{passed['cuda test']} CUDA tests and {passed['train']} training "
                            f"run{'s' * (passed['train'] != 1)} passed" + (f"; {listed}" if listed else ""))

    def render(self) -> str:
        """report.md: the environment, each check's status and reason, the figures, what was not verified, and
        the verdict as the last line."""
        env = self.environment
        lines = ["# GPU check", "", f"{self.date} on {env.get('gpu', '?')}; torch {env.get('torch', '?')}, CUDA "
                 f"{env.get('cuda', '?')}, Python {env.get('python', '?')}; {self.seconds:.0f} s in all (budget "
                 f"{self.budget_s:.0f} s).", "", "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {c['name']} | {c['status']} | {_cell(c['detail'])} |" for c in self.checks]
        if self.backbones:
            lines += ["", f"Backbone training (bf16, channels-last), beside {R50_REFERENCE_IMAGES_PER_S:.0f} images/s "
                      "for r50 on one H200:", "", "| network | options | train img/s | train TFLOP/s | MFU (measured "
                      "bf16 rate) |", "|---|---|---|---|---|"]
            for b in self.backbones:
                mfu = f"{b['mfu_measured']:.1%}" if b.get("mfu_measured") else "-"
                lines.append(f"| {b['network']} | bf16{' + compile' if b['compile'] else ''} | "
                             f"{b['train_images_per_s']:.0f} | {b['train_tflops']:.1f} | {mfu} |")
        if self.head:
            h, cfg = self.head, self.head["config"]
            lines += ["", f"Head, {cfg['num_classes']:,} classes, D = {cfg['embedding_size']}, R = "
                      f"{cfg['sample_rate']}, B = {cfg['batch_size']}:", "", "| head | step ms | floor ms | step/floor "
                      "| peak GiB | planned GiB | peak/shard |", "|---|---|---|---|---|---|---|"]
            for name, r in (("eager", h), ("compile_head", h.get("compiled"))):
                if r:
                    lines.append(f"| {name} | {r['step_s'] * 1e3:.1f} | {h['floor_s'] * 1e3:.1f} | {r['ratio']:.2f} | "
                                 f"{r['peak_mem_bytes'] / 2**30:.2f} | {r.get('planned_peak_bytes', 0) / 2**30:.2f} | "
                                 f"{r['peak_over_shard']:.2f} |")
        counts = {s: sum(c["status"] == s for c in self.checks) for s in (PASS, FAIL, NOT_VERIFIED)}
        lines += ["", f"**{counts[PASS]} passed, {counts[FAIL]} failed, {counts[NOT_VERIFIED]} not verified.**"]
        unverified = [f"- {c['name']}: not verified ({c['detail']})" for c in self.checks
                      if c["status"] == NOT_VERIFIED]
        lines += ["", "Not verified:", "", *unverified] if unverified else []
        for c in self.checks:
            if c["status"] == FAIL and c["log_tail"]:
                lines += ["", f"<details><summary>{c['name']}: end of output</summary>", "", "```", c["log_tail"],
                          "```", "</details>"]
        word, why = self.verdict()
        return "\n".join(lines + ["", f"{word}: {why}"]) + "\n"

    def write(self, out: Path) -> None:
        """report.json and report.md in ``out``."""
        payload = {k: v for k, v in asdict(self).items() if k != "echo"} | {"verdict": self.verdict()[0]}
        atomic_write(out / "report.json", lambda f: f.write(json.dumps(payload, indent=1, default=str).encode()))
        atomic_write(out / "report.md", lambda f: f.write(self.render().encode()))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def cuda_test_files(root: Path = ROOT) -> list[str]:
    """The test files that hold CUDA tests (not the whole suite: its imports are not all on a GPU machine)."""
    return [str(p.relative_to(root)) for p in sorted((root / "tests").rglob("test_*.py"))
            if "pytest.mark.cuda" in p.read_text()]


class GpuCheck:
    """One run of the checks, most important first, within ``budget_s`` seconds of ``clock``."""

    def __init__(self, out: Path, report: Report, env: dict[str, str], gpus: int, run: RunCommand,
                 clock: Callable[[], float]) -> None:
        self.out, self.report, self.env, self.gpus, self.run, self.clock = out, report, env, gpus, run, clock
        self.start = clock()

    def timed(self, kind: str, name: str, limit: str, cmd: list[str]) -> tuple[int, str, float] | None:
        """Run ``cmd`` with the check's time limit, or report ``name`` as NOT VERIFIED when the budget has too
        little left."""
        most, least = LIMITS[limit]
        left = self.report.budget_s - (self.clock() - self.start)
        if left < least:
            self.report.add(kind, name, NOT_VERIFIED, f"{left:.0f} s of the {self.report.budget_s:.0f} s budget "
                            f"left; this check needs about {least} s")
            return None
        return self.run(cmd, min(most, left), self.env)

    def cuda_tests(self) -> list[tuple[str, str, str]]:
        """``pytest -m cuda``: one line per test (DALI's in ``dali``); the tests' results."""
        result = self.timed("cuda test", "pytest -m cuda", "pytest", [
            sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rA", "-p", "no:cacheprovider", *cuda_test_files()])
        if result is None:
            return []
        code, log, secs = result
        tests = pytest_results(log)
        for status, test, reason in tests:
            if not test.startswith(DALI_TESTS):
                self.report.add("cuda test", f"pytest {test.split('::')[-1]}", status, reason or test, log)
        if code not in (0, 1) or not tests:  # a crash, a timeout, or nothing collected: no per-test lines
            self.report.add("cuda test", "pytest -m cuda", FAIL, f"exit {code}, {len(tests)} results in {secs:.0f} s",
                            log)
        return tests

    def dali(self, tests: list[tuple[str, str, str]], not_installed: str, ran: bool) -> None:
        """One line for the DALI loader's CUDA tests: PASS, FAIL, or NOT VERIFIED and why."""
        mine = [(status, test, reason) for status, test, reason in tests if test.startswith(DALI_TESTS)]
        failed = [f"{test}: {reason}" for status, test, reason in mine if status == FAIL]
        passed = sum(status == PASS for status, _, _ in mine)
        if failed:
            self.report.add("dali", "DALI", FAIL, "; ".join(failed))
        elif passed:
            self.report.add("dali", "DALI", PASS, f"{passed} CUDA test{'s' * (passed != 1)} of the DALI loader")
        else:
            why = not_installed or (mine[0][2] if mine else "pytest -m cuda ran no DALI test" if ran else
                                    "pytest -m cuda did not run")
            self.report.add("dali", "DALI", NOT_VERIFIED, why)

    def training(self, dtype: str) -> None:
        """A TRAIN_STEPS-step r50 run on synthetic data in ``dtype``, judged by ``judge_training``."""
        run_dir = self.out / f"train_{dtype}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of the last check's
        name = f"train r50 {TRAIN_STEPS} steps {dtype}"
        result = self.timed("train", name, "train", [
            sys.executable, "train.py", "configs/debug_cpu", "--set", f"output={run_dir}", "device=cuda",
            f"{dtype}=true", "network=r50", "network_kwargs={}", "embedding_size=512", "batch_size=128",
            "num_classes=1000", f"num_image={128 * TRAIN_STEPS}", f"max_steps={TRAIN_STEPS}", "sample_rate=0.5",
            "num_workers=8", "margin_list=1,0,0.4", "frequent=10", "save_every_steps=0", "lr=0.1", "warmup_epoch=0"])
        if result is not None:
            code, log, secs = result
            passed, detail = judge_training(parse_training_log(_read(run_dir / "training.log")), dtype)
            self.report.add("train", name, PASS if code == 0 and passed else FAIL, f"{detail}; {secs:.0f} s", log)

    def head(self) -> None:
        """``bench/head.py`` at HEAD's size, eager and with ``compile_head``: step / floor, and each head's peak
        against ``bench.plan.predict``."""
        head_json = self.out / "head.json"
        result = self.timed("head", "head 5M classes", "head", [
            sys.executable, "bench/head.py", "--num-classes", str(HEAD["num_classes"]), "--sample-rate",
            str(HEAD["sample_rate"]), "--world-size", "1", "--batch-size", str(HEAD["batch_size"]), "--embedding-size",
            str(HEAD["embedding_size"]), "--device", "cuda", "--repeats", "10", "--warmup", "3", "--compile", "--json",
            str(head_json)])
        if result is None:
            return
        code, log, _ = result
        if code != 0:
            self.report.add("head", "head 5M classes", FAIL, f"exit {code}", log)
            return
        head = self.report.head = json.loads(head_json.read_text())
        self.report.add("head", f"head step/floor (target <= {TARGET_HEAD_RATIO})",
                        PASS if head["ratio"] <= TARGET_HEAD_RATIO else FAIL,
                        f"{head['ratio']:.2f} eager, {head['compiled']['ratio']:.2f} with compile_head", log)
        for measured, compiled, name in ((head, False, "head peak memory against bench/plan.py"),
                                         (head["compiled"], True, "compile_head peak memory against bench/plan.py "
                                                                  "--compile-head")):
            planned = measured["planned_peak_bytes"] = predict(
                HEAD["num_classes"], 1, HEAD["sample_rate"], HEAD["embedding_size"], HEAD["batch_size"],
                compile_head=compiled).peak_bytes
            passed, detail = judge_peak(measured["peak_mem_bytes"], planned)
            self.report.add("head", f"{name} (within {PLAN_TOLERANCE:.0%})", PASS if passed else FAIL, detail, log)

    def nccl(self, dtype: str, tests: list[tuple[str, str, str]]) -> None:
        """20 steps of train.py on 2 ranks with NCCL; NOT VERIFIED on one GPU."""
        name = f"train 2 ranks NCCL 20 steps {dtype}"
        if self.gpus < 2:
            gloo = [test.split("::")[-1] for status, test, _ in tests if status == PASS and "gloo" in test]
            self.report.add("nccl", name, NOT_VERIFIED, "one GPU: NCCL needs a GPU per rank; " + (
                f"the collectives ran on CUDA tensors over gloo in pytest -m cuda ({', '.join(gloo)})" if gloo else
                "the collectives did not run on CUDA tensors over gloo either (no such test passed)"))
            return
        run_dir = self.out / f"nccl_{dtype}"
        shutil.rmtree(run_dir, ignore_errors=True)
        result = self.timed("nccl", name, "nccl", [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
            "configs/debug_cpu", "--set", f"output={run_dir}", "device=cuda", f"{dtype}=true", "max_steps=20",
            "frequent=5", "save_every_steps=0"])
        if result is not None:
            code, log, secs = result
            text = _read(run_dir / "training.log")
            losses = parse_training_log(text)["losses"]
            ok = code == 0 and "backend nccl" in text and "step 20/20" in text and len(losses) >= 2
            self.report.add("nccl", name, PASS if ok else FAIL,
                            f"losses {[round(v, 3) for _, v in losses]}; {secs:.0f} s", log)

    def backbone(self, compiled: bool) -> None:
        """``bench/backbone.py`` r50, bf16, channels-last: figures, not a verdict (PASS when it runs)."""
        name = f"backbone r50 bf16 channels-last{' compile' if compiled else ''}"
        json_path = self.out / f"backbone_r50{'_compile' if compiled else ''}.json"
        result = self.timed("backbone", name, "backbone_compile" if compiled else "backbone", [
            sys.executable, "bench/backbone.py", "--network", "r50", "--batch-size", "256", "--bf16", "--channels-last",
            "--device", "cuda", "--repeats", "10", "--warmup", "3", "--json", str(json_path)]
            + (["--compile"] if compiled else []))
        if result is None:
            return
        code, log, secs = result
        if code != 0:
            self.report.add("backbone", name, FAIL, f"exit {code}", log)
            return
        b = json.loads(json_path.read_text())["backbone"]
        self.report.backbones.append(b)
        self.report.add("backbone", name, PASS, f"{b['train_images_per_s']:.0f} img/s (beside "
                        f"{R50_REFERENCE_IMAGES_PER_S:.0f} on one H200), MFU {b['mfu_measured']:.1%} of the measured "
                        f"{b['bf16_matmul_tflops']:.0f} TFLOP/s; {secs:.0f} s")


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def run_checks(out: Path, wheels: Path | None = None, budget_s: float = BUDGET_S, run: RunCommand | None = None,
               clock: Callable[[], float] = time.perf_counter, echo: Callable[[str], None] | None = print) -> Report:
    """Every check on this machine's GPUs, writing into ``out``; the report (not yet written)."""
    import torch

    props, gpus = torch.cuda.get_device_properties(0), torch.cuda.device_count()
    report = Report({"gpu": f"{gpus} x {props.name} ({props.total_memory / 2**30:.0f} GiB)", "torch": torch.__version__,
                     "cuda": torch.version.cuda, "python": platform.python_version()}, budget_s,
                    time.strftime("%Y-%m-%d %H:%M"), echo=echo)
    out.mkdir(parents=True, exist_ok=True)
    site = out / "site"
    missing, note = install_missing(wheels, site)
    report.environment["packages"] = note
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    check = GpuCheck(out, report, env, gpus, run or run_command, clock)
    report.add("packages", "packages", FAIL if missing else PASS, note)
    if not missing:
        not_installed = install_dali(wheels, site, torch.version.cuda, env)
        tests = check.cuda_tests()
        check.dali(tests, not_installed, ran=bool(tests))
        for dtype in ("fp16", "bf16"):
            check.training(dtype)
        check.head()
        for dtype in ("fp16", "bf16"):
            check.nccl(dtype, tests)
        for compiled in (False, True):
            check.backbone(compiled)
    report.seconds = clock() - check.start
    return report
