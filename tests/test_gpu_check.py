"""scripts/gpu_check.py on a machine without CUDA, and the parts of its report that need no GPU."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import gpu_check
from tests.helpers import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs for real")
@pytest.mark.timeout(60)
def test_without_cuda_it_says_so_in_one_line_and_exits_1(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 1
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no CUDA device" in proc.stderr
    assert not (tmp_path / "report.md").exists()


def test_missing_packages_are_named_by_their_pip_names(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "NEEDED", {"json": "json", "no_such_module_xyz": "no-such-package"})
    missing, note = gpu_check.install_missing(None, tmp_path / "site")
    assert missing == ["no-such-package"]
    assert "pip download --no-deps no-such-package -d wheels" in note and "--wheels" in note
    missing, note = gpu_check.install_missing(tmp_path, tmp_path / "site")  # an empty folder: pip finds nothing
    assert missing == ["no-such-package"] and "could not install ['no-such-package']" in note
    monkeypatch.setattr(gpu_check, "NEEDED", {"json": "json"})
    assert gpu_check.install_missing(None, tmp_path / "site") == ([], "all present")


def test_training_log_judgement():
    n = gpu_check.TRAIN_STEPS
    log = "\n".join(f"12:00:00 INFO step {s}/{n} epoch 0 | loss {30 - s / 20:.4f} | lr 0.1" for s in range(10, n + 1, 10))
    fp16 = log + "\n12:00:00 WARNING step 3: non-finite backbone gradients (loss 31.2); update ...\n" \
                 f"12:00:00 INFO done: {n} steps, 1 skipped for a non-finite loss or gradient; model at x"
    parsed = gpu_check.parse_training_log(fp16)
    assert parsed["steps"] == n and parsed["skipped_at"] == [3] and len(parsed["losses"]) == n // 10
    assert gpu_check.judge_training(parsed, "fp16")[0]  # a skip while the loss scale settles
    assert not gpu_check.judge_training(parsed, "bf16")[0]  # bf16 has no scale to settle
    rising = "\n".join(f"INFO step {s}/{n} epoch 0 | loss {10 + s / 20:.4f} | lr 0.1" for s in range(10, n + 1, 10))
    rising = gpu_check.parse_training_log(rising + f"\nINFO done: {n} steps, 0 skipped")
    assert not gpu_check.judge_training(rising, "bf16")[0]
    assert not gpu_check.judge_training(gpu_check.parse_training_log("done: 120 steps, 0 skipped"), "bf16")[0]
    # After settling, fp16 may overflow once per growth of its scale (every 100 good steps), not twice in a row.
    for skipped_at, ok in (([3, 5, 125], True), ([3, 125, 240], True), ([3, 125, 126], False), ([125, 126], False),
                           ([40, 90], False), ([50], False), ([101], True), ([3, 60], False)):
        assert gpu_check.judge_training({**parsed, "skipped_at": skipped_at}, "fp16")[0] == ok, skipped_at
    from utils.precision import LossScaler

    assert LossScaler(True).growth_interval == gpu_check.FP16_GROWTH_INTERVAL  # the trainer's scaler


def test_pytest_summary_and_per_test_results():
    assert gpu_check.pytest_summary("....\n7 passed, 1 skipped in 30.2s\n") == {"passed": 7, "skipped": 1}
    assert gpu_check.pytest_summary("F.\n1 failed, 1 passed, 2 errors in 3s") == {"failed": 1, "passed": 1, "error": 2}
    summary = """=========================== short test summary info ============================
