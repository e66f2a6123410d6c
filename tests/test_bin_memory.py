"""bench/bin_memory.py end to end at a tiny size: it runs and reports what it promises. No bound on the
ratio is asserted here (a few pages of noise are a large fraction of 40 images); `load_bin` holding one
uint8 copy of the images is what the structural assertions check."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

IMAGES = 40


@pytest.mark.process
@pytest.mark.timeout(90)
def test_bin_memory_bench_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, "bench/bin_memory.py", "--images", str(IMAGES), "--json",
                           str(tmp_path / "m.json")], cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, rule, row = proc.stdout.strip().splitlines()
    assert header.startswith("| images |") and "resident / copy" in header and rule.startswith("|---")
    result = json.loads((tmp_path / "m.json").read_text())
    copy = IMAGES * 3 * 112 * 112
    assert result["images"] == IMAGES and result["pairs"] == IMAGES // 2 and result["copy_bytes"] == copy
    assert result["tensor_bytes"] == copy  # what load_bin returns: the images once, no mirrored copy
    assert result["ratio"] == result["resident_growth_bytes"] / copy and result["target"] == 1.15
    assert f"**{result['ratio']:.3f}**" in row and row.startswith(f"| {IMAGES} |")
    assert result["rss_after_bytes"] > 0 and result["peak_growth_bytes"] > 0


@pytest.mark.process
def test_bin_memory_bench_refuses_an_odd_image_count(tmp_path):
    proc = subprocess.run([sys.executable, "bench/bin_memory.py", "--images", "41"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--images must be even and >= 4" in proc.stderr
