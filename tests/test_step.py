"""One decision per step for both optimizers (train.optimizer_step), in process on 1, 2 and 3 gloo ranks.

A non-finite value anywhere (the loss, one backbone gradient, the head's gradient on one rank) makes both
optimizers skip on every rank: weights, optimizer state and batch-norm statistics stay bit-identical, the
fp16 loss scale backs off once, and the skip counts towards max_nonfinite_steps. The same holds for bf16
(no scaler) and fp32. A finite step moves both. A rank whose loader left its batch with fewer than 2 samples
makes every rank skip the update (the loss scale and the non-finite count untouched), or stop with the line
naming the file. The step's one host read is its flags; the loop (train.train) reads the logged loss once per
progress line.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers import check_mixed_precision_steps, mixed_precision_steps, on_ranks, tiny_job
from trainer.run_state import TrainState

pytestmark = pytest.mark.timeout(120)

NUM_CLASSES, D = 12, 8


def _on(device: str) -> torch.device:
    """"cpu", or "cuda": the first GPU, which every local rank shares (gloo; tests/test_cuda.py)."""
    return torch.device("cuda", 0) if device == "cuda" else torch.device(device)


def _job(rank: int, world_size: int, *, fp16_scaler: bool = False, bf16: bool = False, overrides: tuple = (),
         device: str = "cpu"):
    """A trainer Job around a tiny backbone with batch norm and a sampled head (SGD with momentum)."""
    from losses import CosFace
    from partial_fc import PartialFC

    device = _on(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 16), nn.BatchNorm1d(16), nn.PReLU(16), nn.Linear(16, D))
    head = PartialFC(CosFace(s=8.0, m=0.2), D, NUM_CLASSES, 0.5, seed=1, device=device)
    return tiny_job(rank, world_size, ["num_classes=12", "sample_rate=0.5", "max_steps=10", "max_nonfinite_steps=5",
                                             *overrides],
                    model.to(device), head, fp16_scaler=fp16_scaler, init_scale=1024.0,
                    autocast_dtype=torch.bfloat16 if bf16 else None, device=device)


def _batch(rank: int, step: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * step + rank)
    images, labels = torch.randn(6, 3, 4, 4, generator=g), torch.randint(0, NUM_CLASSES, (6,), generator=g)
    return [(images.to(_on(device)), labels.to(_on(device)))]


def _snapshot(job) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in job.backbone.state_dict().items()}
    out["head.weight"] = job.head.weight.detach().clone()
    for name, opt in (("opt_backbone", job.opt_backbone), ("opt_head", job.opt_head)):
        for i, state in enumerate(opt.state.values()):
            for k, v in state.items():
                out[f"{name}.{i}.{k}"] = v.detach().clone()
    return out


def _poison_backbone(job, value: float):
    """A hook that turns one backbone gradient into `value` (before DDP's all-reduce)."""
    param = list(job.backbone.parameters())[1]
    return param.register_hook(lambda g: torch.full_like(g, value))


def _poison_head(job, value: float):
    """A hook that turns this rank's head gradient (sparse rows) into `value`."""
    def hook(g: torch.Tensor) -> torch.Tensor:
        g = g.coalesce()
        return torch.sparse_coo_tensor(g.indices(), torch.full_like(g.values(), value), g.shape,
                                       check_invariants=True).coalesce()

    return job.head.weight.register_hook(hook)


def _decisions(rank: int, world_size: int, where: str, value: float, fp16_scaler: bool, bf16: bool,
               device: str = "cpu") -> dict:
    import train

    job = _job(rank, world_size, fp16_scaler=fp16_scaler, bf16=bf16, device=device)
    state = TrainState()
    assert train.optimizer_step(job, state, _batch(rank, 0, device)) is not None  # momentum exists from here on
    state.step += 1
    before, scale = _snapshot(job), job.scaler.scale
    handle = None
    # The poison sits on the last rank only: the others' own values are finite.
    if rank == world_size - 1:
        handle = (_poison_backbone if where == "backbone" else _poison_head)(job, value)
    loss = train.optimizer_step(job, state, _batch(rank, 1, device))
    after = _snapshot(job)
    if handle is not None:
        handle.remove()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    skipped = dict(loss=None if loss is None else float(loss), changed=changed, scale=(scale, job.scaler.scale),
                   in_row=state.nonfinite_in_row, skipped=state.skipped_steps)
    state.step += 1
    good = train.optimizer_step(job, state, _batch(rank, 2, device))
    moved = sorted(k for k, v in _snapshot(job).items() if not torch.equal(v, after[k]))
    return dict(skipped=skipped, good_loss=None if good is None else float(good), moved=moved,
                in_row_after=state.nonfinite_in_row, scale_after=job.scaler.scale)


CASES = [
    ("backbone", float("inf"), True, False),   # fp16's scaler: an overflow in one backbone gradient
    ("head", float("inf"), True, False),       # ... in the head's gradient of the last rank only
    ("backbone", float("nan"), False, True),   # bf16 (no scaler): a NaN gradient with a finite loss
    ("head", float("nan"), False, False),      # fp32
]


def _all_cases(rank: int, world_size: int, device: str = "cpu") -> list[dict]:
    return [_decisions(rank, world_size, *case, device=device) for case in CASES]  # one process start for every case


def check_skip_decisions(results: list[list[dict]]) -> None:
    """What ``_all_cases`` returned on every rank: each poisoned step skipped by both optimizers on every rank,
    nothing changed, the fp16 scale backed off once, and the next finite step moved both."""
    for rank, per_case in enumerate(results):
        for (where, value, fp16_scaler, _), r in zip(CASES, per_case):
            case = f"rank {rank}, {value} in the {where}{' (fp16 scaler)' if fp16_scaler else ''}"
            s = r["skipped"]
            assert s["loss"] is None, f"{case}: the step was not skipped"
            assert s["changed"] == [], f"{case}: a skipped step changed {s['changed']}"
            assert s["in_row"] == 1 and s["skipped"] == 1, case
            before, after = s["scale"]
            assert after == (before / 2 if fp16_scaler else 1.0), (case, s["scale"])  # backed off once
            assert r["good_loss"] is not None and r["in_row_after"] == 0, case
            assert any(k.startswith("head.") for k in r["moved"]) and any(k.startswith("model.") for k in r["moved"])
            assert any(k.startswith("opt_head.") for k in r["moved"]), (case, r["moved"])
            assert r["scale_after"] == after, case  # growth only after growth_interval good steps


@pytest.mark.process
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_non_finite_gradient_skips_both_optimizers_on_every_rank(world_size):
    check_skip_decisions(on_ranks(_all_cases, world_size))


def test_loss_scaler_backs_off_grows_and_round_trips_with_gradscaler():
    from utils.precision import LossScaler

    scaler = LossScaler(enabled=True, init_scale=8.0, growth_interval=3)
    scaler.update(skipped=True)
    assert scaler.scale == 4.0 and scaler.growth_tracker == 0
    for _ in range(3):
        scaler.update(skipped=False)
    assert scaler.scale == 8.0 and scaler.growth_tracker == 0
    assert LossScaler(enabled=True).growth_interval == 100  # the reference's value for this workload
    # GradScaler's state loads into ours and ours into GradScaler (checkpoints of either kind resume).
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    ours = LossScaler(enabled=True)
    ours.load_state_dict(theirs.state_dict())
    assert ours.scale == 512.0 and ours.growth_interval == 7
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(LossScaler(enabled=True, init_scale=64.0).state_dict())
    assert back.get_scale() == 64.0
    disabled = LossScaler(enabled=False)
    assert disabled.state_dict() == {} and disabled.scale == 1.0
    loss = torch.tensor(2.0)
    assert disabled.scale_loss(loss) is loss and float(ours.scale_loss(loss)) == 1024.0


@pytest.mark.parametrize("capabilities, expected", [
    ({"avx512_bf16": True, "amx_bf16": False}, True),
    ({"avx512_bf16": False, "amx_bf16": True}, True),
    ({"bf16": True}, True),  # Arm
    ({"avx512_bf16": False, "avx2": True, "avx512_f": True}, False),  # AVX-512 without BF16: emulated
    ({}, False),
])
def test_cpu_computes_bf16_reads_torch_s_capabilities(monkeypatch, capabilities, expected):
    from utils import precision

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities, raising=False)
    assert precision.cpu_computes_bf16() is expected


