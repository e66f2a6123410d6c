"""PartialFC and its optimizers against single-process references on 1, 2 and 3 gloo ranks.

Each spawned run groups several checks (sample_rate 1 loss/gradients for ArcFace and CosFace, a DDP
training step with SGD and AdamW, sparse sampling, label errors, a saturated loss; AdaFace and sub-centres
with and without sampling; arcface_torch's update of every row against torch's optimizers) to keep the number
of process starts low.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import partial_fc.head
from losses import AdaFace, ArcFace, CombinedMarginLoss, CosFace
from partial_fc import (
    PartialFC,
    RowSparseAdamW,
    RowSparseSGD,
    build_head_optimizer,
    class_partition,
    sample_size,
    sharded_cross_entropy,
)
from partial_fc.sharding import init_rows
from tests.helpers import on_ranks
from tests.references import adaface_reference, head_loss

pytestmark = pytest.mark.timeout(180)

NUM_CLASSES, D, IN = 11, 8, 6
SIZES = (5, 4, 5)  # per-rank batch sizes; rank 1 differs
MARGINS = {"arcface": lambda: ArcFace(s=16.0, margin=0.5), "cosface": lambda: CosFace(s=16.0, m=0.35)}
LR, MOMENTUM, WD = 0.1, 0.9, 5e-4


def _global_batch(world: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs (N, IN), embeddings (N, D), labels (N,)) with N = sum of the first `world` SIZES."""
    g = torch.Generator().manual_seed(seed)
    n = sum(SIZES[:world])
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    labels[0] = NUM_CLASSES - 1  # the last class (on the last rank) always appears
    return torch.randn(n, IN, generator=g), torch.randn(n, D, generator=g), labels


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(SIZES[:rank])
    return t[start: start + SIZES[rank]]


def _ref_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, margin: nn.Module) -> torch.Tensor:
    """Single-process reference: full weight, F.normalize, the margin, F.cross_entropy."""
    return F.cross_entropy(margin(F.normalize(emb) @ F.normalize(weight).t(), labels), labels)


def _backbone() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, D))


