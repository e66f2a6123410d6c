"""Benchmarks: the memory plan against a measured peak, and head/loader scripts end to end at tiny sizes.

No timing is asserted (the machine is shared); only that the scripts run and report what they promise.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.head import HeadConfig, head_rank, summarise
from bench.local_ranks import run_on_local_ranks
from bench.plan import predict

ROOT = Path(__file__).resolve().parents[1]
CLASSES, D, B = 200_000, 128, 64
CASES = [(rate, opt) for rate in (0.1, 1.0) for opt in ("sgd", "adamw")]


def _measure(rank: int, world: int, rate: float, opt: str) -> int:
    """Peak memory (bytes) of one case, measured as bench/head.py does."""
    return head_rank(rank, world, HeadConfig(CLASSES, rate, B, D, opt, repeats=2, warmup=1, floor=False))[
        "peak_mem_bytes"]


@pytest.mark.process
@pytest.mark.timeout(200)
def test_plan_predicts_measured_peak_within_5_percent():
    """The model of bench/plan.py against the RSS high-water mark of bench/head.py's steps on one rank. 5 %: at
    sample rate 1 the head's backward releases the cosines and their exponentials (half a shard each here) down to
    one before the weight's gradient (a whole shard) is allocated; holding both would be 14 % above the plan.
    Each case runs in a fresh process: memory an earlier case freed, still resident, would hide a later one's."""
    for rate, opt in CASES:
        peak = run_on_local_ranks(_measure, 1, rate, opt, timeout=60)[0]
        plan = predict(CLASSES, 1, rate, D, B, opt)
        assert abs(peak - plan.peak_bytes) <= 0.05 * plan.peak_bytes, (
            f"sample_rate={rate} {opt}: measured {peak / 2**20:.1f} MiB, predicted {plan.peak_bytes / 2**20:.1f} MiB "
            f"({plan.phases})")


# (classes, sample rate, D, B, optimizer, the phase the plan says dominates): the (N, C) tensors and their half copy
# (backward), the dense weight gradient beside its half product and the half rows (backward at R = 1, the shard far
# above the (N, C) tensors), and AdamW's sampled update, which no half copy reaches (optimizer).
HALF_CASES = [(200_000, 0.1, 16, 512, "sgd", "backward"), (100_000, 1.0, 128, 8, "sgd", "backward"),
              (200_000, 0.1, 64, 16, "adamw", "optimizer")]


def _measure_case(rank: int, world: int, classes: int, rate: float, dim: int, batch: int, opt: str, dtype: str) -> int:
    """Peak memory (bytes) of one case under autocast of ``dtype``, measured as bench/head.py does."""
    cfg = HeadConfig(classes, rate, batch, dim, opt, dtype=dtype, repeats=1, warmup=1, floor=False)
    return head_rank(rank, world, cfg)["peak_mem_bytes"]


