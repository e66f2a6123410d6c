"""make gpu-check: scripts/gpu_check.py on a machine without CUDA, and bench/gpu_checks.py's checks, verdict and
report on a pretend GPU (every command answers at once with what the real one writes)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from bench import gpu_checks as G
from bench.plan import predict
from tests.helpers import ROOT

HEAD_PLAN = {compiled: predict(G.HEAD["num_classes"], 1, G.HEAD["sample_rate"], G.HEAD["embedding_size"],
                               G.HEAD["batch_size"], compile_head=compiled).peak_bytes for compiled in (False, True)}
CUDA_TESTS = ("PASSED tests/test_cuda.py::test_two_gloo_ranks_with_cuda_tensors_train_like_one_process\n"
              "PASSED tests/test_cuda.py::test_a\n"
              "SKIPPED [1] tests/test_dali.py:150: nvidia-dali is not installed (optional)\n2 passed, 1 skipped in 60s")
ALL_SKIPPED = ("SKIPPED [9] tests/test_cuda.py:20: needs a CUDA device (make gpu-check runs these)\n"
               "SKIPPED [1] tests/test_dali.py:144: needs a CUDA device (make gpu-check runs these)\n10 skipped in 3s")
SECONDS = {"pytest": 140, "train": 30, "head": 45, "backbone": 20, "backbone_compile": 85}


@pytest.mark.process
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs for real")
@pytest.mark.timeout(60)
def test_without_cuda_it_says_so_in_one_line_and_exits_1(tmp_path):
    """Also without any package of NEEDED (a GPU node's bare Python): the command imports none of them before it
    can name them."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {set(G.NEEDED)!r}:\n"
        "            raise ModuleNotFoundError(name)\nsys.meta_path.insert(0, Block())\n")
    env = {**os.environ, "PYTHONPATH": str(blocker), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 1
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no CUDA device" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.process
def test_missing_packages_are_named_by_their_pip_names(tmp_path, monkeypatch):
    monkeypatch.setattr(G, "NEEDED", {"json": "json", "no_such_module_xyz": "no-such-package"})
    missing, note = G.install_missing(None, tmp_path / "site")
    assert missing == ["no-such-package"]
    assert "pip download --no-deps no-such-package -d wheels" in note and "--wheels" in note
    missing, note = G.install_missing(tmp_path, tmp_path / "site")  # an empty folder: pip finds nothing
    assert missing == ["no-such-package"] and "could not install ['no-such-package']" in note
    monkeypatch.setattr(G, "NEEDED", {"json": "json"})
    assert G.install_missing(None, tmp_path / "site") == ([], "all present")


def _wheel(folder: Path, name: str, module: str) -> Path:
    """A minimal wheel ``name`` (``dist-version-py3-none-any.whl``) holding ``module`` (dotted) that imports."""
    dist, version = name.split("-")[:2]
    path = folder / name
    info = f"{dist}-{version}.dist-info"
    files = {f"{module.replace('.', '/')}/__init__.py": "",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as whl:
        for file, text in files.items():
            whl.writestr(file, text)
    return path


@pytest.mark.process
@pytest.mark.timeout(120)
def test_dali_is_installed_from_its_wheel_for_torch_s_cuda(tmp_path, monkeypatch):
    """Without nvidia.dali, --wheels DIR installs the nvidia_dali_cuda<major>0 wheel found there into the site folder
    the checks run with; without a wheel for this CUDA, or without --wheels, the reason is the one line DALI gets."""
    monkeypatch.setattr(G, "DALI_MODULE", "fake_dali_pkg.dali")  # the real name may be installed here
    site, wheels = tmp_path / "site", tmp_path / "wheels"
    wheels.mkdir()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    assert G.install_dali(None, site, "12.8", env) == "nvidia-dali not installed"
    _wheel(wheels, "nvidia_dali_cuda110-1.0-py3-none-any.whl", "fake_dali_pkg.dali")
    no_wheel = G.install_dali(wheels, site, "12.8", env)
    assert no_wheel == f"nvidia-dali not installed: no nvidia_dali_cuda120-*.whl in {wheels}"
    _wheel(wheels, "nvidia_dali_cuda120-1.0-py3-none-any.whl", "fake_dali_pkg.dali")
    assert G.install_dali(wheels, site, "12.8", env) == ""
    assert (site / "fake_dali_pkg" / "dali" / "__init__.py").is_file()
    assert G.install_dali(None, site, "12.8", env) == ""  # now it imports


def test_training_log_judgement():
    n = G.TRAIN_STEPS
    log = "\n".join(f"12:00:00 INFO step {s}/{n} epoch 0 | loss {30 - s / 20:.4f} | lr 0.1"
                    for s in range(10, n + 1, 10))
    fp16 = log + "\n12:00:00 WARNING step 3: non-finite backbone gradients (loss 31.2); update ...\n" \
                 f"12:00:00 INFO done: {n} steps, 1 skipped for a non-finite loss or gradient; model at x"
    parsed = G.parse_training_log(fp16)
    assert parsed["steps"] == n and parsed["skipped_at"] == [3] and len(parsed["losses"]) == n // 10
    assert G.judge_training(parsed, "fp16")[0]  # a skip while the loss scale settles
    assert not G.judge_training(parsed, "bf16")[0]  # bf16 has no scale to settle
    rising = "\n".join(f"INFO step {s}/{n} epoch 0 | loss {10 + s / 20:.4f} | lr 0.1" for s in range(10, n + 1, 10))
    rising = G.parse_training_log(rising + f"\nINFO done: {n} steps, 0 skipped")
    assert not G.judge_training(rising, "bf16")[0]
    assert not G.judge_training(G.parse_training_log("done: 120 steps, 0 skipped"), "bf16")[0]
    # After settling, fp16 may overflow once per growth of its scale (every 100 good steps), not twice in a row.
    for skipped_at, ok in (([3, 5, 125], True), ([3, 125, 240], True), ([3, 125, 126], False), ([125, 126], False),
                           ([40, 90], False), ([50], False), ([101], True), ([3, 60], False)):
        assert G.judge_training({**parsed, "skipped_at": skipped_at}, "fp16")[0] == ok, skipped_at
    from utils.precision import LossScaler

    assert LossScaler(True).growth_interval == G.FP16_GROWTH_INTERVAL  # the trainer's scaler


def test_per_test_results_and_a_skip_is_not_verified():
    summary = """=========================== short test summary info ============================
PASSED tests/test_cuda.py::test_head_on_cuda_equals_the_cpu_head[1.0]
SKIPPED [1] tests/test_cuda.py:180: nvidia-dali is not installed (optional)
FAILED tests/test_cuda.py::test_a_head_step_synchronises_exactly_as_counted[5000-2] - AssertionError: ['a', 'b', 'c']
ERROR tests/test_cuda.py::test_compiled_backbone_trains_on_cuda - RuntimeError: boom
1 failed, 1 passed, 1 skipped, 1 error in 20.1s"""
    assert G.pytest_results(summary) == [
        ("PASS", "tests/test_cuda.py::test_head_on_cuda_equals_the_cpu_head[1.0]", ""),
        ("NOT VERIFIED", "tests/test_cuda.py:180", "nvidia-dali is not installed (optional)"),
        ("FAIL", "tests/test_cuda.py::test_a_head_step_synchronises_exactly_as_counted[5000-2]",
         "AssertionError: ['a', 'b', 'c']"),
        ("FAIL", "tests/test_cuda.py::test_compiled_backbone_trains_on_cuda", "RuntimeError: boom")]


def _pretend_gpu(monkeypatch, seconds: dict[str, float] = SECONDS, fail: frozenset[str] = frozenset(),
                 pytest_output: str = CUDA_TESTS, compiled_peak: float = 1.03, gpus: int = 1):
    """A one-GPU machine whose commands answer at once with what the real ones write, after ``seconds[kind]`` on
    a pretend clock (``clock``); ``fail`` names the kinds that exit 1. Returns (the commands run, the clock)."""
    clock = [0.0]
    ran: list[list[str]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="Pretend GPU", total_memory=80 * 2**30))
    monkeypatch.setattr(G, "install_missing", lambda wheels, site: ([], "all present"))
    monkeypatch.setattr(G, "install_dali", lambda wheels, site, cuda, env: "nvidia-dali not installed")

    def run_command(cmd, timeout, env):
        kind = ("pytest" if "pytest" in cmd else "train" if "train.py" in cmd else "head" if "bench/head.py" in cmd
                else "backbone_compile" if "--compile" in cmd else "backbone")
        ran.append(cmd)
        clock[0] += min(seconds[kind], timeout)
        if seconds[kind] > timeout:
            return 124, f"(timed out after {timeout:.0f}s)", timeout
        if kind in fail:
            return 1, f"{kind} broke", seconds[kind]
        if kind == "pytest":
            return 0, pytest_output, seconds[kind]
        out = Path(cmd[cmd.index("--json") + 1]) if "--json" in cmd else None
        if kind == "train":
            run_dir = Path(next(a for a in cmd if a.startswith("output="))[len("output="):])
            run_dir.mkdir(parents=True)
            steps = G.TRAIN_STEPS
            (run_dir / "training.log").write_text("\n".join(
                f"INFO step {k}/{steps} epoch 0 | loss {20 - k / 50:.3f} | lr 0.1" for k in range(10, steps + 1, 10))
                + f"\nINFO done: {steps} steps, 0 skipped")
        elif kind == "head":
            out.write_text(json.dumps({"config": {**G.HEAD}, "step_s": 0.012, "floor_s": 0.010, "ratio": 1.2,
                                       "peak_mem_bytes": HEAD_PLAN[False] * 1.03, "peak_over_shard": 2.3,
                                       "compiled": {"step_s": 0.011, "ratio": 1.1, "peak_over_shard": 2.5,
                                                    "peak_mem_bytes": HEAD_PLAN[True] * compiled_peak}}))
        else:
            out.write_text(json.dumps({"backbone": {"network": "r50", "compile": kind == "backbone_compile",
                                                    "train_images_per_s": 5100.0, "train_tflops": 120.0,
                                                    "mfu_measured": 0.2, "bf16_matmul_tflops": 600.0}}))
        return 0, "ok", seconds[kind]

    monkeypatch.setattr(G, "run_command", run_command)
    return ran, clock


def _status(report: G.Report) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report.checks}


