"""bench/loader.py's figures: the decode loop beside the loaders, ratios per round, medians with (min-max).

Structure and arithmetic only, never the machine's timing: the benchmark's clock is replaced by one that
gives each timed pipeline a chosen duration, so every figure has one right value.
"""
from __future__ import annotations

import itertools
import types

import pytest

import bench.loader
from bench.loader import NUM_CLASSES, run, synthetic_items, table
from dataset.recordio import write_insightface_rec


@pytest.mark.timeout(60)
def test_rates_ratios_and_medians_follow_the_clock(tmp_path, monkeypatch):
    """16 images, batch 4, 8 images per pipeline, workers=0 (one core: per core is the rate itself). The clock
    is read twice per pipeline (start, end): a warm-up of the decode loop, then per round the loop, ours and the
    baseline. Round 1 takes 1, 0.5, 2 s, round 2 takes 2, 1, 1 s: 8 images give the rates below."""
    write_insightface_rec(tmp_path, synthetic_items(16), NUM_CLASSES)
    durations = [1.0, 1.0, 0.5, 2.0, 2.0, 1.0, 1.0]  # warm-up, (loop, ours, baseline) x 2
    reads = iter(itertools.accumulate(d for duration in durations for d in (0.0, duration)))
    calls = []

    def clock() -> float:
        calls.append(None)
        return next(reads)

    monkeypatch.setattr(bench.loader, "time", types.SimpleNamespace(perf_counter=clock))
    result = run(tmp_path, workers=0, batch_size=4, num_images=8, repeats=2)
    assert len(calls) == 2 * len(durations)  # each pipeline timed once: start, end
    assert result["repeats"] == 2 and result["dataset_images"] == 16
    expected = [dict(decode_loop_images_per_s=8.0, ours_images_per_s=16.0, baseline_images_per_s=4.0,
                     ours_per_core_over_decode_loop=2.0, baseline_per_core_over_decode_loop=0.5, speedup=4.0),
                dict(decode_loop_images_per_s=4.0, ours_images_per_s=8.0, baseline_images_per_s=8.0,
                     ours_per_core_over_decode_loop=2.0, baseline_per_core_over_decode_loop=2.0, speedup=1.0)]
    assert result["rounds"] == expected
    for key in expected[0]:
        values = [r[key] for r in expected]
        assert result["spread"][key] == {"median": sum(values) / 2, "min": min(values), "max": max(values)}, key
        assert result[key] == sum(values) / 2, key
    lines = table(result).splitlines()
    assert lines[0].endswith("| per core / decode loop |") and lines[2].startswith("| decode loop (")
    assert "| 6 (4-8) |" in lines[2] and "| 12 (8-16) | 12 (8-16) | 2.00 (2.00-2.00) |" in lines[3], lines
    assert "| 6 (4-8) | 6 (4-8) | 1.25 (0.50-2.00) |" in lines[4] and "2.50 (1.00-4.00)x" in lines[5], lines