def test_cpu_computes_bf16_reads_cpuinfo_where_torch_cannot_say(monkeypatch, tmp_path):
    from utils import precision

    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)  # torch < 2.10
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert precision.cpu_computes_bf16(info) is True
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    assert precision.cpu_computes_bf16(info) is False
    assert precision.cpu_computes_bf16(tmp_path / "missing") is False


def test_autocast_module_runs_its_module_under_the_dtype_and_shares_its_parameters():
    from utils.precision import AutocastModule

    inner = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    assert AutocastModule(inner, torch.bfloat16)(x).dtype == torch.bfloat16
    assert AutocastModule(inner, None)(x).dtype == torch.float32
    wrapped = AutocastModule(inner, torch.bfloat16).eval()
    assert not inner.training and list(wrapped.parameters()) == list(inner.parameters())


def test_embedding_reaches_the_head_in_fp32_and_bf16_loss_is_close_to_fp32():
    """The precision policy end to end on the CPU: under bf16 autocast the head receives fp32 embeddings,
    its products run in bf16 (fp32 accumulation) and the loss and gradients stay within 2e-2 of fp32."""
    from losses import CosFace
    from partial_fc import PartialFC

    torch.manual_seed(0)
    head = PartialFC(CosFace(s=16.0, m=0.3), 64, 500)
    emb = torch.randn(32, 64)
    labels = torch.randint(0, 500, (32,))
    results = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        e = emb.clone().requires_grad_()
        head.weight.grad = None
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = head(e, labels)
        loss.backward()
        assert loss.dtype == torch.float32 and e.grad.dtype == torch.float32
        results[name] = (float(loss.detach()), e.grad.clone(), head.weight.grad.clone())
    (l32, e32, w32), (l16, e16, w16) = results["fp32"], results["bf16"]
    assert abs(l16 - l32) <= 2e-2 * abs(l32), (l16, l32)
    assert (e16 - e32).norm() <= 2e-2 * e32.norm() and (w16 - w32).norm() <= 2e-2 * w32.norm()
    assert not torch.equal(w16, w32)  # the products did run in bf16