def test_all_good_is_verified_and_exits_0(tmp_path, monkeypatch, capsys):
    """The whole run through the command: one line per CUDA test, DALI in one line (not installed), the training
    runs, the head against the plan eager and compiled, NCCL not verified on one GPU with the tests that did run the
    collectives, the backbones as figures; the report's last line is the verdict."""
    ran, _ = _pretend_gpu(monkeypatch)
    from scripts import gpu_check

    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("verified: 2 CUDA tests and 2 training runs passed")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "verified"
    assert {c["name"]: c["status"] for c in report["checks"]} == {
        "packages": "PASS", "pytest test_two_gloo_ranks_with_cuda_tensors_train_like_one_process": "PASS",
        "pytest test_a": "PASS", "DALI": "NOT VERIFIED",
        f"train r50 {G.TRAIN_STEPS} steps fp16": "PASS", f"train r50 {G.TRAIN_STEPS} steps bf16": "PASS",
        "head step/floor (target <= 1.3)": "PASS", "head peak memory against bench/plan.py (within 10%)": "PASS",
        "compile_head peak memory against bench/plan.py --compile-head (within 10%)": "PASS",
        "train 2 ranks NCCL 20 steps fp16": "NOT VERIFIED", "train 2 ranks NCCL 20 steps bf16": "NOT VERIFIED",
        "backbone r50 bf16 channels-last": "PASS", "backbone r50 bf16 channels-last compile": "PASS"}
    assert "tests/test_cuda.py" in ran[0] and "tests/test_dali.py" in ran[0]  # the files with CUDA tests only
    md = (tmp_path / "report.md").read_text()
    assert "**10 passed, 0 failed, 3 not verified.**" in md and "(+3.0%)" in md
    assert "| r50 | bf16 + compile | 5100 | 120.0 | 20.0% |" in md
    assert "- DALI: not verified (nvidia-dali not installed)" in md
    assert ("one GPU: NCCL needs a GPU per rank; the collectives ran on CUDA tensors over gloo in pytest -m cuda "
            "(test_two_gloo_ranks_with_cuda_tensors_train_like_one_process)") in md
    assert md.splitlines()[-1] == ("verified: 2 CUDA tests and 2 training runs passed; 3 checks not verified "
                                   "(listed above)")


