"""scripts/gpu_check.py on a machine without CUDA, and the parts of its report that need no GPU."""
from __future__ import annotations

import subprocess
import sys

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
    log = "\n".join(f"12:00:00 INFO step {s}/300 epoch 0 | loss {30 - s / 20:.4f} | lr 0.1" for s in range(10, 301, 10))
    fp16 = log + "\n12:00:00 WARNING step 3: non-finite backbone gradients (loss 31.2); update ...\n" \
                 "12:00:00 INFO done: 300 steps, 1 skipped for a non-finite loss or gradient; model at x"
    parsed = gpu_check.parse_training_log(fp16)
    assert parsed["steps"] == 300 and parsed["skipped_at"] == [3] and len(parsed["losses"]) == 30
    assert gpu_check.judge_training(parsed, "fp16")[0]  # a skip while the loss scale settles
    assert not gpu_check.judge_training(parsed, "bf16")[0]  # bf16 has no scale to settle
    rising = "\n".join(f"INFO step {s}/300 epoch 0 | loss {10 + s / 20:.4f} | lr 0.1" for s in range(10, 301, 10))
    rising = gpu_check.parse_training_log(rising + "\nINFO done: 300 steps, 0 skipped")
    assert not gpu_check.judge_training(rising, "bf16")[0]
    assert not gpu_check.judge_training(gpu_check.parse_training_log("done: 120 steps, 0 skipped"), "bf16")[0]
    # After settling, fp16 may overflow once per growth of its scale (every 100 good steps), not twice in a row.
    for skipped_at, ok in (([3, 5, 125], True), ([3, 125, 240], True), ([3, 125, 126], False), ([125, 126], False),
                           ([40, 90], False), ([50], False), ([101], True), ([3, 60], False)):
        assert gpu_check.judge_training({**parsed, "skipped_at": skipped_at}, "fp16")[0] == ok, skipped_at
    from utils.precision import LossScaler

    assert LossScaler(True).growth_interval == gpu_check.FP16_GROWTH_INTERVAL  # the trainer's scaler


def test_pytest_summary_and_report():
    assert gpu_check.pytest_summary("....\n7 passed, 1 skipped in 30.2s\n") == {"passed": 7, "skipped": 1}
    assert gpu_check.pytest_summary("F.\n1 failed, 1 passed, 2 errors in 3s") == {"failed": 1, "passed": 1, "error": 2}
    report = {"date": "2026-11-30 12:00", "seconds": 400.0,
              "environment": {"gpu": "1 x NVIDIA H200 (139 GiB)", "torch": "2.11.0", "cuda": "13.0", "python": "3.12"},
              "checks": [{"name": "pytest -m cuda", "passed": True, "detail": "{'passed': 9}", "log_tail": ""},
                         {"name": "train 300 steps fp16", "passed": False, "detail": "loss 7 -> 9", "log_tail": "boom"}],
              "backbones": [{"network": "r50", "compile": False, "train_images_per_s": 5400.0, "train_tflops": 102.0,
                             "mfu_measured": 0.15}],
              "head": None}
    md = gpu_check.render(report)
    assert "| pytest -m cuda | PASS |" in md and "| train 300 steps fp16 | FAIL | loss 7 -> 9 |" in md
    assert "| r50 | bf16 | 5400 | 102.0 | 15.0% |" in md and "**1 of 2 checks passed.**" in md and "boom" in md