@pytest.mark.process
@pytest.mark.timeout(150)
def test_plan_predicts_measured_peak_in_half_precision_within_10_percent(monkeypatch):
    """bench/plan.py's bf16 and fp16 model against the RSS high-water mark of bench/head.py's steps under the
    trainer's autocast, on one rank, each case in a fresh process. The plan is the CPU's (``device="cpu"``: fp16's
    unit rows pass through an fp32 temporary there). glibc's mmap threshold is fixed for the ranks: by default it
    rises to the size of the first large block freed, after which freed blocks up to that size stay resident in
    the heap, and the resident set then carries one (N, C) half copy or more of memory no tensor holds (up to 18 %
    above the plan at the first case, a case the plan and the tensors' bytes meet within 0.1 %)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # glibc's default, fixed
    for classes, rate, dim, batch, opt, phase in HALF_CASES:
        for dtype in ("bf16", "fp16"):
            peak = run_on_local_ranks(_measure_case, 1, classes, rate, dim, batch, opt, dtype, timeout=60)[0]
            plan = predict(classes, 1, rate, dim, batch, opt, dtype, device="cpu")
            case = f"{classes} classes R={rate} D={dim} B={batch} {opt} {dtype}"
            assert max(plan.phases, key=plan.phases.get) == phase, (case, plan.phases)
            assert abs(peak - plan.peak_bytes) <= 0.10 * plan.peak_bytes, (
                f"{case}: measured {peak / 2**20:.1f} MiB, predicted {plan.peak_bytes / 2**20:.1f} MiB ({plan.phases})")


def test_plan_components_follow_the_shapes():
    sgd, adamw = predict(1000, 2, 0.1, 8, 4, "sgd"), predict(1000, 2, 0.1, 8, 4, "adamw")
    assert sgd.num_local == 500 and sgd.num_sampled == 50 and sgd.shard_bytes == 500 * 8 * 4
    assert sgd.components["weights"] == sgd.components["optimizer_state"] == 500 * 8 * 4
    assert adamw.components["optimizer_state"] == 2 * 500 * 8 * 4 + 500 * 4
    assert sgd.components["logits_and_grad"] == 2 * 8 * 50 * 4  # the cosines and their exponentials, later g
    assert sgd.components["optimizer_work"] == 50 * 8 * 4  # the sampled rows' weights, then their momentum
    assert predict(1000, 2, 1.0, 8, 4).components["sampling_index"] == 0
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        predict(1000, 2, 0.1, 8, 4, "lamb")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        predict(1000, 2, 0.1, 8, 4, dtype="fp8")


def test_plan_half_precision_adds_the_half_copies():
    """bf16 and fp16 allocate alike on a GPU: half of an (N, C) block as the backward's left operand beside the two
    fp32 blocks, the rows' half copy, and a fresh fp32 weight gradient beside the gathered rows; the CPU's fp16 also
    computes the unit rows in fp32 before the cast."""
    fp32, bf16, fp16 = (predict(1000, 2, 0.1, 8, 6, dtype=dtype) for dtype in ("fp32", "bf16", "fp16"))
    assert bf16.as_dict() == fp16.as_dict()
    block, rows = 12 * 50 * 4, 50 * 8 * 4  # (N, C) fp32; (C, D) fp32
    assert bf16.components["logits_and_grad"] - fp32.components["logits_and_grad"] == block // 2
    assert bf16.components["sampled_rows_and_grad"] == 2 * fp32.components["sampled_rows_and_grad"] == 2 * rows
    assert bf16.phases["forward"] == fp32.phases["forward"] and bf16.phases["optimizer"] == fp32.phases["optimizer"]
    assert bf16.phases["backward"] - fp32.phases["backward"] == block // 2 + rows // 2
    cpu = predict(1000, 2, 0.1, 8, 6, dtype="fp16", device="cpu")
    assert cpu.phases["backward"] - fp16.phases["backward"] == rows
    assert predict(1000, 2, 0.1, 8, 6, dtype="bf16", device="cpu").as_dict() == bf16.as_dict()


def test_plan_compile_head_adds_the_compiled_graphs_buffers():
    """compile_head: two (N, C) fp32 buffers beside the cosines and the exponentials in the forward (4 blocks), one
    in the backward (3 blocks, or the eager backward where that is more); the other phases as the eager head's."""
    for rate, dtype in ((0.1, "fp32"), (1.0, "fp32"), (0.1, "bf16")):
        eager, compiled = (predict(1000, 2, rate, 8, 6, dtype=dtype, compile_head=c) for c in (False, True))
        block = 12 * compiled.num_sampled * 4  # one (N, C) fp32 tensor
        assert compiled.components["compiled_buffers"] == 2 * block and eager.components["compiled_buffers"] == 0
        assert compiled.phases["forward"] - eager.phases["forward"] == 2 * block
        base = eager.phases["backward"] - eager.phases["forward"]  # the eager backward's (N, C) part beyond 2 blocks
        assert compiled.phases["backward"] - compiled.phases["forward"] == max(base, block) - 2 * block
        assert {k: compiled.phases[k] for k in ("sampling", "optimizer")} == {
            k: eager.phases[k] for k in ("sampling", "optimizer")}


