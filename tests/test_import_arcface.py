"""trainer/import_arcface.py and its command scripts/import_arcface.py: an arcface_torch run continued here, on
another number of ranks.

Each test writes an arcface_torch output folder in exactly the layout its ``train_v2.py`` writes at an epoch end:
``checkpoint_gpu_<rank>.pt`` = ``{"epoch", "global_step", "state_dict_backbone" (the plain module's),
"state_dict_softmax_fc" ({"weight": this rank's (num_local, D) rows}), "state_optimizer" (ONE torch optimizer
over two groups, the backbone's parameters then the head weight), "state_lr_scheduler"}`` and rank 0's
``model.pt``. The run is real: a backbone of ours in the official layout and a full-softmax head (sample rate 1,
as ``PartialFC_V2``'s dense gradient: every row steps), trained by ``torch.optim.SGD``/``AdamW`` under a
scheduler that behaves as arcface_torch's ``PolynomialLRWarmup`` or its older ``PolyScheduler`` (their states have
the same attributes) for two epochs of its loader, stepped on every micro-batch as ``train_v2.py`` does under
gradient accumulation, then cut into the ranks' shards by arcface_torch's rule, written out here on its own.
67 classes divide over neither 2 nor 3 ranks.
"""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backbones import get_model
from tests.helpers import (
    ROOT,
    gathered_head_after_resume,
    logged_lrs,
    on_ranks,
    reference_polynomial_warmup,
    saved_head,
    subprocess_env,
    train,
)
from trainer.import_arcface import import_run
from trainer.run_state import Schedule, step_lr, train_state_of
from utils.checkpoint import find_latest, load_common, read_manifest, step_dir
from utils.lr_scheduler import lr_at

CONFIG = "configs/debug_cpu"  # the tiny backbone, synthetic data, batch 8 per rank
CLASSES, IMAGES, BATCH, EPOCHS, WARMUP_EPOCHS, LR, DIM = 67, 240, 8, 4, 1, 0.1, 32
SETS = (f"num_classes={CLASSES}", f"num_image={IMAGES}", "max_steps=0", f"num_epoch={EPOCHS}",
        f"warmup_epoch={WARMUP_EPOCHS}", f"lr={LR}", "frequent=1", "save_every_steps=0")
DONE_EPOCHS = 2  # the arcface_torch run saved at the end of its second epoch