def test_a_budget_too_small_for_any_check_is_not_verified(tmp_path, monkeypatch, capsys):
    """Nothing runs: every check is NOT VERIFIED with the seconds it needed, the NCCL line does not claim that
    pytest ran the collectives, and the command exits 3 (it exited 0: '1 passed, 0 failed, 8 skipped')."""
    ran, _ = _pretend_gpu(monkeypatch)
    from scripts import gpu_check

    assert gpu_check.main(["--out", str(tmp_path), "--budget-s", "20"]) == 3
    assert ran == []
    md = (tmp_path / "report.md").read_text()
    assert md.splitlines()[-1].startswith("not verified: no CUDA test passed; no training run passed; 9 checks")
    assert "- pytest -m cuda: not verified (20 s of the 20 s budget left; this check needs about 60 s)" in md
    assert "- DALI: not verified (nvidia-dali not installed)" in md
    assert "gloo in pytest" not in md and "did not run on CUDA tensors over gloo either" in md
    assert capsys.readouterr().out.splitlines()[-1].startswith("not verified: ")


def test_every_cuda_test_skipped_is_not_verified_even_when_training_passed(tmp_path, monkeypatch):
    """CUDA invisible to pytest's process: every test skips, pytest exits 0; each skip is listed with its reason."""
    _pretend_gpu(monkeypatch, pytest_output=ALL_SKIPPED)
    report = G.run_checks(tmp_path, echo=None)
    assert report.verdict()[0] == "not verified" and G.EXIT["not verified"] == 3
    assert report.verdict()[1].startswith("no CUDA test passed; ")
    status = _status(report)
    assert status["pytest tests/test_cuda.py:20"] == "NOT VERIFIED" and status["DALI"] == "NOT VERIFIED"
    assert status[f"train r50 {G.TRAIN_STEPS} steps bf16"] == "PASS"
    assert "- pytest tests/test_cuda.py:20: not verified (needs a CUDA device (make gpu-check runs these))" in (
        report.render())