def _measure_compiled(rank: int, world: int, classes: int, rate: float, dim: int, batch: int) -> int:
    """Peak memory (bytes) of the head with compile = True, measured as bench/head.py does."""
    cfg = HeadConfig(classes, rate, batch, dim, "sgd", repeats=1, warmup=2, floor=False, compile=True)
    return head_rank(rank, world, cfg)["compiled"]["peak_mem_bytes"]


@pytest.mark.process
@pytest.mark.timeout(300)
def test_plan_predicts_the_compiled_head_s_peak_within_10_percent(monkeypatch):
    """bench/plan.py --compile-head against the compiled head's RSS high-water mark on one CPU rank (Inductor's C++),
    at a shape where the (N, C) tensors dominate: the compiled forward holds four of them (the eager one two).
    make gpu-check judges the same model on a GPU (Triton)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # as in the half-precision test above
    classes, rate, dim, batch = 64_000, 1.0, 16, 2048
    peak = run_on_local_ranks(_measure_compiled, 1, classes, rate, dim, batch, timeout=280)[0]
    plan = predict(classes, 1, rate, dim, batch, device="cpu", compile_head=True)
    eager = predict(classes, 1, rate, dim, batch, device="cpu")
    assert plan.peak_bytes - eager.peak_bytes == 2 * batch * classes * 4
    assert abs(peak - plan.peak_bytes) <= 0.10 * plan.peak_bytes, (
        f"measured {peak / 2**20:.1f} MiB, predicted {plan.peak_bytes / 2**20:.1f} MiB ({plan.phases})")


def _run_script(args: list[str], out: Path, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, *args, "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "|" in proc.stdout  # the markdown table
    return json.loads(out.read_text())


@pytest.mark.process
@pytest.mark.timeout(90)
def test_head_bench_end_to_end(tmp_path):
    result = _run_script(["bench/head.py", "--num-classes", "2000", "--sample-rate", "0.5", "--world-size", "2",
                          "--batch-size", "8", "--embedding-size", "16", "--repeats", "2", "--warmup", "1",
                          "--dtype", "bf16"], tmp_path / "head.json", timeout=80)
    for key in ("step_s", "floor_s", "ratio", "peak_mem_bytes", "shard_bytes", "step", "floor"):
        assert key in result, sorted(result)
    assert result["config"]["dtype"] == "bf16"
    assert result["ratio"] > 0 and result["shard_bytes"] == 1000 * 16 * 4
    assert result["step"]["min_s"] <= result["step_s"] <= result["step"]["max_s"]
    assert len(result["ranks"]) == 2 and len(result["pair_ratios"]) == 2 and result["rank0_ratio"] > 0
    for rank in result["ranks"]:
        assert len(rank["step_samples"]) == len(rank["floor_samples"]) == 2
        assert max(rank["floor_samples"]) <= result["floor"]["max_s"]  # the job floor: each repeat's slowest rank


@pytest.mark.process
@pytest.mark.timeout(240)
def test_head_bench_times_the_compiled_head_beside_the_eager_one(tmp_path):
    """``--compile``: the compiled head's ratio, memory and compile seconds, in columns beside the eager ones."""
    args = ["bench/head.py", "--num-classes", "2000", "--sample-rate", "0.5", "--world-size", "2", "--batch-size", "8",
            "--embedding-size", "16", "--repeats", "2", "--warmup", "1", "--compile"]
    out = tmp_path / "head.json"
    proc = subprocess.run([sys.executable, *args, "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = proc.stdout.splitlines()[0]
    for column in ("eager step/floor", "compiled step/floor", "compiled peak/shard", "compile s"):
        assert column in header, header
    compiled = json.loads(out.read_text())["compiled"]
    assert compiled["ratio"] > 0 and len(compiled["pair_ratios"]) == 2 and compiled["compile_s"] > 0
    assert compiled["step"]["min_s"] <= compiled["step_s"] <= compiled["step"]["max_s"]


def test_head_ratio_takes_each_repeats_slowest_rank():
    # Lockstep ranks: a repeat's step ends with its slowest rank, so its floor is the slowest rank's products.
    def rank(steps, floors):
        return {"step": {"median_s": sorted(steps)[1]}, "floor": {"median_s": sorted(floors)[1]},
                "step_samples": steps, "floor_samples": floors, "peak_mem_bytes": 30, "shard_bytes": 10,
                "num_local": 5, "num_sampled": 2}

    ranks = [rank([1.2, 1.4, 1.3], [1.0, 0.8, 1.0]), rank([1.25, 1.35, 1.3], [1.0, 1.2, 0.9])]
    result = summarise(HeadConfig(10, 0.5, 4), 2, ranks)
    assert result["floor"]["median_s"] == 1.0 and result["floor"]["max_s"] == 1.2  # max per repeat: 1.0, 1.2, 1.0
    assert result["step"]["median_s"] == 1.3 and result["step"]["max_s"] == 1.4  # 1.25, 1.4, 1.3
    assert result["ratio"] == pytest.approx(1.3)
    assert result["pair_ratios"] == pytest.approx([1.25, 1.4 / 1.2, 1.3])
    assert result["rank0_ratio"] == pytest.approx(1.3 / 1.0) and result["peak_over_shard"] == 3.0


@pytest.mark.process
@pytest.mark.timeout(90)
def test_loader_bench_end_to_end(tmp_path):
    result = _run_script(["bench/loader.py", "--workers", "1", "--batch-size", "8", "--images", "32"],
                         tmp_path / "loader.json", timeout=80)
    for key in ("ours_images_per_s", "ours_images_per_s_per_core", "baseline_images_per_s", "speedup"):
        assert result[key] > 0, (key, result)
    assert result["rec"] == "generated" and result["dataset_images"] == 32


@pytest.mark.process
@pytest.mark.timeout(200)
def test_prepare_faces_bench_end_to_end(tmp_path):
    """bench/prepare_faces.py on a few small photos: photos/s end to end and each stage's time per photo, beside
    the earlier canvas's detection."""
    pytest.importorskip("facenet_pytorch")
    pytest.importorskip("skimage")
    result = _run_script(["bench/prepare_faces.py", "--sizes", "small", "--photos", "4", "--repeats", "1",
                          "--workers", "0", "--device", "cpu"], tmp_path / "prepare.json", timeout=180)
    small = result["results"]["small"]
    assert small["photos"] == 4 and small["min"] <= small["photos_per_s"] <= small["max"]
    assert small["summary"].startswith("prepare_faces: 4 photos: 4 kept"), small["summary"]
    for key in ("cpu_s_per_photo", "read_s", "detect_s", "align_s", "detect_640_canvas_s"):
        assert small[key] > 0, (key, small)
    assert result["config"]["device"] == "cpu" and len(result["config"]["load_average"]) == 3


@pytest.mark.process
def test_plan_cli_json(tmp_path):
    result = _run_script(["bench/plan.py", "--num-classes", "29000000", "--gpus", "8", "--sample-rate", "0.1",
                          "--embedding-size", "512", "--batch-size", "128", "--dtype", "fp16"], tmp_path / "plan.json",
                         timeout=60)
    plan = result["plan"]
    assert plan["num_local"] == 3_625_000 and plan["peak_bytes"] == max(plan["phases"].values())
    assert result["config"]["dtype"] == "fp16" and result["config"]["device"] == "cuda"
    assert plan["peak_bytes"] == predict(29_000_000, 8, 0.1, 512, 128, dtype="fp16").peak_bytes


def test_the_29m_figures_readme_and_docs_state():
    """README and docs/partial_fc.md: 29M identities on 8 GPUs, D = 512, B = 128, R = 0.1, SGD: the head plans
    17.3 GiB per GPU in fp32 and 18.3 GiB in bf16 and fp16."""
    figures = {dtype: round(predict(29_000_000, 8, 0.1, 512, 128, "sgd", dtype).peak_bytes / 2**30, 1)
               for dtype in ("fp32", "bf16", "fp16")}
    assert figures == {"fp32": 17.3, "bf16": 18.3, "fp16": 18.3}
    readme = (ROOT / "README.md").read_text()
    assert "17.3 GiB per GPU in fp32 and 18.3 GiB in bf16/fp16" in " ".join(readme.split())