def test_a_skipped_step_leaves_adaface_statistics_as_they_were():
    """AdaFace's running norm statistics move in the forward pass; a skipped step puts them back, as the
    backbone's batch-norm statistics."""
    import train
    from losses.adaface import AdaFace
    from partial_fc import PartialFC

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 16), nn.BatchNorm1d(16), nn.PReLU(16), nn.Linear(16, D))
    head = PartialFC(AdaFace(s=8.0, m=0.3), D, NUM_CLASSES, 0.5, seed=1)
    job = tiny_job(0, 1, ["num_classes=12", "sample_rate=0.5", "max_steps=10"], model, head)
    state = TrainState()
    train.optimizer_step(job, state, _batch(0, 0))
    before = {k: v.clone() for k, v in head.named_buffers()}
    handle = _poison_backbone(job, float("nan"))
    assert train.optimizer_step(job, state, _batch(0, 1)) is None
    handle.remove()
    assert before and all(torch.equal(v, dict(head.named_buffers())[k]) for k, v in before.items())
    train.optimizer_step(job, state, _batch(0, 2))
    assert not all(torch.equal(v, dict(head.named_buffers())[k]) for k, v in before.items())  # a good step moves them


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_backbone_optimizer_runs_foreach_with_the_single_tensor_bits(name):
    """build_optimizers asks torch for its foreach updates (torch picks them itself on CUDA only): one operation per
    step over all tensors on the CPU too, with the same values as the loop over tensors."""
    from backbones import get_model
    from losses import ArcFace
    from partial_fc import PartialFC, build_optimizers

    weights = []
    for foreach in (True, False):
        torch.manual_seed(0)
        model = get_model("tiny", num_features=16, widths=(2, 8, 8, 16))
        opt, _ = build_optimizers(name, model.parameters(), PartialFC(ArcFace(), 16, 10, 1.0), 0.1, 0.9, 5e-4)
        assert opt.defaults["foreach"] is True
        opt.defaults["foreach"] = opt.param_groups[0]["foreach"] = foreach
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])