PASSED tests/test_cuda.py::test_head_on_cuda_equals_the_cpu_head[1.0]
SKIPPED [1] tests/test_cuda.py:180: nvidia-dali is not installed (optional)
FAILED tests/test_cuda.py::test_a_head_step_synchronises_exactly_as_counted[5000-2] - AssertionError: ['a', 'b', 'c']
ERROR tests/test_cuda.py::test_compiled_backbone_trains_on_cuda - RuntimeError: boom
1 failed, 1 passed, 1 skipped, 1 error in 20.1s"""
    assert gpu_check.pytest_results(summary) == [
        ("PASS", "tests/test_cuda.py::test_head_on_cuda_equals_the_cpu_head[1.0]", ""),
        ("SKIP", "tests/test_cuda.py:180", "nvidia-dali is not installed (optional)"),
        ("FAIL", "tests/test_cuda.py::test_a_head_step_synchronises_exactly_as_counted[5000-2]",
         "AssertionError: ['a', 'b', 'c']"),
        ("FAIL", "tests/test_cuda.py::test_compiled_backbone_trains_on_cuda", "RuntimeError: boom")]


def _fake_gpu(monkeypatch, tmp_path, seconds: dict[str, float], fail: set[str] = frozenset()) -> list[list[str]]:
    """main() on a pretend one-GPU machine: every command returns at once with what the real one writes, after
    ``seconds[kind]`` on a pretend clock; ``fail`` names the kinds that exit 1. Returns the commands run."""
    import types

    clock = [0.0]
    ran: list[list[str]] = []
    monkeypatch.setattr(gpu_check, "time", types.SimpleNamespace(perf_counter=lambda: clock[0],
                                                                 strftime=lambda fmt: "2026-12-05 12:00"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="Pretend GPU", total_memory=80 * 2**30))
    monkeypatch.setattr(gpu_check, "install_missing", lambda wheels, site: ([], "all present"))
    real = gpu_check.run_command

    def run_command(cmd, timeout, env):
        if "bench/plan.py" in cmd:  # the real planner: it is quick and needs no GPU
            return real(cmd, timeout, env)
        kind = ("pytest" if "pytest" in cmd else "train" if "train.py" in cmd else "head" if "bench/head.py" in cmd
                else "backbone_compile" if "--compile" in cmd else "backbone")
        ran.append(cmd)
        clock[0] += min(seconds[kind], timeout)
        if seconds[kind] > timeout:
            return 124, f"(timed out after {timeout:.0f}s)", timeout
        if kind in fail:
            return 1, f"{kind} broke", seconds[kind]
        if kind == "pytest":
            return 0, "PASSED tests/test_cuda.py::test_a\nSKIPPED [1] tests/test_cuda.py:9: no DALI\n1 passed", 60.0
        out = Path(cmd[cmd.index("--json") + 1]) if "--json" in cmd else None
        if kind == "train":
            run_dir = Path(next(a for a in cmd if a.startswith("output="))[len("output="):])
            run_dir.mkdir(parents=True)
            steps = gpu_check.TRAIN_STEPS
            (run_dir / "training.log").write_text("\n".join(
                f"INFO step {k}/{steps} epoch 0 | loss {20 - k / 50:.3f} | lr 0.1" for k in range(10, steps + 1, 10))
                + f"\nINFO done: {steps} steps, 0 skipped")
        elif kind == "head":
            from bench.plan import predict

            peak = predict(5_000_000, 1, 0.1, 512, 512).peak_bytes * 1.03
            out.write_text(json.dumps({"config": {"num_classes": 5_000_000, "embedding_size": 512, "sample_rate": 0.1,
                                                  "batch_size": 512}, "step_s": 0.012, "floor_s": 0.010, "ratio": 1.2,
                                       "peak_mem_bytes": peak, "peak_over_shard": 2.3,
                                       "compiled": {"step_s": 0.011, "ratio": 1.1, "peak_mem_bytes": peak,
                                                    "peak_over_shard": 2.3}}))
        else:
            out.write_text(json.dumps({"backbone": {"network": "r50", "compile": kind == "backbone_compile",
                                                    "train_images_per_s": 5100.0, "train_tflops": 120.0,
                                                    "mfu_measured": 0.2, "bf16_matmul_tflops": 600.0}}))
        return 0, "ok", seconds[kind]

    monkeypatch.setattr(gpu_check, "run_command", run_command)
    return ran


SECONDS = {"pytest": 140, "train": 30, "head": 45, "backbone": 20, "backbone_compile": 85}


def test_every_check_is_reported_pass_fail_or_skip(tmp_path, monkeypatch):
    """The whole run on a pretend GPU: one line per pytest test, the training runs, the head against the plan,
    NCCL skipped on one GPU with its reason, the backbones as figures; within the budget; exit 0."""
    ran = _fake_gpu(monkeypatch, tmp_path, SECONDS)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {
        "packages": "PASS", "pytest test_a": "PASS", "pytest tests/test_cuda.py:9": "SKIP",
        f"train r50 {gpu_check.TRAIN_STEPS} steps fp16": "PASS", f"train r50 {gpu_check.TRAIN_STEPS} steps bf16": "PASS",
        "head step/floor (target <= 1.3)": "PASS", "head peak memory against bench/plan.py (within 10%)": "PASS",
        "train 2 ranks NCCL 20 steps fp16": "SKIP", "train 2 ranks NCCL 20 steps bf16": "SKIP",
        "backbone r50 bf16 channels-last": "PASS", "backbone r50 bf16 channels-last compile": "PASS"}, status
    assert report["seconds"] == sum(SECONDS.values()) + SECONDS["train"] <= gpu_check.BUDGET_S
    assert "tests/test_cuda.py" in ran[0]  # the files that hold CUDA tests, not the whole suite
    md = (tmp_path / "report.md").read_text()
    assert "**8 passed, 0 failed, 3 skipped.**" in md and "| head peak memory against bench/plan.py (within 10%) | PASS |" in md
    assert "(+3.0%)" in md and "| r50 | bf16 + compile | 5100 | 120.0 | 20.0% |" in md and "NCCL needs a GPU per rank" in md


def test_a_failed_check_fails_the_run_and_an_over_budget_one_is_skipped(tmp_path, monkeypatch):
    """A training run that exits 1 is a FAIL with its output; checks that no longer fit the budget are SKIPs that
    say what they needed; the exit code is 1."""
    _fake_gpu(monkeypatch, tmp_path, {**SECONDS, "pytest": 200, "head": 100}, fail={"train"})
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status[f"train r50 {gpu_check.TRAIN_STEPS} steps fp16"] == "FAIL"
    assert status["backbone r50 bf16 channels-last compile"] == "SKIP" and report["seconds"] <= gpu_check.BUDGET_S
    skipped = next(c for c in report["checks"] if c["name"] == "backbone r50 bf16 channels-last compile")
    assert "budget left; this check needs about 60 s" in skipped["detail"]
    md = (tmp_path / "report.md").read_text()
    assert "train broke" in md and "failed" in md


def test_report_renders_every_status():
    report = {"date": "2026-11-30 12:00", "seconds": 300.0, "budget_s": 360.0,
              "environment": {"gpu": "1 x NVIDIA H200 (139 GiB)", "torch": "2.11.0", "cuda": "13.0", "python": "3.12"},
              "checks": [{"name": "pytest test_x", "status": "PASS", "detail": "", "log_tail": ""},
                         {"name": "train 200 steps fp16", "status": "FAIL", "detail": "loss 7 -> 9", "log_tail": "boom"},
                         {"name": "train 2 ranks NCCL", "status": "SKIP", "detail": "one GPU", "log_tail": ""}],
              "backbones": [{"network": "r50", "compile": False, "train_images_per_s": 5400.0, "train_tflops": 102.0,
                             "mfu_measured": 0.15}],
              "head": None}
    md = gpu_check.render(report)
    assert "| pytest test_x | PASS |" in md and "| train 200 steps fp16 | FAIL | loss 7 -> 9 |" in md
    assert "| train 2 ranks NCCL | SKIP | one GPU |" in md and "300 s in all (budget 360 s)" in md
    assert "| r50 | bf16 | 5400 | 102.0 | 15.0% |" in md and "**1 passed, 1 failed, 1 skipped.**" in md and "boom" in md
