"""bench/loader.py's figures: the decode loop beside the loaders, ratios per round, medians with (min-max).

Structure only, never timing: the machine running the tests is shared.
"""
from __future__ import annotations

import pytest

from bench.loader import NUM_CLASSES, run, synthetic_items, table
from dataset.recordio import write_insightface_rec


@pytest.mark.timeout(60)
def test_decode_loop_and_ratios_per_round(tmp_path):
    write_insightface_rec(tmp_path, synthetic_items(16), NUM_CLASSES)
    result = run(tmp_path, workers=0, batch_size=4, num_images=8, repeats=2)
    assert result["repeats"] == 2 and len(result["rounds"]) == 2 and result["dataset_images"] == 16
    for r in result["rounds"]:  # workers=0: one core, so per core is the rate itself
        assert r["ours_per_core_over_decode_loop"] == r["ours_images_per_s"] / r["decode_loop_images_per_s"]
        assert r["baseline_per_core_over_decode_loop"] == r["baseline_images_per_s"] / r["decode_loop_images_per_s"]
        assert r["speedup"] == r["ours_images_per_s"] / r["baseline_images_per_s"]
    for key, spread in result["spread"].items():
        values = [r[key] for r in result["rounds"]]
        assert spread == {"median": sum(values) / 2, "min": min(values), "max": max(values)}, key
        assert result[key] == spread["median"] > 0, key
    lines = table(result).splitlines()
    assert lines[0].endswith("| per core / decode loop |") and lines[2].startswith("| decode loop (")
    loop = result["spread"]["ours_per_core_over_decode_loop"]
    assert f"| {loop['median']:.2f} ({loop['min']:.2f}-{loop['max']:.2f}) |" in lines[3]