def _host_reads(rank: int, world_size: int) -> tuple[int, int]:
    """Over three steps of train.optimizer_step: the reads through ``to_host`` and the ``Tensor.item`` calls."""
    import train
    import utils.precision as precision

    job = _job(rank, world_size)
    state = TrainState()
    reads, items = [], []
    to_host, item = precision.to_host, torch.Tensor.item
    precision.to_host = lambda t: reads.append(tuple(t.shape)) or to_host(t)
    torch.Tensor.item = lambda self: items.append(tuple(self.shape)) or item(self)
    try:
        for step in range(3):
            train.optimizer_step(job, state, _batch(rank, step))
            state.step += 1
    finally:
        precision.to_host, torch.Tensor.item = to_host, item
    return len(reads), len(items)


@pytest.mark.process
def test_reading_the_flags_is_the_steps_one_host_read():
    # On a GPU every read of a device value waits for the device; the step reads only its three flags.
    assert on_ranks(_host_reads, 2) == [(3, 0), (3, 0)]


class _Batches:
    """A stand-in for the trainer's loader: ``_batch`` micro-batches, one per ``next``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch = epoch

    def __iter__(self):
        return (_batch(self.rank, 1000 * self.epoch + i)[0] for i in range(1000))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _loop_reads(rank: int, world_size: int, output: str) -> dict:
    """train.train over 7 steps with frequent = 3: the flag reads (``to_host``), the reads of tensor values
    (``float``/``item``) outside ``optimizer_step`` (the loop's own), the step losses and the progress lines."""
    from pathlib import Path

    import train
    import utils.precision as precision

    job = _job(rank, world_size, overrides=("frequent=3", "max_steps=7"))
    job.loader, job.output = _Batches(rank), Path(output)
    handler = _Lines()
    job.logger = logging.getLogger(f"test.loop.{rank}")
    job.logger.setLevel(logging.INFO)
    job.logger.addHandler(handler)
    losses: list[torch.Tensor] = []
    in_step, flag_reads, loop_reads = [False], [], []
    step_fn, to_host = train.optimizer_step, precision.to_host
    float_, item = torch.Tensor.__float__, torch.Tensor.item

    def recording_step(*args):
        in_step[0] = True
        try:
            loss = step_fn(*args)
        finally:
            in_step[0] = False
        losses.append(loss.detach().clone())  # compared after the loop, without a read here
        return loss

    def counted(read):
        def counting_read(self):
            if not in_step[0]:
                loop_reads.append(tuple(self.shape))
            return read(self)
        return counting_read

    train.optimizer_step = recording_step
    precision.to_host = lambda t: flag_reads.append(tuple(t.shape)) or to_host(t)
    torch.Tensor.__float__, torch.Tensor.item = counted(float_), counted(item)
    try:
        train.train(job, TrainState())
    finally:
        train.optimizer_step, precision.to_host = step_fn, to_host
        torch.Tensor.__float__, torch.Tensor.item = float_, item
    return {"flag_reads": len(flag_reads), "loop_reads": loop_reads, "losses": [float(x) for x in losses],
            "lines": [line for line in handler.lines if line.startswith("step ")]}


@pytest.mark.process
def test_the_logged_loss_is_read_once_per_progress_line(tmp_path):
    # README ("One decision per step"): the flags are the step's one host read; the loss is summed on the device
    # and read every `frequent` steps (and at the last step), as the running mean of the steps since the last line.
    for got in on_ranks(_loop_reads, 2, str(tmp_path)):
        assert got["flag_reads"] == 7, got
        assert got["loop_reads"] == [(), (), ()], got  # the loss sums of steps 1-3, 4-6 and 7
        assert [line.split(" epoch")[0] for line in got["lines"]] == ["step 3/7", "step 6/7", "step 7/7"], got
        losses = got["losses"]
        for line, chunk in zip(got["lines"], (losses[0:3], losses[3:6], losses[6:7])):
            logged = float(line.split("| loss ")[1].split(" ")[0])
            assert logged == pytest.approx(sum(chunk) / len(chunk), abs=5e-5), (line, chunk)


def _grads_at_the_update(rank: int, world_size: int, clip: float) -> dict:
    """One train.optimizer_step with clip_grad_norm = ``clip``: the gradients the two optimizers' steps see."""
    import train

    job = _job(rank, world_size, overrides=(f"clip_grad_norm={clip}",))
    seen = {}

    def record(name, params):
        def hook(opt, args, kwargs) -> None:
            seen[name] = [p.grad.to_dense().clone() for p in params]
        return hook

    job.opt_backbone.register_step_pre_hook(record("backbone", list(job.backbone.parameters())))
    job.opt_head.register_step_pre_hook(record("head", [job.head.weight]))
    assert train.optimizer_step(job, TrainState(), _batch(rank, 0)) is not None
    return seen


@pytest.mark.process
def test_clip_grad_norm_clips_the_backbone_only():
    # README (`clip_grad_norm`): the backbone's gradient norm is clipped to this value (arcface_torch: 5); the
    # head's gradient is not; 0 turns clipping off.
    free = on_ranks(_grads_at_the_update, 2, 0.0)
    clipped = on_ranks(_grads_at_the_update, 2, 1e-3)
    for f, c in zip(free, clipped):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in f["backbone"]]))
        assert norm > 1e-2  # so that a clip at 1e-3 binds
        for g_free, g_clipped in zip(f["backbone"], c["backbone"]):
            torch.testing.assert_close(g_clipped, g_free * (1e-3 / norm), rtol=1e-4, atol=1e-12)
        assert torch.equal(f["head"][0], c["head"][0])