def _train_steps(backbone: nn.Module, head_fn, head_opt: torch.optim.Optimizer, opt_name: str,
                 inputs_per_step, labels_per_step) -> None:
    """Steps of backbone (SGD or AdamW) + head, one backward per step."""
    if opt_name == "sgd":
        opt_b = torch.optim.SGD(backbone.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    else:
        opt_b = torch.optim.AdamW(backbone.parameters(), lr=LR, weight_decay=WD)
    for x, y in zip(inputs_per_step, labels_per_step):
        head_fn(backbone(x), y).backward()
        opt_b.step()
        head_opt.step()
        opt_b.zero_grad(set_to_none=True)
        head_opt.zero_grad(set_to_none=True)


def _worker(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    out: dict = {}
    inputs, emb, labels = _global_batch(world)
    # 1. sample_rate 1: loss, embedding gradient (x W) and weight gradient, both margins.
    for name, make in MARGINS.items():
        pfc = PartialFC(make(), D, NUM_CLASSES)
        out[f"{name}/shard"] = pfc.weight.detach().numpy().copy()
        out["class_range"] = (pfc.class_start, pfc.num_local)
        e = _local(emb, rank).clone().requires_grad_()
        loss = pfc(e, _local(labels, rank))
        loss.backward()
        out[f"{name}/loss"] = loss.item()
        out[f"{name}/emb_grad"] = e.grad.numpy()
        out[f"{name}/weight_grad"] = pfc.weight.grad.numpy()
    # 2. two training steps of a DDP backbone + head, SGD and AdamW.
    for opt_name in ("sgd", "adamw"):
        backbone = DDP(_backbone())
        pfc = PartialFC(MARGINS["arcface"](), D, NUM_CLASSES)
        opt_h = build_head_optimizer(pfc, opt_name, lr=LR, momentum=MOMENTUM, weight_decay=WD)
        steps_x = [_local(inputs, rank), _local(inputs.flip(0), rank)]
        steps_y = [_local(labels, rank), _local(labels.flip(0), rank)]
        _train_steps(backbone, pfc, opt_h, opt_name, steps_x, steps_y)
        out[f"{opt_name}/backbone"] = [p.detach().numpy().copy() for p in backbone.module.parameters()]
        out[f"{opt_name}/head"] = pfc.weight.detach().numpy().copy()
    # 3. label error raised on every rank (the bad label sits on the last rank).
    pfc = PartialFC(MARGINS["cosface"](), D, NUM_CLASSES)
    bad = _local(labels, rank).clone()
    if rank == world - 1:
        bad[-1] = NUM_CLASSES
    try:
        pfc(_local(emb, rank), bad)
        out["label_error"] = None
    except ValueError as exc:
        out["label_error"] = str(exc)
    # 4. sharded cross-entropy with a saturated loss: rank r holds columns r, r+W, ...
    logits, target = _saturated_logits()
    cols = torch.arange(rank, logits.shape[1], world)
    local_logits = logits[:, cols].clone().requires_grad_()
    local_target = torch.full_like(target, -1)
    hit = (target % world) == rank
    local_target[hit] = target[hit] // world
    loss = sharded_cross_entropy(local_logits, local_target)
    loss.backward()
    out["sat/loss"] = loss.item()
    out["sat/grad"] = local_logits.grad.numpy()
    out["sat/cols"] = cols.numpy()
    # 5. sample_rate < 1 with a row-sparse optimizer (SGD on 1 and 3 ranks, AdamW on 2)
    out["sparse"] = _sparse_step(rank, world, "adamw" if world == 2 else "sgd")
    # 6. AdaFace and sub-centres, dense and sampled, two steps; 7. update="all" against torch's optimizers
    out["heads"] = {case: _head_steps(rank, *case) for case in HEAD_CASES}
    out["update_all"] = {name: _update_all_steps(rank, name) for name in ("sgd", "adamw")}
    return out


def _saturated_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits where the target sits ~128 below the others: per-sample loss > 100."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 7, generator=g) * 3 + 60.0
    target = torch.tensor([0, 3, 6, 2])
    logits[torch.arange(4), target] = -64.0
    logits[1, 3] = 10.0  # one ordinary sample next to the saturated ones
    return logits, target


@pytest.mark.process
@pytest.mark.parametrize("world", [1, 2, 3])
def test_partial_fc_matches_single_process(world):
    results = on_ranks(_worker, world, timeout=150)
    inputs, emb, labels = _global_batch(world)
    full_init = init_rows(0, 0, NUM_CLASSES, D)

    for rank, res in enumerate(results):
        start, num = res["class_range"]
        assert (start, num) == class_partition(NUM_CLASSES, world, rank)
        # initial rows do not depend on the world size
        assert torch.equal(torch.from_numpy(res["arcface/shard"]), full_init[start: start + num])

    # 1. loss and gradients against F.cross_entropy over the full weight
    for name, make in MARGINS.items():
        e = emb.clone().requires_grad_()
        w = full_init.clone().requires_grad_()
        loss = _ref_loss(e, w, labels, make())
        loss.backward()
        for rank, res in enumerate(results):
            start, num = res["class_range"]
            assert abs(res[f"{name}/loss"] - loss.item()) < 1e-5, (name, rank, res[f"{name}/loss"], loss.item())
            torch.testing.assert_close(torch.from_numpy(res[f"{name}/emb_grad"]), world * _local(e.grad, rank),
                                       atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(torch.from_numpy(res[f"{name}/weight_grad"]), w.grad[start: start + num],
                                       atol=1e-5, rtol=1e-4)

    # 2. the same two steps in one process on the concatenated batch with torch's optimizers
    for opt_name in ("sgd", "adamw"):
        backbone = _backbone()
        weight = nn.Parameter(full_init.clone())
        if opt_name == "sgd":
            opt_h = torch.optim.SGD([weight], lr=LR, momentum=MOMENTUM, weight_decay=WD)
        else:
            opt_h = torch.optim.AdamW([weight], lr=LR, weight_decay=WD)
        margin = MARGINS["arcface"]()
        def loss_fn(x, y, weight=weight, margin=margin):
            return _ref_loss(x, weight, y, margin)

        _train_steps(backbone, loss_fn, opt_h, opt_name,
                     [inputs, inputs.flip(0)], [labels, labels.flip(0)])
        for res in results:
            start, num = res["class_range"]
            for got, ref in zip(res[f"{opt_name}/backbone"], backbone.parameters()):
                torch.testing.assert_close(torch.from_numpy(got), ref.detach(), atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(torch.from_numpy(res[f"{opt_name}/head"]), weight.detach()[start: start + num],
                                       atol=2e-5, rtol=1e-4)

    # 3. every rank raised the same error, naming the label and the range
    messages = {res["label_error"] for res in results}
    assert len(messages) == 1 and None not in messages, messages
    assert f"label {NUM_CLASSES}" in messages.pop()

    # 4. saturated loss: exact value and gradient, no clamping
    logits, target = _saturated_logits()
    x = logits.double().requires_grad_()
    ref = F.cross_entropy(x, target)
    ref.backward()
    assert ref.item() > 100
    for res in results:
        assert abs(res["sat/loss"] - ref.item()) < 1e-3 * ref.item()
        torch.testing.assert_close(torch.from_numpy(res["sat/grad"]).double(), x.grad[:, res["sat/cols"]],
                                   atol=1e-6, rtol=1e-5)

    # 5. sampled classes and the sparse update
    _check_sampled_sparse_update([res["sparse"] for res in results], world)

    # 6. AdaFace and sub-centres against the single-process full softmax over the classes each step used
    for case in HEAD_CASES:
        _check_head_steps(case, [res["heads"][case] for res in results], world)

    # 7. update="all" is a dense torch.optim step over each rank's full shard
    for name in ("sgd", "adamw"):
        for res in results:
            _check_update_all(name, res["update_all"][name])


def _sparse_step(rank: int, world: int, opt_name: str) -> dict:
    num_classes, sample_rate = 60, 0.25
    torch.manual_seed(11)  # the trainer seeds the global RNG; sampling draws from it
    pfc = PartialFC(ArcFace(s=16.0), D, num_classes, sample_rate=sample_rate)
    opt = build_head_optimizer(pfc, opt_name, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    g = torch.Generator().manual_seed(rank)
    for value in opt.state[pfc.weight].values():  # non-zero state, so "unchanged" can fail
        value.copy_(torch.rand(value.shape, generator=g) + 1.0)
    emb = torch.randn(SIZES[rank], D, generator=g, requires_grad=True)
    labels = torch.randint(0, num_classes, (SIZES[rank],), generator=g)
    before = {k: v.clone().numpy() for k, v in opt.state[pfc.weight].items()}
    weight_before = pfc.weight.detach().clone()
    loss = pfc(emb, labels)
    loss.backward()
    grad = pfc.weight.grad
    assert grad.is_sparse, grad.layout
    sampled = grad.coalesce().indices()[0]
    emb_grad = emb.grad.clone()
    opt.step()
    all_labels = torch.cat([torch.from_numpy(x) for x in _gather_numpy(labels)])
    return dict(loss=loss.item(), sampled=(sampled + pfc.class_start).numpy(), labels=all_labels.numpy(),
                num_sample=int(sample_rate * pfc.num_local), class_range=(pfc.class_start, pfc.num_local),
                weight_before=weight_before.numpy(), weight_after=pfc.weight.detach().numpy().copy(),
                state_before=before, state_after={k: v.numpy().copy() for k, v in opt.state[pfc.weight].items()},
                emb=emb.detach().numpy(), emb_grad=emb_grad.numpy())


def _gather_numpy(t: torch.Tensor) -> list:
    from tests.helpers import gather
    return [x.numpy() for x in gather(t)]


def _check_sampled_sparse_update(results: list[dict], world: int) -> None:
    """Positives sampled; unsampled rows and their state bit-identical; sampled rows updated; loss exact."""
    labels = torch.from_numpy(results[0]["labels"])
    union = []
    for res in results:
        start, num = res["class_range"]
        sampled = torch.from_numpy(res["sampled"])
        positives = labels[(labels >= start) & (labels < start + num)].unique()
        assert set(positives.tolist()) <= set(sampled.tolist()), (positives, sampled)
        assert sampled.numel() == max(res["num_sample"], positives.numel())
        rows = sampled - start
        unsampled = torch.ones(num, dtype=torch.bool)
        unsampled[rows] = False
        w0, w1 = torch.from_numpy(res["weight_before"]), torch.from_numpy(res["weight_after"])
        assert torch.equal(w0[unsampled], w1[unsampled])
        assert not torch.isclose(w0[rows], w1[rows]).all(dim=1).any()
        for key, before in res["state_before"].items():
            before, after = torch.from_numpy(before), torch.from_numpy(res["state_after"][key])
            assert after.shape[0] == num, (key, after.shape)
            assert torch.equal(before[unsampled], after[unsampled]), key
            assert not torch.equal(before[rows], after[rows]), key
        union.append((sampled, w0[rows]))
    # loss and embedding gradients equal the single-process loss over the union of sampled classes
    classes = torch.cat([c for c, _ in union])
    weight = torch.cat([w for _, w in union])
    emb = torch.cat([torch.from_numpy(r["emb"]) for r in results]).requires_grad_()
    remap = torch.searchsorted(classes, labels)
    ref = _ref_loss(emb, weight, remap, ArcFace(s=16.0))
    ref.backward()
    for rank, res in enumerate(results):
        assert abs(res["loss"] - ref.item()) < 1e-5
        torch.testing.assert_close(torch.from_numpy(res["emb_grad"]), world * _local(emb.grad, rank),
                                   atol=1e-5, rtol=1e-4)


def test_class_partition():
    for num_classes, world in [(10, 3), (11, 3), (7, 7), (1000, 8), (5, 1)]:
        parts = [class_partition(num_classes, world, r) for r in range(world)]
        covered = [c for start, num in parts for c in range(start, start + num)]
        assert covered == list(range(num_classes))
        counts = [num for _, num in parts]
        extra = num_classes % world
        assert counts == [num_classes // world + (1 if r < extra else 0) for r in range(world)]
    with pytest.raises(ValueError, match="num_classes=2 < world_size=3"):
        class_partition(2, 3, 0)
    with pytest.raises(ValueError, match="rank=3"):
        class_partition(10, 3, 3)


def test_init_rows_independent_of_partition():
    full = init_rows(4, 0, 3000, 5)
    assert abs(float(full.std()) - 0.01) < 1e-3
    assert torch.equal(init_rows(4, 1017, 1500, 5), full[1017:2517])
    assert torch.equal(init_rows(4, 1024, 1024, 5), full[1024:2048])  # a whole block, drawn in place
    assert not torch.equal(init_rows(5, 0, 10, 5), full[:10])
    head = PartialFC(ArcFace(), 5, 3000, seed=4, device="cpu")  # the device the trainer passes
    assert torch.equal(head.weight.detach(), full)


def test_single_process_errors_and_bad_arguments():
    pfc = PartialFC(CosFace(), D, NUM_CLASSES)
    with pytest.raises(ValueError, match=r"label -1 \(rank 0, sample 1\) is outside \[0, 11\)"):
        pfc(torch.randn(2, D), torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="4 embedding rows .* 3 labels"):
        pfc(torch.randn(4, D), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="sample_rate=0"):
        PartialFC(CosFace(), D, NUM_CLASSES, sample_rate=0)
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        build_head_optimizer(pfc, "lamb", lr=0.1)


def test_sgd_dense_equals_torch_and_state_round_trip():
    pfc = PartialFC(ArcFace(), D, NUM_CLASSES)
    weight = nn.Parameter(pfc.weight.detach().clone())
    ours = build_head_optimizer(pfc, "sgd", lr=LR, momentum=MOMENTUM, weight_decay=WD)
    theirs = torch.optim.SGD([weight], lr=LR, momentum=MOMENTUM, weight_decay=WD)
    for step in range(3):
        grad = torch.randn(NUM_CLASSES, D, generator=torch.Generator().manual_seed(step))
        pfc.weight.grad, weight.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    assert torch.equal(pfc.weight, weight)
    assert torch.equal(ours.state[pfc.weight]["momentum_buffer"], theirs.state[weight]["momentum_buffer"])
    for name in ("sgd", "adamw"):
        opt = build_head_optimizer(pfc, name, lr=LR)
        for value in opt.state[pfc.weight].values():
            value.uniform_()
        saved = opt.state_dict()
        fresh = build_head_optimizer(pfc, name, lr=LR)
        fresh.load_state_dict(saved)
        for key, value in opt.state[pfc.weight].items():
            assert value.shape[0] == pfc.num_local
            assert torch.equal(fresh.state[pfc.weight][key], value), key
    bad = build_head_optimizer(pfc, "sgd", lr=LR).state_dict()
    bad["state"][0]["momentum_buffer"] = torch.zeros(3, D)
    with pytest.raises(ValueError, match=r"'momentum_buffer' is \(3, 8\); expected first dimension 11"):
        build_head_optimizer(pfc, "sgd", lr=LR).load_state_dict(bad)


@pytest.mark.parametrize("weight_decay", [WD, 0.0])
def test_sparse_sgd_rows_equal_torch_sgd_on_those_rows(weight_decay):
    """Three sparse steps on overlapping row sets: every present row, and its momentum, follows torch.optim.SGD to
    the bit (each row's own steps); the other rows and their momentum do not move."""
    g = torch.Generator().manual_seed(3)
    start = torch.randn(12, D, generator=g)
    weight = nn.Parameter(start.clone())
    ours = RowSparseSGD([weight], lr=LR, momentum=MOMENTUM, weight_decay=weight_decay)
    rows_per_step = [torch.tensor([0, 3, 5]), torch.tensor([3, 4, 11]), torch.tensor([0, 3])]
    grads = [torch.randn(len(rows), D, generator=g) for rows in rows_per_step]
    for rows, grad in zip(rows_per_step, grads):
        weight.grad = torch.sparse_coo_tensor(rows[None], grad.clone(), weight.shape, check_invariants=True).coalesce()
        ours.step()
    for row in range(12):
        theirs = nn.Parameter(start[row].clone())
        reference = torch.optim.SGD([theirs], lr=LR, momentum=MOMENTUM, weight_decay=weight_decay)
        for rows, grad in zip(rows_per_step, grads):
            if row in rows.tolist():
                theirs.grad = grad[rows.tolist().index(row)].clone()
                reference.step()
        assert torch.equal(weight[row], theirs), row
        buf = reference.state[theirs].get("momentum_buffer", torch.zeros(D))
        assert torch.equal(ours.state[weight]["momentum_buffer"][row], buf), row


def test_adamw_dense_matches_torch():
    weight_a = nn.Parameter(torch.randn(6, D))
    weight_b = nn.Parameter(weight_a.detach().clone())
    ours = RowSparseAdamW([weight_a], lr=0.01, weight_decay=0.1)
    theirs = torch.optim.AdamW([weight_b], lr=0.01, weight_decay=0.1)
    for step in range(4):
        grad = torch.randn(6, D, generator=torch.Generator().manual_seed(step))
        weight_a.grad, weight_b.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(weight_a, weight_b, atol=1e-6, rtol=1e-5)


def test_sparse_accumulation_and_lazy_adam_steps():
    # Two micro-steps with overlapping rows: the optimizer coalesces, and only touched rows advance.
    weight = nn.Parameter(torch.randn(10, D))
    opt = RowSparseSGD([weight], lr=LR, momentum=MOMENTUM, weight_decay=WD)
    start = weight.detach().clone()
    F.embedding(torch.tensor([1, 4, 7]), weight, sparse=True).sum().backward()
    F.embedding(torch.tensor([4, 8]), weight, sparse=True).mul(2).sum().backward()
    assert weight.grad.is_sparse and not weight.grad.is_coalesced()
    dense = weight.grad.to_dense()
    opt.step()
    rows = torch.tensor([1, 4, 7, 8])
    expected = start.clone()
    expected[rows] -= LR * (dense[rows] + WD * start[rows])
    torch.testing.assert_close(weight.detach(), expected)
    adam = RowSparseAdamW([weight], lr=0.01)
    weight.grad = None
    F.embedding(torch.tensor([2, 3]), weight, sparse=True).sum().backward()
    adam.step()
    assert adam.state[weight]["step"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]


def test_grad_scaler_cpu_unscales_sparse_grads():
    # torch 2.14 supports GradScaler on the CPU; it unscales the sparse gradient's values.
    torch.manual_seed(0)
    pfc = PartialFC(ArcFace(s=16.0), D, 40, sample_rate=0.5)
    reference = PartialFC(ArcFace(s=16.0), D, 40, sample_rate=0.5)
    emb, labels = torch.randn(6, D), torch.randint(0, 40, (6,))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = build_head_optimizer(pfc, "sgd", lr=LR)
    opt_ref = build_head_optimizer(reference, "sgd", lr=LR)
    torch.manual_seed(1)
    scaler.scale(pfc(emb, labels)).backward()
    torch.manual_seed(1)  # the same sampled classes
    reference(emb, labels).backward()
    scaler.step(opt)
    scaler.update()
    opt_ref.step()
    torch.testing.assert_close(pfc.weight, reference.weight)
    assert scaler.get_scale() == 1024.0  # no inf found; growth only after growth_interval steps


def test_autocast_bf16_close_to_fp32():
    pfc = PartialFC(CosFace(s=16.0), D, NUM_CLASSES)
    emb, labels = torch.randn(6, D), torch.randint(0, NUM_CLASSES, (6,))
    exact = pfc(emb, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = pfc(emb, labels)
    assert low.dtype == torch.float32
    assert abs(low.item() - exact.item()) < 0.05 * exact.item()


@pytest.mark.parametrize("margin", [ArcFace(s=64.0, margin=0.5), AdaFace(s=64.0)], ids=["fused", "adaface"])
def test_fp16_gradients_under_a_loss_scale_stay_in_range_where_the_normalised_head_s_do(margin):
    """fp16 autocast (on the CPU here; the GPU's ``fp16 = True``) with the trainer's first loss scale, 2^16, and
    centres of the initial size (|w| ~ 0.057 at D = 32): a head that normalised its weight first would feed fp16
    ∂L/∂cos, in range here; ours must not feed it the 1/|w| larger ∂L/∂cos / |w|. Finite, and as fp32's to fp16's
    rounding."""
    torch.manual_seed(0)
    pfc = PartialFC(margin, 32, 200, sample_rate=0.5)  # weights drawn as the trainer's, 0.01 · N(0, 1)
    emb, labels = torch.randn(256, 32), torch.randint(0, 200, (256,))  # ∂L/∂cos at most ~s / B · 2^16 = 2^14
    grads = []
    for dtype in (None, torch.float16):
        pfc.weight.grad, x = None, emb.clone().requires_grad_()
        torch.manual_seed(1)  # the same sampled classes
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = pfc(x, labels)
        (loss * 2.0 ** 16).backward()
        grads.append((x.grad, pfc.weight.grad.to_dense()))
    (emb_32, w_32), (emb_16, w_16) = grads
    assert torch.isfinite(emb_16).all() and torch.isfinite(w_16).all()
    assert (emb_16 - emb_32).norm() <= 5e-3 * emb_32.norm() and (w_16 - w_32).norm() <= 5e-3 * w_32.norm()


def test_loaded_optimizer_state_follows_the_parameter_device():
    """torch's load_state_dict leaves a ``step`` tensor where it was loaded from; ours moves every row-wise
    state tensor to the parameter (a CPU-saved state must work on a CUDA head; here: the meta device)."""
    for name in ("sgd", "adamw"):
        saved = build_head_optimizer(PartialFC(ArcFace(), D, NUM_CLASSES), name, lr=LR).state_dict()
        head = PartialFC(ArcFace(), D, NUM_CLASSES).to("meta")
        opt = build_head_optimizer(head, name, lr=LR)
        opt.load_state_dict(saved)
        devices = {k: v.device.type for k, v in opt.state[head.weight].items()}
        assert set(devices.values()) == {"meta"}, devices


# ---------------------------------------------------------------------------------------- AdaFace, sub-centres
HEAD_CLASSES = 40
# (margin, sub-centres K, sample rate): every rank must equal one process's full softmax over the used classes.
HEAD_CASES = (("adaface", 1, 1.0), ("arcface", 3, 1.0), ("adaface", 2, 0.25), ("arcface", 2, 0.25))
ADAFACE = dict(s=16.0, m=0.4, h=0.333, t_alpha=0.5)  # t_alpha 0.5: the statistics move visibly in two steps


def _head_batch(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings (N, D), labels (N,)) of one step; norms spread over 1..10 so AdaFace's margins differ."""
    g = torch.Generator().manual_seed(20 + step)
    n = sum(SIZES[:world])
    emb = F.normalize(torch.randn(n, D, generator=g)) * (1 + 9 * torch.rand(n, 1, generator=g))
    return emb, torch.randint(0, HEAD_CLASSES, (n,), generator=g)


def _head(margin: str, sub_centers: int, rate: float, **options) -> PartialFC:
    """The head of a HEAD_CASES case (``options``: more PartialFC arguments), seeded as every rank seeds it."""
    torch.manual_seed(11)
    make = AdaFace(**ADAFACE, gradient="exact") if margin == "adaface" else ArcFace(s=16.0, margin=0.5)
    return PartialFC(make, D, HEAD_CLASSES, sample_rate=rate, sub_centers=sub_centers, **options)


def _head_steps(rank: int, margin: str, sub_centers: int, rate: float) -> list[dict]:
    """Two forward/backward steps of one head (no optimizer): what each step used and its gradients."""
    world = torch.distributed.get_world_size()
    pfc = _head(margin, sub_centers, rate)
    steps = []
    for step in range(2):
        emb, labels = _head_batch(world, step)
        e = _local(emb, rank).clone().requires_grad_()
        loss = pfc(e, _local(labels, rank))
        loss.backward()
        grad = pfc.weight.grad.coalesce() if pfc.weight.grad.is_sparse else pfc.weight.grad
        used = grad.indices()[0] if grad.is_sparse else torch.arange(pfc.num_local)
        values = grad.values() if grad.is_sparse else grad
        steps.append(dict(loss=loss.item(), emb_grad=e.grad.numpy().copy(), used=(used + pfc.class_start).numpy(),
                          weight_grad=values.numpy().copy(), weight=pfc.weight.detach().numpy().copy(),
                          buffers={k: v.numpy().copy() for k, v in pfc.named_buffers()}))
        pfc.weight.grad = None
    return steps


def _check_head_steps(case: tuple, results: list[list[dict]], world: int) -> None:
    margin, sub_centers, _ = case
    full = init_rows(0, 0, HEAD_CLASSES * sub_centers, D).view(HEAD_CLASSES, sub_centers * D)
    stats = (20.0, 100.0)
    for step in range(2):
        per_rank = [r[step] for r in results]
        # the initial rows (K centres side by side per class) do not depend on the world size
        assert torch.equal(torch.cat([torch.from_numpy(r["weight"]) for r in per_rank]), full), case
        used = torch.cat([torch.from_numpy(r["used"]) for r in per_rank])  # (C_used,) sorted class ids
        emb, labels = _head_batch(world, step)
        e, w = emb.double().requires_grad_(), full[used].double().requires_grad_()
        remap = torch.searchsorted(used, labels)
        if margin == "adaface":
            def apply(cos, y, norms, stats=stats):
                logits, *new = adaface_reference(cos, y, norms, *stats, **ADAFACE)
                apply.stats = tuple(new)  # noqa: B023 (the function of this step, read after the call)
                return logits
        else:
            apply = lambda cos, y, norms: ArcFace(s=16.0, margin=0.5)(cos, y)  # noqa: E731
        loss = head_loss(e, w, remap, sub_centers, apply)
        loss.backward()
        offset = 0
        for rank, res in enumerate(per_rank):
            n = len(res["used"])
            assert abs(res["loss"] - loss.item()) < 1e-5, (case, step, rank, res["loss"], loss.item())
            torch.testing.assert_close(torch.from_numpy(res["emb_grad"]).double(), world * _local(e.grad, rank),
                                       atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(torch.from_numpy(res["weight_grad"]).double(), w.grad[offset: offset + n],
                                       atol=1e-5, rtol=1e-4)
            offset += n
        if margin == "adaface":
            stats = apply.stats
            for res in per_rank:  # the same statistics on every rank, those of the global batch
                assert res["buffers"]["margin_loss.batch_mean"].tolist() == per_rank[0]["buffers"][
                    "margin_loss.batch_mean"].tolist()
                assert res["buffers"]["margin_loss.batch_std"].tolist() == per_rank[0]["buffers"][
                    "margin_loss.batch_std"].tolist()
                assert abs(float(res["buffers"]["margin_loss.batch_mean"][0]) - stats[0]) < 1e-5 * stats[0]
                assert abs(float(res["buffers"]["margin_loss.batch_std"][0]) - stats[1]) < 1e-5 * stats[1]


def _update_all_steps(rank: int, opt_name: str) -> dict:
    """Three sampled steps with update="all": our head optimizer against torch's on a copy of the shard."""
    world = torch.distributed.get_world_size()
    torch.manual_seed(11)
    pfc = PartialFC(ArcFace(s=16.0), D, HEAD_CLASSES, sample_rate=0.25, sub_centers=2, update="all")
    ours = build_head_optimizer(pfc, opt_name, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    weight = nn.Parameter(pfc.weight.detach().clone())
    theirs = (torch.optim.SGD([weight], lr=LR, momentum=MOMENTUM, weight_decay=WD) if opt_name == "sgd"
              else torch.optim.AdamW([weight], lr=LR, betas=(MOMENTUM, 0.999), weight_decay=WD))
    before_last = used_last = None
    for step in range(3):
        emb, labels = _head_batch(world, step)
        pfc(_local(emb, rank), _local(labels, rank)).backward()
        grad = pfc.weight.grad
        assert not grad.is_sparse and grad.shape == pfc.weight.shape, grad.layout
        used_last = grad.abs().sum(dim=1) > 0  # (num_local,) the sampled classes
        assert not used_last.all(), "every row sampled: the test would not see unsampled rows move"
        weight.grad = grad.clone()
        before_last = pfc.weight.detach().clone()
        ours.step()
        theirs.step()
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
    return dict(ours=pfc.weight.detach().numpy().copy(), theirs=weight.detach().numpy().copy(),
                state={k: v.numpy().copy() for k, v in ours.state[pfc.weight].items()},
                torch_state={k: v.numpy().copy() for k, v in theirs.state[weight].items()},
                before_last=before_last.numpy(), used_last=used_last.numpy())


def _check_update_all(name: str, res: dict) -> None:
    ours, theirs = torch.from_numpy(res["ours"]), torch.from_numpy(res["theirs"])
    if name == "sgd":  # the same operations in the same order as torch.optim.SGD
        assert torch.equal(ours, theirs)
        assert torch.equal(torch.from_numpy(res["state"]["momentum_buffer"]),
                           torch.from_numpy(res["torch_state"]["momentum_buffer"]))
    else:
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(torch.from_numpy(res["state"][key]), torch.from_numpy(res["torch_state"][key]),
                                       atol=1e-7, rtol=1e-5)
        assert res["state"]["step"].tolist() == [3.0] * ours.shape[0]  # every row stepped every step
    # rows the last step did not sample moved anyway (momentum, decay): unlike update="sampled"
    unsampled = ~torch.from_numpy(res["used_last"])
    assert not torch.isclose(ours[unsampled], torch.from_numpy(res["before_last"])[unsampled]).all(dim=1).any()


# update="all" (arcface_torch's dense weight gradient) through the same single-process reference as HEAD_CASES:
# the fused head (ArcFace, K = 1) and the unfused chain (AdaFace; ArcFace with sub-centres), with and without
# sampling.
UPDATE_ALL_CASES = (("arcface", 1, 1.0), ("arcface", 1, 0.25), ("adaface", 1, 0.25), ("arcface", 2, 0.25))


def _update_all_head_steps(rank: int, margin: str, sub_centers: int, rate: float) -> list[dict]:
    """``_head_steps`` with ``update="all"``: two forward/backward steps, each step's dense weight gradient and the
    rows the head sampled (recorded from ``sharding.sample_rows`` itself; at rate 1 every row). ``weight.grad`` is
    set to None between the steps, as ``zero_grad(set_to_none=True)``."""
    world = torch.distributed.get_world_size()
    pfc = _head(margin, sub_centers, rate, update="all")
    drawn: list[torch.Tensor] = []
    sample = partial_fc.head.sample_rows  # this spawned rank's module, wrapped for this call only
    partial_fc.head.sample_rows = lambda *args: drawn.append(sample(*args).clone()) or drawn[-1]
    steps = []
    try:
        for step in range(2):
            emb, labels = _head_batch(world, step)
            e = _local(emb, rank).clone().requires_grad_()
            loss = pfc(e, _local(labels, rank))
            loss.backward()
            grad = pfc.weight.grad
            assert grad.layout == torch.strided and grad.shape == pfc.weight.shape, (grad.layout, grad.shape)
            assert len(drawn) == (step + 1 if rate < 1 else 0)
            used = drawn[-1] if rate < 1 else torch.arange(pfc.num_local)
            steps.append(dict(loss=loss.item(), emb_grad=e.grad.numpy().copy(), used=(used + pfc.class_start).numpy(),
                              dense_grad=grad.numpy().copy(), weight=pfc.weight.detach().numpy().copy(),
                              class_range=(pfc.class_start, pfc.num_local),
                              buffers={k: v.numpy().copy() for k, v in pfc.named_buffers()}))
            pfc.weight.grad = None
    finally:
        partial_fc.head.sample_rows = sample
    return steps


def _update_all_worker(rank: int, world: int) -> dict:
    return {case: _update_all_head_steps(rank, *case) for case in UPDATE_ALL_CASES}


@pytest.mark.process
@pytest.mark.parametrize("world", [1, 2, 3])
def test_update_all_head_matches_single_process(world):
    """README: every variant, ``head_update = "all"`` included, equals the single-process full softmax on 1, 2 and 3
    ranks (40 classes: 20 + 20, 14 + 13 + 13), with and without sampling. The weight gradient is dense
    ``(num_local, K·D)``; rows a step did not sample are exactly zero (also in the second step, which reuses the
    first one's); the sampled rows, the loss and the embedding gradient equal the reference over
    the classes the step used (``_check_head_steps``, fp32 to 1e-5)."""
    results = on_ranks(_update_all_worker, world, timeout=150)
    for case in UPDATE_ALL_CASES:
        _, _, rate = case
        per_rank = []
        for rank, res in enumerate(results):
            start, num = res[case][0]["class_range"]
            assert (start, num) == class_partition(HEAD_CLASSES, world, rank)
            steps = []
            for step, got in enumerate(res[case]):
                _, labels = _head_batch(world, step)
                dense = torch.from_numpy(got["dense_grad"])  # (num_local, K·D)
                used = torch.from_numpy(got["used"])  # (C_used,) sorted class ids
                assert torch.equal(used, used.unique()) and used.min() >= start and used.max() < start + num
                positives = labels[(labels >= start) & (labels < start + num)].unique()
                assert set(positives.tolist()) <= set(used.tolist()), (case, step, positives, used)
                assert used.numel() == sample_size(num, rate, positives.numel())
                unsampled = torch.ones(num, dtype=torch.bool)
                unsampled[used - start] = False
                if rate < 1:
                    assert unsampled.any(), "every row sampled: the zero rows would not be checked"
                assert torch.count_nonzero(dense[unsampled]) == 0, (case, rank, step)
                assert torch.count_nonzero(dense[used - start].abs().sum(dim=1)) == used.numel()
                steps.append(dict(got, weight_grad=dense[used - start].numpy()))
            per_rank.append(steps)
        _check_head_steps(case, per_rank, world)


def test_update_all_and_sub_centers_arguments():
    with pytest.raises(ValueError, match="sub_centers=0 must be an integer >= 1"):
        PartialFC(ArcFace(), D, NUM_CLASSES, sub_centers=0)
    with pytest.raises(ValueError, match="update='dense' is unknown"):
        PartialFC(ArcFace(), D, NUM_CLASSES, update="dense")
    head = PartialFC(ArcFace(), D, NUM_CLASSES, sub_centers=3)
    assert head.weight.shape == (NUM_CLASSES, 3 * D)
    for name in ("sgd", "adamw"):  # the optimizer state keeps one row per class
        state = build_head_optimizer(head, name, lr=LR).state[head.weight]
        assert {k: v.shape[0] for k, v in state.items()} == {k: NUM_CLASSES for k in state}


FUSED_MARGINS = {
    "arcface": lambda: ArcFace(s=16.0, margin=0.5),
    "arcface_exact": lambda: ArcFace(s=16.0, margin=0.5, gradient="exact"),
    "cosface": lambda: CosFace(s=16.0, m=0.35),
    "combined_exact": lambda: CombinedMarginLoss(16.0, 1.2, 0.3, 0.1, gradient="exact"),
}


@pytest.mark.parametrize("name", sorted(FUSED_MARGINS))
@pytest.mark.parametrize("rate,update", [(1.0, "sampled"), (0.3, "sampled"), (0.3, "all")])
def test_fused_margin_softmax_equals_the_margin_then_cross_entropy(name, rate, update):
    """A margin that changes only the target columns is fused with the cross-entropy (MarginSoftmax); the same
    margin behind a plain callable takes the unfused chain (NormalizedLinear, apply_margin, sharded
    cross-entropy). Loss, embedding and weight gradients agree."""
    g = torch.Generator().manual_seed(7)
    classes = 1000
    emb = torch.randn(10, 32, generator=g)
    labels = torch.randint(0, classes, (10,), generator=g)
    results = []
    for fused in (True, False):
        margin = FUSED_MARGINS[name]()
        def unfused(cos, target, margin=margin):
            return margin.apply_margin(cos, target)

        head = PartialFC(margin if fused else unfused, 32, classes, rate, seed=3, update=update)
        x = emb.clone().requires_grad_()
        torch.manual_seed(11)  # the same sampled classes
        loss = head(x, labels)
        assert type(loss.grad_fn).__name__ == ("MarginSoftmaxBackward" if fused else "_ShardedCrossEntropyBackward")
        loss.backward()
        grad = head.weight.grad
        results.append((loss.detach(), x.grad, grad.to_dense() if grad.is_sparse else grad))
    (loss_f, ge_f, gw_f), (loss_u, ge_u, gw_u) = results
    torch.testing.assert_close(loss_f, loss_u, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ge_f, ge_u, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(gw_f, gw_u, atol=1e-7, rtol=1e-5)
    assert gw_f.abs().sum() > 0 and ge_f.abs().sum() > 0


def test_margins_that_change_other_columns_are_not_fused():
    """Inter-class filtering, AdaFace and sub-centres change or select more than the target column: the head
    keeps the unfused chain for them (their values are checked against references elsewhere)."""
    emb, labels = torch.randn(6, 8), torch.randint(0, 20, (6,))
    for head in (PartialFC(CombinedMarginLoss(16.0, 1.0, 0.5, 0.0, interclass_filtering_threshold=0.2), 8, 20),
                 PartialFC(AdaFace(), 8, 20), PartialFC(ArcFace(), 8, 20, sub_centers=3)):
        assert type(head(emb, labels).grad_fn).__name__ == "_ShardedCrossEntropyBackward", head
    assert type(PartialFC(ArcFace(), 8, 20)(emb, labels).grad_fn).__name__ == "MarginSoftmaxBackward"


def test_target_logits_are_the_margin_s_target_column():
    """target_logits gives the value apply_margin writes on the target column; target_only_scale is s, or
    None with inter-class filtering."""
    cos = torch.rand(5, 4) * 1.8 - 0.9
    labels = torch.tensor([0, 3, 2, 1, 3])
    for margin in (ArcFace(s=30.0), CosFace(s=30.0), CombinedMarginLoss(30.0, 1.3, 0.2, 0.05, gradient="exact")):
        logits, slopes = margin.target_logits(cos.gather(1, labels[:, None]))
        torch.testing.assert_close(logits, margin.apply_margin(cos, labels).gather(1, labels[:, None]))
        assert margin.target_only_scale() == 30.0 and slopes.shape == logits.shape
    assert CombinedMarginLoss(30.0, 1.0, 0.5, 0.0, interclass_filtering_threshold=0.3).target_only_scale() is None


@pytest.mark.parametrize("margin", ["cosface", "arcface"])
def test_fused_head_loss_does_not_saturate(margin):
    """docs/partial_fc.md: the loss is never the log of a clamped probability, so it never saturates, also through
    the default fused head (MarginSoftmax). s = 64; every
    embedding lies near the centre of a wrong class whose centre is opposite the target's (cos ≈ +1 there, ≈ -1 on
    the target), so each sample's loss is above 100 (CosFace ≈ 64·1 + 64·1.4, ArcFace ≈ 64·1 + 64·cos(0.5)): well
    past -log(e^-87) ≈ 87.3, where a loss computed from a clamped or underflowed target probability would stop.
    Loss, embedding and weight gradients against a float64 reference written out here."""
    s, m = 64.0, (0.4 if margin == "cosface" else 0.5)
    g = torch.Generator().manual_seed(4)
    classes, dim, batch = 40, 16, 7
    half = F.normalize(torch.randn(classes // 2, dim, generator=g))
    # class c + 20 is opposite class c; the centres' norms differ (the head divides by them)
    weight = torch.cat([half, -half]) * (0.5 + torch.rand(classes, 1, generator=g))  # (C, D)
    labels = torch.tensor([0, 39, 17, 22, 5, 36, 31])  # targets in both halves
    wrong = (labels + classes // 2) % classes  # the class opposite each target
    near = F.normalize(weight[wrong]) + 0.05 * torch.randn(batch, dim, generator=g)  # (B, D) near the wrong centre
    emb = near * (1 + 4 * torch.rand(batch, 1, generator=g))  # norms 1..5
    make = CosFace(s=s, m=m) if margin == "cosface" else ArcFace(s=s, margin=m)
    head = PartialFC(make, dim, classes)
    with torch.no_grad():
        head.weight.copy_(weight)
    x = emb.clone().requires_grad_()
    loss = head(x, labels)
    assert type(loss.grad_fn).__name__ == "MarginSoftmaxBackward"  # the fused head, the default for these margins
    loss.backward()

    # float64 reference: normalise, cosines, margin on the target (straight-through for ArcFace: its gradient is
    # s on the target as elsewhere, the head's default; CosFace's is exact anyway), log-softmax, mean.
    e = emb.double().requires_grad_()
    w = weight.double().requires_grad_()
    cos = (e / e.norm(dim=1, keepdim=True)) @ (w / w.norm(dim=1, keepdim=True)).t()  # (B, C)
    cos_t = cos.gather(1, labels[:, None])  # (B, 1)
    if margin == "cosface":
        target = s * (cos_t - m)
    else:
        target = s * cos_t + (s * torch.cos(torch.acos(cos_t.detach()) + m) - s * cos_t).detach()
    logits = (s * cos).scatter(1, labels[:, None], target)  # (B, C)
    per_sample = -logits.log_softmax(dim=1).gather(1, labels[:, None])[:, 0]  # (B,)
    ref = per_sample.mean()
    ref.backward()
    assert per_sample.min() > 100, per_sample  # every sample saturated, not just the mean
    # Tolerances. The head computes the cosines in fp32 (unit round-off u = 2^-24 ≈ 6e-8): D = 16 products plus the
    # two normalisations give |δcos| ≲ 20u ≈ 1.2e-6, so a logit is off by ≲ s·1.2e-6 ≈ 8e-5 and a sample's loss
    # (log-sum-exp minus the target logit) by ≲ 2e-4, plus the rounding of a value ~150 (u·150 ≈ 1e-5). 5e-4 on the
    # mean loss is above that bound (measured: ~1e-5); a saturated loss (≈ 87.3 per sample) misses it by tens.
    # The gradients are s·(softmax − one-hot) through the normalisations; a softmax entry exp(logit − lse) inherits
    # ≲ 2·8e-5 relative error from the logits, hence rtol 2e-4, and atol 1e-5 of the largest entry covers entries
    # that cancel (the embeddings lie 0.05 off a centre, so the tangential part is small). Measured: 1.4e-5 relative
    # on the embeddings' gradient; a softmax off by 1e-3 (e.g. a perturbed normaliser) fails it.
    assert abs(loss.item() - ref.item()) < 5e-4, (loss.item(), ref.item())
    for got, want in ((x.grad, e.grad), (head.weight.grad, w.grad)):
        assert want.abs().max() > 1e-3
        torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=1e-5 * float(want.abs().max()))


def test_dense_gradients_accumulate_over_backwards():
    """Accumulation (two backwards, no zero_grad) adds the dense gradients; after zero_grad(set_to_none=False)
    the next backward's gradient stands alone."""
    torch.manual_seed(0)
    (e1, l1), (e2, l2) = [(torch.randn(6, 8), torch.randint(0, 40, (6,))) for _ in range(2)]
    separate = []
    for emb, labels in ((e1, l1), (e2, l2)):
        head = PartialFC(CosFace(s=16.0), 8, 40, 1.0, seed=1)
        head(emb, labels).backward()
        separate.append(head.weight.grad.clone())
    head = PartialFC(CosFace(s=16.0), 8, 40, 1.0, seed=1)
    head(e1, l1).backward()
    head(e2, l2).backward()  # accumulates onto weight.grad
    torch.testing.assert_close(head.weight.grad, separate[0] + separate[1], rtol=1e-6, atol=1e-7)
    head.weight.grad.zero_()  # zero_grad(set_to_none=False)
    head(e2, l2).backward()
    torch.testing.assert_close(head.weight.grad, separate[1], rtol=1e-6, atol=1e-7)


def test_sparse_gradients_accumulate_over_backwards():
    """Accumulation (two backwards, no zero_grad) of sampled heads: the sparse gradients of the two steps' rows
    add up."""
    torch.manual_seed(0)
    batches = [(torch.randn(6, 8), torch.randint(0, 40, (6,))) for _ in range(2)]
    separate, seeds = [], [5, 6]
    for (emb, labels), seed in zip(batches, seeds):
        head = PartialFC(CosFace(s=16.0), 8, 40, 0.5, seed=1)
        torch.manual_seed(seed)
        head(emb, labels).backward()
        separate.append(head.weight.grad.to_dense())
    head = PartialFC(CosFace(s=16.0), 8, 40, 0.5, seed=1)
    for (emb, labels), seed in zip(batches, seeds):
        torch.manual_seed(seed)
        head(emb, labels).backward()  # the second accumulates onto weight.grad
    torch.testing.assert_close(head.weight.grad.to_dense(), separate[0] + separate[1], rtol=1e-6, atol=1e-7)


def _early_head_worker(rank: int, world: int, margin: str) -> list[bool]:
    from utils import distributed as du

    calls = []
    real = du._reduce_scatter_into
    du._reduce_scatter_into = lambda *a, **k: (calls.append(bool(k.get("async_op"))), real(*a, **k))[1]
    loss_fn = AdaFace() if margin == "adaface" else CosFace(s=16.0)
    head = PartialFC(loss_fn, 8, 41, 0.5, seed=1)
    g = torch.Generator().manual_seed(rank)
    emb = torch.randn(5 + rank, 8, generator=g, requires_grad=True)
    head(emb, torch.randint(0, 41, (5 + rank,), generator=g)).backward()
    du._reduce_scatter_into = real
    return calls


@pytest.mark.process
@pytest.mark.parametrize("margin", ["cosface", "adaface"])
def test_the_head_starts_the_embeddings_reduce_scatter_early(margin):
    """On 2 ranks the head's backward (fused, and unfused for AdaFace) launches the embeddings' reduce-scatter
    asynchronously before it computes the weight's gradient, and the gather's backward runs no other (the
    values are those of one process: test_partial_fc_matches_single_process)."""
    assert on_ranks(_early_head_worker, 2, margin, timeout=120) == [[True], [True]]


@pytest.mark.process
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_compiled_head_equals_eager(rate):
    """``compile=True`` (config ``compile_head``) runs the fused head's collective-free parts through
    torch.compile (inductor's C++ on the CPU): the loss and both gradients equal the eager head's to 1e-5, over
    two steps whose batch size changes (the second compiles for dynamic shapes). The profiler shows the two
    compiled regions (forward and backward) in the compiled head's step."""
    from torch.profiler import ProfilerActivity, profile

    results, regions = {}, set()
    for compiled in (False, True):
        head = PartialFC(ArcFace(s=32.0, margin=0.4), 16, 300, rate, seed=2, compile=compiled)
        got = []
        for step, batch in enumerate((12, 9)):
            g = torch.Generator().manual_seed(step)
            emb = torch.randn(batch, 16, generator=g).requires_grad_()
            torch.manual_seed(step)  # the same sampled classes
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss = head(emb, torch.randint(0, 300, (batch,), generator=g))
                loss.backward()
            if compiled:
                regions |= {e.key for e in prof.key_averages() if e.key.startswith("Torch-Compiled Region")}
            grad = head.weight.grad
            got.append((loss.detach(), emb.grad, grad.to_dense() if grad.is_sparse else grad))
            head.weight.grad = None
        results[compiled] = got
    assert len(regions) >= 2, regions
    for (loss_e, ge_e, gw_e), (loss_c, ge_c, gw_c) in zip(results[False], results[True]):
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ge_c, ge_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw_c, gw_e, rtol=1e-5, atol=1e-5)


EMPTY_SHARD_MARGINS = {"arcface": lambda: dict(margin_loss=ArcFace(s=16.0, margin=0.5)),
                       "adaface": lambda: dict(margin_loss=AdaFace(s=16.0, gradient="exact")),
                       "sub_centers": lambda: dict(margin_loss=ArcFace(s=16.0, margin=0.5), sub_centers=2)}


def _empty_shard_step(rank: int, world: int) -> dict:
    """9 classes, sample rate 0.1, every label in rank 0's shard: on 3 ranks, ranks 1 and 2 sample no class
    (int(0.1 · 3) = 0 and no positive). One step of each head: loss, embedding and weight gradients."""
    g = torch.Generator().manual_seed(9)
    emb, labels = torch.randn(6, D, generator=g), torch.tensor([0, 1, 2, 0, 1, 1])
    per_rank = len(labels) // world
    out = {}
    for name, make in EMPTY_SHARD_MARGINS.items():
        head = PartialFC(embedding_size=D, num_classes=9, sample_rate=0.1, seed=4, **make())
        e = emb[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_()
        loss = head(e, labels[rank * per_rank:(rank + 1) * per_rank])
        loss.backward()
        grad = head.weight.grad
        out[name] = (loss.item(), e.grad.numpy(), (grad.to_dense() if grad.is_sparse else grad).numpy(),
                     head.class_start, head.num_local)
    return out


@pytest.mark.process
def test_a_rank_that_samples_no_class_trains_like_one_process():
    """A rank whose shard has no positive and whose sample size ``int(R · num_local)`` is 0 uses no class in the
    step: it adds nothing to the softmax and gets a zero gradient, and the loss and gradients are one process's
    (fused ArcFace; AdaFace and sub-centres, unfused)."""
    one = on_ranks(_empty_shard_step, 1)[0]
    three = on_ranks(_empty_shard_step, 3)
    for name in EMPTY_SHARD_MARGINS:
        loss, emb_grad, weight_grad, _, _ = one[name]
        for rank, res in enumerate(three):
            got_loss, got_emb, got_weight, start, num = res[name]
            assert abs(got_loss - loss) < 1e-5, (name, rank, got_loss, loss)
            torch.testing.assert_close(torch.from_numpy(got_emb), 3 * torch.from_numpy(emb_grad[2 * rank:2 * rank + 2]),
                                       atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(torch.from_numpy(got_weight), torch.from_numpy(weight_grad[start:start + num]),
                                       atol=1e-6, rtol=1e-5)
            if rank > 0:
                assert not got_weight.any(), (name, rank)