def test_a_failure_fails_and_over_budget_checks_are_not_verified(tmp_path, monkeypatch):
    """A training run that exits 1 is a FAIL with its output; checks that no longer fit the budget are NOT VERIFIED
    with what they needed; the verdict is failed (exit 1), within the budget on the pretend clock."""
    _, clock = _pretend_gpu(monkeypatch, {**SECONDS, "pytest": 200, "head": 100}, fail=frozenset({"train"}))
    report = G.run_checks(tmp_path, echo=None, clock=lambda: clock[0])
    status = _status(report)
    assert status[f"train r50 {G.TRAIN_STEPS} steps fp16"] == "FAIL"
    assert status["backbone r50 bf16 channels-last compile"] == "NOT VERIFIED"
    assert report.seconds <= G.BUDGET_S
    skipped = next(c for c in report.checks if c["name"] == "backbone r50 bf16 channels-last compile")
    assert "budget left; this check needs about 60 s" in skipped["detail"]
    assert report.verdict() == ("failed", f"3 checks failed: train r50 {G.TRAIN_STEPS} steps fp16, train r50 "
                                          f"{G.TRAIN_STEPS} steps bf16, head 5M classes")  # the head timed out
    md = report.render()
    assert "train broke" in md and "(timed out after 90s)" in md and md.splitlines()[-1].startswith("failed: 3 checks")


def test_the_compiled_head_s_peak_is_judged_against_the_plan(tmp_path, monkeypatch):
    """compile_head's peak 20 % above bench/plan.py --compile-head's is a FAIL (it was only printed)."""
    _pretend_gpu(monkeypatch, compiled_peak=1.2)
    report = G.run_checks(tmp_path, echo=None)
    check = next(c for c in report.checks if c["name"].startswith("compile_head peak memory"))
    assert check["status"] == "FAIL" and "(+20.0%)" in check["detail"] and report.verdict()[0] == "failed"
    assert report.head["compiled"]["planned_peak_bytes"] == HEAD_PLAN[True] > HEAD_PLAN[False]


def test_dali_line_follows_its_tests():
    report = G.Report({}, 10.0, "now")
    check = G.GpuCheck(Path("."), report, {}, 1, G.run_command, lambda: 0.0)
    check.dali([("PASS", "tests/test_dali.py::test_x[0-1]", ""), ("PASS", "tests/test_cuda.py::test_a", "")], "", True)
    check.dali([("FAIL", "tests/test_dali.py::test_x[0-1]", "AssertionError: 3 != 4")], "", True)
    check.dali([("NOT VERIFIED", "tests/test_dali.py:150", "nvidia-dali is not installed (optional)")],
               "nvidia-dali not installed", True)
    check.dali([], "", False)
    assert [(c["status"], c["detail"]) for c in report.checks] == [
        ("PASS", "1 CUDA test of the DALI loader"), ("FAIL", "tests/test_dali.py::test_x[0-1]: AssertionError: 3 != 4"),
        ("NOT VERIFIED", "nvidia-dali not installed"), ("NOT VERIFIED", "pytest -m cuda did not run")]


@pytest.mark.process
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_passes_the_wheels_and_the_budget():
    """make gpu-check WHEELS=DIR hands DIR to the command, which installs the missing packages and nvidia-dali
    from it (test_dali_is_installed_from_its_wheel_for_torch_s_cuda)."""
    proc = subprocess.run(["make", "-s", "--no-print-directory", "-n", "gpu-check", "WHEELS=wheels", "BUDGET=420",
                           "PYTHON=python3"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "python3 scripts/gpu_check.py --wheels wheels --budget-s 420", proc.stdout