def _saves(rank: int, world_size: int, output: str, save_all_states: bool) -> None:
    """train.train over 7 steps of 3-step epochs (num_image 48, batch 8 x 2 ranks), save_every_steps = 0."""
    from pathlib import Path

    import train

    job = _job(rank, world_size, overrides=("num_image=48", "max_steps=7", "save_every_steps=0", "keep_checkpoints=10",
                                            f"save_all_states={save_all_states}"))
    assert job.derived.steps_per_epoch == 3
    job.loader, job.output = _Batches(rank), Path(output)
    train.train(job, TrainState())


@pytest.mark.process
@pytest.mark.parametrize("save_all_states", [True, False])
def test_checkpoints_at_each_epoch_end_and_the_last_step_or_only_the_weights(tmp_path, save_all_states):
    # README: a checkpoint at each epoch end (and the last step; save_every_steps = 0 adds none between);
    # save_all_states = False writes only model.pt and its model.json.
    import json

    from utils.checkpoint import list_checkpoints

    on_ranks(_saves, 2, str(tmp_path), save_all_states)
    names = [p.name for p in list_checkpoints(tmp_path)] if (tmp_path / "checkpoints").exists() else []
    assert names == ([f"step_{s:09d}" for s in (3, 6, 7)] if save_all_states else []), names
    assert (tmp_path / "model.pt").is_file() and json.loads((tmp_path / "model.json").read_text())["step"] == 7


