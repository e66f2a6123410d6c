"""CUDA checks (``pytest -m cuda``; ``make gpu-check`` runs them): what only a GPU can show.

The CPU suite collects and skips them. Each compares the CUDA path with the CPU result or checks a
property the CPU proxies (tests/test_op_counts.py, tests/test_step.py) can only argue for: the head on CUDA
equals the CPU head (fp32 to 1e-5, bf16 within 2e-2, fp16 within 1e-2), a head step synchronises with the host
exactly as often as counted on the CPU, two gloo ranks with CUDA tensors train like one process, a 1-rank NCCL
group trains through train.py, fp16 (loss scaler) and bf16 steps run and skip together, checkpoints hold CPU
tensors, and the CUDA prefetch loader gives the CPU loader's batches (DALI's: tests/test_dali.py).
"""
from __future__ import annotations

import subprocess
import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check runs these)"),
    pytest.mark.timeout(300),
]

D, CLASSES = 128, 20_000


def _head_step(device: str, rate: float, dtype: torch.dtype | None):
    """Loss and gradients of one head step from fixed seeds on ``device`` (full fp32 products: no TF32)."""
    from losses import ArcFace
    from partial_fc import PartialFC

    torch.manual_seed(0)
    head = PartialFC(ArcFace(s=32.0, margin=0.4), D, CLASSES, sample_rate=rate).to(device)
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(512, D, generator=g).to(device).requires_grad_()
    labels = torch.randint(0, CLASSES, (512,), generator=g).to(device)
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        with torch.autocast(torch.device(device).type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = head(emb, labels)
        loss.backward()
    finally:  # the switch is process-wide: later tests get it as they found it
        torch.backends.cuda.matmul.allow_tf32 = tf32
    grad = head.weight.grad.to_dense() if head.weight.grad.is_sparse else head.weight.grad
    return float(loss.detach()), emb.grad.cpu(), grad.cpu()


def test_the_head_is_initialised_on_the_gpu_the_same_for_every_world_size():
    """init_rows on CUDA: made on the device (no host copy), normal(0, 0.01), a class's centre the same whatever
    shard holds it; PartialFC(device="cuda") puts its weight there."""
    from losses import ArcFace
    from partial_fc import PartialFC
    from partial_fc.sharding import init_rows

    full = init_rows(4, 0, 3000, 8, "cuda")
    assert full.is_cuda and abs(float(full.std()) - 0.01) < 1e-3
    assert torch.equal(init_rows(4, 1017, 1500, 8, "cuda"), full[1017:2517])
    head = PartialFC(ArcFace(), 8, 3000, device="cuda")
    assert head.weight.is_cuda and torch.equal(head.weight.detach(), full)


@pytest.mark.parametrize("rate", [1.0, 0.1])
def test_head_on_cuda_equals_the_cpu_head(rate):
    cpu = _head_step("cpu", rate, None)
    for dtype, tol in ((None, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 1e-2)):
        gpu = _head_step("cuda", rate, dtype)
        assert abs(gpu[0] - cpu[0]) <= tol * max(1.0, abs(cpu[0])), (dtype, gpu[0], cpu[0])
        for got, want in zip(gpu[1:], cpu[1:]):
            if dtype is None:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            else:
                assert (got - want).norm() <= tol * want.norm(), (dtype, float((got - want).norm()))


@pytest.mark.parametrize("classes, expected", [(1_000_000, 1), (5_000, 2)])
def test_a_head_step_synchronises_exactly_as_counted(classes, expected):
    """The host synchronisations of one head step (forward, backward, SGD update, zero_grad), counted by CUDA's
    sync debug mode: 1 (the gathered batch sizes and label checks), and a second only where the positives can
    outnumber the sample (1,024 samples, 10 % of 5,000 classes), as tests/test_op_counts.py counts on the CPU."""
    from losses import CosFace
    from partial_fc import PartialFC, build_head_optimizer

    torch.manual_seed(0)
    head = PartialFC(CosFace(), D, classes, sample_rate=0.1, device="cuda")
    opt = build_head_optimizer(head, "sgd", lr=0.1)
    emb = torch.randn(1024, D, device="cuda", requires_grad=True)
    labels = torch.randint(0, classes, (1024,), device="cuda")
    head(emb, labels).backward()  # warm-up: lazy CUDA initialisations synchronise once
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            head(emb, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == expected, syncs


def test_two_gloo_ranks_with_cuda_tensors_train_like_one_process():
    """NCCL cannot put two ranks on one GPU, so two gloo ranks share it: DDP, the head's gather and its early
    reduce-scatter, and the skip decision's all-reduce on CUDA tensors give one process's result (fp32, 1e-5)."""
    from bench.local_ranks import run_on_local_ranks
    from tests.test_step import check_ranks_train_like_one_process, ranks_train_like_one_process

    one = run_on_local_ranks(ranks_train_like_one_process, 1, 2, "cuda")[0]
    check_ranks_train_like_one_process(one, run_on_local_ranks(ranks_train_like_one_process, 2, 2, "cuda"))


def test_two_gloo_ranks_with_cuda_tensors_skip_together_and_compress_in_fp16():
    """A non-finite gradient on one rank skips both optimizers on both (fp16 scaler, bf16, fp32), and with
    fp16 = True DDP's all-reduce carries fp16 values, on CUDA tensors."""
    from bench.local_ranks import run_on_local_ranks
    from tests.test_step import _all_cases, _wire_precision, check_skip_decisions

    check_skip_decisions(run_on_local_ranks(_all_cases, 2, "cuda"))
    assert run_on_local_ranks(_wire_precision, 2, True, "cuda") == [True, True]
    assert run_on_local_ranks(_wire_precision, 2, False, "cuda") == [False, False]


def test_one_rank_nccl_group_trains_through_train_py(tmp_path):
    from tests.helpers import ROOT, subprocess_env, torchrun_command

    cmd = [*torchrun_command(1), "train.py", "configs/debug_cpu", "--set", f"output={tmp_path}", "device=cuda",
           "max_steps=20", "frequent=5"]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "training.log").read_text()
    assert "backend nccl" in log and "device cuda:0" in log, log[:2000]
    assert "step 20/20" in log
    weights = torch.load(tmp_path / "model.pt", weights_only=True)  # no map_location: as on a machine without a GPU
    assert {v.device.type for v in weights.values()} == {"cpu"}
    # Every file of the step checkpoints too (the optimizer states, the head shard, the RNG): CPU tensors only.
    from utils.checkpoint import find_latest

    devices = set()

    def collect(obj):
        if isinstance(obj, torch.Tensor):
            devices.add(obj.device.type)
        elif isinstance(obj, dict):
            for value in obj.values():
                collect(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                collect(value)

    for path in find_latest(tmp_path).glob("*.pt"):
        collect(torch.load(path, weights_only=True))
    assert devices == {"cpu"}, devices


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_mixed_precision_trainer_steps_on_cuda(dtype):
    from tests.helpers import check_mixed_precision_steps, mixed_precision_steps

    check_mixed_precision_steps(mixed_precision_steps(dtype, "cuda"), dtype)


def test_cuda_prefetch_loader_gives_the_cpu_batches():
    from dataset import SyntheticDataset, get_dataloader

    data = SyntheticDataset(10, 64, seed=3)
    out = {}
    for device in ("cpu", "cuda"):
        loader = get_dataloader(data, 8, rank=0, world_size=1, seed=5, num_workers=2, device=device)
        loader.set_epoch(1, start_step=2)
        out[device] = [(x.cpu(), y.cpu()) for x, y in loader]
    assert len(out["cpu"]) == len(out["cuda"]) == 6
    for (xc, yc), (xg, yg) in zip(out["cpu"], out["cuda"]):
        assert torch.equal(yc, yg) and torch.equal(xc, xg)


def test_compiled_backbone_trains_on_cuda(tmp_path):
    from tests.helpers import train

    proc = train("configs/debug_cpu", tmp_path, "device=cuda", "compile=true", "max_steps=6", "frequent=3")
    assert "step 6/6" in (tmp_path / "training.log").read_text(), proc.stdout[-2000:]