class PolynomialLRWarmup(torch.optim.lr_scheduler.LRScheduler):
    """arcface_torch's ``lr_scheduler.PolynomialLRWarmup`` as it behaves, with the attributes its state_dict carries
    (``warmup_iters``, ``total_iters``, ``power``): the constructor's step 0 keeps the optimizer's lr; step ``l``
    gives ``base · l / w`` while ``l <= w``, then ``base · (1 − (l − w) / (t − w)) ** power``; past ``t`` the last."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_iters: int, total_iters: int, power: float = 1.0):
        super().__init__(optimizer)
        self.total_iters, self.power, self.warmup_iters = total_iters, power, warmup_iters

    def get_lr(self) -> list[float]:
        step = self.last_epoch
        if step == 0 or step > self.total_iters:
            return [group["lr"] for group in self.optimizer.param_groups]
        if step <= self.warmup_iters:
            return [base * step / self.warmup_iters for base in self.base_lrs]
        progress = (step - self.warmup_iters) / (self.total_iters - self.warmup_iters)
        return [base * (1.0 - progress) ** self.power for base in self.base_lrs]


class PolyScheduler(torch.optim.lr_scheduler.LRScheduler):
    """arcface_torch's older ``lr_scheduler.PolyScheduler`` as it behaves, with the attributes its state_dict carries
    (``base_lr``, ``warmup_lr_init``, ``max_steps``, ``warmup_steps``, ``power`` = 2): its constructor leaves
    ``last_epoch`` at -1 after taking a step, so each update uses the LR of the step before (the first, step 0's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, max_steps: int, warmup_steps: int):
        self.base_lr, self.warmup_lr_init, self.max_steps, self.warmup_steps, self.power = (
            base_lr, 0.0001, max_steps, warmup_steps, 2)
        super().__init__(optimizer)
        self.last_epoch = -1

    def get_lr(self) -> list[float]:
        step = self.last_epoch
        if step == -1:
            return [self.warmup_lr_init for _ in self.optimizer.param_groups]
        if step < self.warmup_steps:
            return [self.base_lr * step / self.warmup_steps for _ in self.optimizer.param_groups]
        progress = (step - self.warmup_steps) / (self.max_steps - self.warmup_steps)
        return [self.base_lr * (1 - progress) ** self.power for _ in self.optimizer.param_groups]


def shard(num_classes: int, world: int, rank: int) -> tuple[int, int]:
    """``(class_start, num_local)`` of ``PartialFC_V2`` (arcface_torch's partial_fc_v2.py), written out here."""
    num_local = num_classes // world + int(rank < num_classes % world)
    return num_classes // world * rank + min(rank, num_classes % world), num_local


def write_arcface_run(folder: Path, world: int, optimizer: str = "sgd", prefix: str = "",
                      scheduler: str = "PolynomialLRWarmup", gradient_acc: int = 1) -> dict:
    """An arcface_torch output folder of a ``world``-GPU run after ``DONE_EPOCHS`` epochs (see the module
    docstring); ``prefix``: "module." for a backbone saved from its DDP wrapper; ``gradient_acc``: micro-batches
    per update (its ``global_step`` and scheduler count micro-batches). Returns what the files hold, unsharded:
    the backbone, the head (C, D), the optimizer's state by name and the head's, the global step and the LR
    arcface_torch's next update would use."""
    torch.manual_seed(world)
    model = get_model("tiny", num_features=DIM, widths=(8, 16, 16, 32))
    head = nn.Parameter(torch.normal(0, 0.01, (CLASSES, DIM)))  # every rank's rows, in class order
    groups = [{"params": model.parameters()}, {"params": [head]}]
    opt = (torch.optim.SGD(groups, lr=LR, momentum=0.9, weight_decay=5e-4) if optimizer == "sgd"
           else torch.optim.AdamW(groups, lr=LR, weight_decay=5e-4))
    per_epoch = IMAGES // (BATCH * world)  # train_v2.py's schedule: num_image // total_batch_size per epoch
    if scheduler == "PolyScheduler":
        scheduler = PolyScheduler(opt, LR, per_epoch * EPOCHS, per_epoch * WARMUP_EPOCHS)
    else:
        scheduler = PolynomialLRWarmup(opt, per_epoch * WARMUP_EPOCHS, per_epoch * EPOCHS)
    loader_len = -(-IMAGES // world) // BATCH  # its loader: DistributedSampler's ceil(N / W) samples, drop_last
    steps = DONE_EPOCHS * loader_len
    for step in range(steps):  # a few images stand in for the global batch: the state, not the accuracy, is tested
        images, labels = torch.randn(4, 3, 112, 112), torch.randint(0, CLASSES, (4,))
        logits = 64.0 * F.normalize(model(images)) @ F.normalize(head).t()  # (4, C)
        F.cross_entropy(logits, labels).backward()
        if (step + 1) % gradient_acc == 0:
            nn.utils.clip_grad_norm_(model.parameters(), 5)
            opt.step()
            opt.zero_grad()
        scheduler.step()
    full = opt.state_dict()
    head_id = full["param_groups"][1]["params"][0]
    backbone = {prefix + k: v for k, v in model.state_dict().items()}
    for rank in range(world):
        start, num_local = shard(CLASSES, world, rank)
        rank_opt = copy.deepcopy(full)
        rank_opt["state"][head_id] = {k: v[start:start + num_local].clone() if v.dim() else v.clone()
                                      for k, v in full["state"][head_id].items()}
        torch.save({"epoch": DONE_EPOCHS, "global_step": steps, "state_dict_backbone": backbone,
                    "state_dict_softmax_fc": {"weight": head.detach()[start:start + num_local].clone()},
                    "state_optimizer": rank_opt, "state_lr_scheduler": scheduler.state_dict()},
                   folder / f"checkpoint_gpu_{rank}.pt")
    torch.save(model.state_dict(), folder / "model.pt")
    names = [name for name, _ in model.named_parameters()]
    return {"backbone": model.state_dict(), "head": head.detach().clone(), "head_state": full["state"][head_id],
            "state": {names[i]: s for i, s in full["state"].items() if i != head_id}, "step": steps,
            "lr": opt.param_groups[0]["lr"]}


def run_tool(source: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python scripts/import_arcface.py SOURCE configs/debug_cpu --set ...`` as a user runs it."""
    return subprocess.run([sys.executable, "scripts/import_arcface.py", str(source), CONFIG, "--set", *SETS,
                           f"output={output}", *extra], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)


def check_imported(output: Path, run: dict, world: int, optimizer: str) -> Path:
    """The checkpoint holds the arcface_torch run: position, backbone, every class centre at its class id, the
    optimizer state of both, written by ``world`` ranks."""
    ckpt = find_latest(output)
    assert ckpt == step_dir(output, run["step"]), ckpt
    assert read_manifest(ckpt)["world_size"] == world
    common = load_common(ckpt)
    assert common["state"]["step"] == run["step"] and common["state"]["epoch"] == DONE_EPOCHS
    assert common["state"]["step_in_epoch"] == 0
    assert common["backbone"].keys() == run["backbone"].keys()
    assert all(torch.equal(common["backbone"][k], v) for k, v in run["backbone"].items())
    names = [n for n, _ in get_model("tiny", num_features=DIM, widths=(8, 16, 16, 32)).named_parameters()]
    ours = {names[i]: s for i, s in common["backbone_optimizer"]["state"].items()}
    assert ours.keys() == run["state"].keys()
    for name, saved in run["state"].items():
        assert ours[name].keys() == saved.keys() and all(torch.equal(ours[name][k], v) for k, v in saved.items())
    weight, state = saved_head(ckpt)
    assert torch.equal(weight, run["head"])
    if optimizer == "sgd":
        assert state.keys() == {"momentum_buffer"}
        assert torch.equal(state["momentum_buffer"], run["head_state"]["momentum_buffer"])
    else:
        assert state.keys() == {"exp_avg", "exp_avg_sq", "step"}
        assert torch.equal(state["exp_avg"], run["head_state"]["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], run["head_state"]["exp_avg_sq"])
        assert torch.equal(state["step"], torch.full((CLASSES,), float(run["head_state"]["step"])))
    assert torch.equal(torch.load(output / "model.pt", weights_only=True)["conv1.weight"],
                       run["backbone"]["conv1.weight"])
    return ckpt


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_head_of_two_gpus_lands_on_its_class_ids_and_resumes_on_three(tmp_path):
    world, continue_on = 2, 3
    source, output = tmp_path / "arcface", tmp_path / "ours"
    source.mkdir()
    run = write_arcface_run(source, world)
    proc = run_tool(source, output)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"imported {source} ({world} ranks, epoch 2, step "
                                                    f"{run['step']}) to {step_dir(output, run['step'])}"), lines
    assert proc.stderr == ""
    ckpt = check_imported(output, run, world, "sgd")
    step, weight, state = on_ranks(gathered_head_after_resume, continue_on, CONFIG, SETS, str(ckpt),
                                             str(output))[0]
    assert step == DONE_EPOCHS * (IMAGES // (BATCH * continue_on))  # the same epoch end in the new run's steps
    assert torch.equal(weight, run["head"])
    assert torch.equal(state["momentum_buffer"], run["head_state"]["momentum_buffer"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_continues_a_three_gpu_run_on_two_ranks_at_the_same_lr(tmp_path):
    source, output = tmp_path / "arcface", tmp_path / "ours"
    source.mkdir()
    run = write_arcface_run(source, 3)
    assert run_tool(source, output).returncode == 0
    check_imported(output, run, 3, "sgd")
    proc = train(CONFIG, output, *SETS, nproc=2)
    step = DONE_EPOCHS * (IMAGES // (BATCH * 2))
    assert f"at step {step} (epoch {DONE_EPOCHS}, step 0 in epoch)" in proc.stdout, proc.stdout[-3000:]
    assert "world size changed 3 -> 2" in proc.stdout
    per_epoch = IMAGES // (BATCH * 3)
    theirs = reference_polynomial_warmup(LR, per_epoch * WARMUP_EPOCHS, per_epoch * EPOCHS, 1.0, run["step"] + 1)
    assert abs(theirs[-1] - run["lr"]) < 1e-12  # the optimizer's lr is what arcface_torch's next update uses
    lrs = logged_lrs(output)
    assert min(lrs) == step + 1 and lrs[step + 1] == (EPOCHS * IMAGES // (BATCH * 2), f"{run['lr']:.6f}"), lrs
    assert find_latest(output) == step_dir(output, EPOCHS * IMAGES // (BATCH * 2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adamw_moments_and_a_ddp_prefixed_backbone(tmp_path):
    source, output = tmp_path / "arcface", tmp_path / "ours"
    source.mkdir()
    run = write_arcface_run(source, 2, optimizer="adamw", prefix="module.")
    proc = run_tool(source, output, "optimizer=adamw")
    assert proc.returncode == 0, proc.stderr
    ckpt = check_imported(output, run, 2, "adamw")
    step, weight, state = on_ranks(gathered_head_after_resume, 1, CONFIG, (*SETS, "optimizer=adamw"),
                                             str(ckpt), str(output))[0]
    assert torch.equal(weight, run["head"]) and torch.equal(state["exp_avg"], run["head_state"]["exp_avg"])


# ------------------------------------------------------------------------------------------------ mistakes

@pytest.fixture(scope="module")
def arcface_run(tmp_path_factory) -> Path:
    """A 3-GPU arcface_torch folder, copied by each test that changes it."""
    source = tmp_path_factory.mktemp("arcface") / "run"
    source.mkdir()
    write_arcface_run(source, 3)
    return source


def _copy(source: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(source, dest)
    return dest


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("import_arcface: error: "), err
    assert captured.out == ""
    return err[0]


def _main(source: Path, output: Path, *sets: str, options: tuple[str, ...] = ()) -> int:
    from scripts import import_arcface

    return import_arcface.main([str(source), CONFIG, "--set", *SETS, f"output={output}", *sets, *options])


def test_a_missing_rank_file_is_named(arcface_run, tmp_path, capsys):
    middle = _copy(arcface_run, tmp_path / "middle")
    (middle / "checkpoint_gpu_1.pt").unlink()
    assert _main(middle, tmp_path / "out") == 1
    assert _one_line(capsys).endswith(f"{middle}: checkpoint_gpu_1.pt missing (found ranks 0, 2); every rank of the "
                                      f"run saved its share of the class centres")
    last = _copy(arcface_run, tmp_path / "last")
    (last / "checkpoint_gpu_2.pt").unlink()
    assert _main(last, tmp_path / "out") == 1
    assert _one_line(capsys).endswith(f"{last}: checkpoint_gpu_2.pt missing? ranks 0-1 hold 23+22 class centres, the "
                                      f"first shares of a 3-rank run of the config's num_classes = 67 (if the run had "
                                      f"45 classes, set num_classes = 45)")
    assert not (tmp_path / "out").exists()


def test_shards_that_do_not_add_up_to_num_classes(arcface_run, tmp_path, capsys):
    assert _main(arcface_run, tmp_path / "out", "num_classes=70") == 2
    assert _one_line(capsys).endswith("the arcface_torch run's 3 ranks hold 67 class centres (23+22+22); "
                                      f"{CONFIG} has num_classes = 70")
    bad = _copy(arcface_run, tmp_path / "bad")
    ckpt = torch.load(bad / "checkpoint_gpu_0.pt", weights_only=True)
    ckpt["state_dict_softmax_fc"]["weight"] = ckpt["state_dict_softmax_fc"]["weight"][:20]
    torch.save(ckpt, bad / "checkpoint_gpu_0.pt")
    assert _main(bad, tmp_path / "out") == 1
    assert _one_line(capsys).endswith(f"{bad}: the ranks hold 20+22+22 = 64 class centres; arcface_torch's "
                                      f"PartialFC_V2 splits 64 classes over 3 ranks as 22+21+21")


def test_a_wrong_embedding_size_is_named(arcface_run, tmp_path, capsys):
    assert _main(arcface_run, tmp_path / "out", "embedding_size=16") == 2
    assert _one_line(capsys).endswith(f"the arcface_torch run's class centres have width 32; {CONFIG} has "
                                      f"embedding_size = 16")
    assert _main(arcface_run, tmp_path / "out", "network_kwargs={'widths': (8, 16, 16, 16)}") == 2
    assert "does not match network tiny" in _one_line(capsys)


def test_another_schedule_or_optimizer_is_refused_unless_asked(arcface_run, tmp_path, capsys):
    assert _main(arcface_run, tmp_path / "out", "lr=0.2", "num_epoch=5") == 2
    assert _one_line(capsys).endswith(
        f"{CONFIG} does not continue the arcface_torch run: lr 0.2 (arcface_torch: 0.1); total steps 50 = num_image "
        f"240 // (batch_size 8 x 3 ranks) x num_epoch 5 (arcface_torch: 40); make the config match (the same keys as "
        f"arcface_torch's), or pass --allow-changes to continue with the config's values")
    assert _main(arcface_run, tmp_path / "out", "optimizer=adamw") == 2
    assert _one_line(capsys).endswith(f"{CONFIG} has optimizer = 'adamw'; the arcface_torch run trained with 'sgd', "
                                      f"whose state is what the checkpoint holds")
    assert _main(arcface_run, tmp_path / "out", "num_epoch=5", options=("--allow-changes",)) == 0
    captured = capsys.readouterr()
    assert captured.err == ("import_arcface: warning: the run continues with the config's total steps 50 = num_image "
                            "240 // (batch_size 8 x 3 ranks) x num_epoch 5 (arcface_torch: 40)\n")
    assert "next LR 0.075 (arcface_torch's: 0.0666667)" in captured.out


def test_an_output_holding_a_run_is_refused_unless_archived(arcface_run, tmp_path, capsys):
    output = tmp_path / "out"
    assert _main(arcface_run, output) == 0
    capsys.readouterr()
    assert _main(arcface_run, output) == 2
    assert _one_line(capsys).endswith(f"output {output} already holds a run (step_000000020); use another `output`, "
                                      f"or --archive to move it to {output}/archive_<time>/")
    assert _main(arcface_run, output, options=("--archive",)) == 0
    assert "moved step_000000020 to" in capsys.readouterr().err
    assert sorted(p.name for p in output.glob("archive_*/*")) == ["model.json", "model.pt", "step_000000020"]
    assert find_latest(output) == step_dir(output, 20)


def test_a_file_that_would_run_code_is_refused(arcface_run, tmp_path, capsys):
    import pickle

    class Payload:
        def __reduce__(self):
            return (print, ("this ran",))

    hostile = _copy(arcface_run, tmp_path / "hostile")
    (hostile / "checkpoint_gpu_2.pt").write_bytes(pickle.dumps(Payload(), protocol=2))
    assert _main(hostile, tmp_path / "out") == 1
    line = _one_line(capsys)
    assert f"{hostile / 'checkpoint_gpu_2.pt'}: refused" in line and "this ran" not in line


# ------------------------------------------------------------------------------------------------ the LR

def _import(source: Path, output: Path, *sets: str) -> str:
    """``import_run`` (the library) with the tests' config; its summary line. No warnings."""
    warnings: list[str] = []
    line = import_run(source, CONFIG, [*SETS, f"output={output}", *sets], False, False, warnings.append)
    assert warnings == []
    return line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_imported_run_made_longer_goes_on_from_arcface_torch_s_lr_for_its_step(tmp_path):
    """The checkpoint records the LR of its step, the one arcface_torch's next update would use; continued with a
    longer schedule (``--resume``), the run trains that step at that LR, then decays to 0 at the new end."""
    source, output = tmp_path / "arcface", tmp_path / "ours"
    source.mkdir()
    run = write_arcface_run(source, 3)
    _import(source, output)
    common = load_common(find_latest(output))
    assert common["lr"] == pytest.approx(run["lr"], rel=1e-12)
    # Here on 1 rank: 30 steps per epoch, so arcface_torch's epoch-2 end is step 60; 3 epochs now (90 steps).
    proc = train(CONFIG, output, *SETS, "num_epoch=3", "--resume")
    assert "at step 60 (epoch 2, step 0 in epoch)" in proc.stdout and "goes on from" in proc.stdout, proc.stdout[-3000:]
    lrs = logged_lrs(output)  # the line of step k reports the LR of step k - 1
    assert min(lrs) == 61 and float(lrs[61][1]) == pytest.approx(run["lr"], abs=1e-6), lrs
    assert float(lrs[90][1]) == pytest.approx(run["lr"] / 30, abs=1e-6)


def test_an_older_poly_scheduler_run_continues_at_our_lr_for_its_step(tmp_path):
    """arcface_torch's older ``PolyScheduler`` applied each LR one step late: its next update would use step S − 1's.
    The run continues on our curve (power 2): step S at step S's LR, which the checkpoint records."""
    source, output = tmp_path / "arcface", tmp_path / "ours"
    source.mkdir()
    run = write_arcface_run(source, 2, scheduler="PolyScheduler")
    step, per_epoch = run["step"], IMAGES // (BATCH * 2)
    ours = lr_at(step, LR, per_epoch * WARMUP_EPOCHS, per_epoch * EPOCHS, power=2)
    assert run["lr"] == pytest.approx(lr_at(step - 1, LR, per_epoch * WARMUP_EPOCHS, per_epoch * EPOCHS, power=2))
    line = _import(source, output, "lr_power=2")
    assert f"next LR {ours:.6g} (arcface_torch's: {run['lr']:.6g})" in line, line
    common = load_common(find_latest(output))
    assert train_state_of(common).step == step and common["lr"] == pytest.approx(ours, rel=1e-12)
    schedule = Schedule(LR, per_epoch * WARMUP_EPOCHS, per_epoch * EPOCHS, 2.0)
    assert step_lr(step, train_state_of(common), schedule) == common["lr"]  # what train.py's next step takes


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # as train_v2.py does
def test_gradient_accumulation_counts_optimizer_steps_and_a_save_inside_an_accumulation_is_refused(tmp_path, capsys):
    """With ``gradient_acc = 2`` arcface_torch's ``global_step`` (and its scheduler) count micro-batches: 20 of them
    are our step 10, at the LR its scheduler had reached. A save after an odd number cannot be continued: the
    accumulated gradient is not in the checkpoint."""
    source, output = tmp_path / "arcface", tmp_path / "ours"
    source.mkdir()
    run = write_arcface_run(source, 3, gradient_acc=2)
    _import(source, output, "gradient_acc=2")
    ckpt = find_latest(output)
    common = load_common(ckpt)
    assert ckpt == step_dir(output, run["step"] // 2) and train_state_of(common).epoch == DONE_EPOCHS
    assert common["lr"] == pytest.approx(run["lr"], rel=1e-12)
    weight, state = saved_head(ckpt)
    assert torch.equal(weight, run["head"])
    assert torch.equal(state["momentum_buffer"], run["head_state"]["momentum_buffer"])
    assert _main(source, tmp_path / "other", "gradient_acc=3") == 2  # 20 micro-batches: not 3 per update
    assert _one_line(capsys).endswith(
        f"{CONFIG} has gradient_acc = 3, but the arcface_torch run saved after 20 micro-batches, inside an "
        f"accumulation whose gradient the checkpoint does not hold; set gradient_acc to the run's")
    assert not (tmp_path / "other").exists()