def _wire_precision(rank: int, world_size: int, fp16: bool, device: str = "cpu") -> bool:
    """trainer.build.build on 2 ranks, one backward through the DDP backbone: are all-reduced gradients fp16 values?"""
    from tests.helpers import CONFIG
    from trainer.build import build
    from utils.config import load_config

    cfg = load_config(CONFIG, [f"fp16={fp16}", f"device={device}"])
    job = build(cfg, rank, world_size, _on(device), logging.getLogger("test"))
    g = torch.Generator().manual_seed(rank)
    job.wrapped_backbone(torch.randn(4, 3, 112, 112, generator=g).to(_on(device))).square().sum().backward()
    grads = [p.grad for p in job.backbone.parameters() if p.grad is not None]
    assert grads and not any(bool(torch.isinf(x.half()).any()) for x in grads)
    return all(torch.equal(x, x.half().float()) for x in grads)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_mixed_precision_trainer_steps(dtype):
    """The trainer's fp16 and bf16 steps through CPU autocast: what tests/test_cuda.py checks on a GPU."""
    check_mixed_precision_steps(mixed_precision_steps(dtype, "cpu"), dtype)


@pytest.mark.process
def test_fp16_compresses_the_backbones_gradient_all_reduce():
    # README (`fp16 = True`): DDP's gradient all-reduce travels in fp16, as the reference's; fp32 runs do not.
    assert on_ranks(_wire_precision, 2, True) == [True, True]
    assert on_ranks(_wire_precision, 2, False) == [False, False]


SIZES = (5, 4, 5)  # per-rank batch sizes of the global batch: rank 1's differs


def ranks_train_like_one_process(rank: int, world_size: int, batch_ranks: int, device: str = "cpu") -> dict:
    """Three ``train.optimizer_step`` calls (DDP backbone without batch norm, a sampled head over 11 classes, SGD
    with momentum) on a global batch of ``sum(SIZES[:batch_ranks])`` samples: this rank's slice of it, or the
    whole batch in one process. Returns the losses, the backbone and this rank's shard of class centres, on the
    CPU."""
    import train
    from losses import ArcFace
    from partial_fc import PartialFC

    assert world_size in (1, batch_ranks)
    device = _on(device)
    classes, sizes = 11, SIZES[:batch_ranks]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 16), nn.PReLU(16), nn.Linear(16, D)).to(device)
    head = PartialFC(ArcFace(s=16.0, margin=0.3), D, classes, 0.5, seed=1, device=device)
    job = tiny_job(rank, world_size, [f"num_classes={classes}", "sample_rate=0.5", "max_steps=3", "warmup_epoch=0"],
                   model, head, device=device)
    state, losses = TrainState(), []
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1])) if world_size > 1 else slice(None)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        images = torch.randn(sum(sizes), 3, 4, 4, generator=g)  # (N, 3, 4, 4): the global batch
        labels = torch.randint(0, classes, (sum(sizes),), generator=g)  # (N,)
        loss = train.optimizer_step(job, state, [(images[mine].to(device), labels[mine].to(device))])
        losses.append(float(loss))
        state.step += 1
    return dict(losses=losses, backbone=[p.detach().cpu() for p in model.parameters()],
                shard=(head.class_start, head.weight.detach().cpu()))


def check_ranks_train_like_one_process(one: dict, ranks: list[dict]) -> None:
    """Every rank's losses and backbone, and the shards put together in rank order, equal one process's to fp32
    rounding."""
    for r, got in enumerate(ranks):
        assert got["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-6), (r, got["losses"], one["losses"])
        for a, b in zip(got["backbone"], one["backbone"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    starts = [got["shard"][0] for got in ranks]
    assert one["shard"][0] == 0 and starts == sorted(starts) and len(set(starts)) == len(ranks), starts
    torch.testing.assert_close(torch.cat([got["shard"][1] for got in ranks]), one["shard"][1], atol=1e-5, rtol=1e-5)


@pytest.mark.process
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_train_like_one_process(world_size):
    """DDP's averaged backbone gradient, the head's gathered embeddings and reduce-scattered gradient (started
    early), the sampled classes and the skip decision's all-reduce, together: N ranks = one process, 11 classes
    over 2 and 3 shards, per-rank batches of different sizes."""
    one = on_ranks(ranks_train_like_one_process, 1, world_size)[0]
    check_ranks_train_like_one_process(one, on_ranks(ranks_train_like_one_process, world_size, world_size))


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _whole_batch_bad(rank: int, world_size: int, bad_rank: int, kept: int, skip: bool) -> dict:
    """A good step, then one where ``bad_rank``'s loader left out all but ``kept`` of its 6 samples (the others'
    batches are whole), then a good step: what each did, or the error the bad step raised."""
    import train

    job = _job(rank, world_size, fp16_scaler=True, overrides=(f"skip_bad_images={skip}", "batch_size=6"))
    job.logger = logging.getLogger(f"test.short.{rank}.{kept}.{skip}")
    warnings = _Warnings()
    job.logger.addHandler(warnings)
    state = TrainState()
    assert train.optimizer_step(job, state, _batch(rank, 0)) is not None  # momentum and statistics exist
    state.step += 1
    before, scale = _snapshot(job), job.scaler.scale
    (images, labels), = _batch(rank, 1)
    bad = []
    if rank == bad_rank:
        images, labels = images[:kept], labels[:kept]
        bad = [f"data/train.rec (key {k}): cannot decode image" for k in range(6 - kept)]
    try:
        loss = train.optimizer_step(job, state, [(images, labels)], bad)
    except ValueError as exc:
        return dict(error=str(exc))
    changed = sorted(k for k, v in _snapshot(job).items() if not torch.equal(before[k], v))
    result = dict(loss=loss, changed=changed, scale=(scale, job.scaler.scale), in_row=state.nonfinite_in_row,
                  skipped=state.skipped_steps, warnings=warnings.lines)
    state.step += 1
    after = _snapshot(job)
    result["next"] = train.optimizer_step(job, state, _batch(rank, 2)) is not None
    result["moved"] = any(not torch.equal(after[k], v) for k, v in _snapshot(job).items() if k.startswith("model."))
    return result


SHORT_CASES = [(kept, skip) for kept in (0, 1) for skip in (True, False)]


def _short_cases(rank: int, world_size: int, bad_rank: int) -> list[dict]:
    return [_whole_batch_bad(rank, world_size, bad_rank, kept, skip) for kept, skip in SHORT_CASES]  # one start


@pytest.mark.process
@pytest.mark.parametrize("world_size, bad_rank", [(2, 0), (3, 1)])
def test_a_rank_whose_batch_is_left_too_small_skips_the_step_on_every_rank(world_size, bad_rank):
    """Batch norm trains on no fewer than 2 samples: a rank whose loader left out all (or all but one) of its
    samples does not crash alone (the others would wait in the next collective). With skip_bad_images every rank
    skips that update (weights, optimizer state, batch-norm statistics, the loss scale and the non-finite count
    unchanged) and the next step trains; without it every rank stops with the line naming the file."""
    for rank, per_case in enumerate(on_ranks(_short_cases, world_size, bad_rank)):
        for (kept, skip), r in zip(SHORT_CASES, per_case):
            case = f"rank {rank}, {kept} sample(s) kept on rank {bad_rank}, skip_bad_images={skip}"
            if not skip:
                assert r.get("error", "").startswith(
                    f"data/train.rec (key 0): cannot decode image (and {5 - kept} more)"), (case, r)
                continue
            assert "error" not in r, (case, r)
            assert r["loss"] is None and r["changed"] == [], (case, r["changed"])
            assert r["scale"][0] == r["scale"][1] == 1024.0 and r["in_row"] == 0 and r["skipped"] == 0, (case, r)
            assert r["next"] and r["moved"], case
            assert r["warnings"][-1] == ("step 1: a rank's batch kept fewer than 2 readable samples, too few to train "
                                         "on; update of backbone and head skipped on every rank"), (case, r)
            assert len([w for w in r["warnings"] if "(skip_bad_images): data/train.rec (key " in w]) == 6 - kept
