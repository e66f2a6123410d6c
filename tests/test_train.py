"""The trainer end to end: real torchrun runs of configs/debug_cpu.py on CPU (gloo), resume, two-node launch,
gradient accumulation, and ONNX export of what it trained (another world size:
reliability/test_world_size_change.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.local_ranks import free_port, run_on_local_ranks
from tests.helpers import (
    FIXTURES,
    ROOT,
    copy_checkpoints_until,
    faces,
    load_model,
    logged_losses,
    max_difference,
    on_ranks,
    subprocess_env,
    tiny_job,
    train,
    train_here,
    two_nodes,
)
from trainer.run_state import TrainState

CONFIG = "configs/debug_cpu"
# 16 optimizer steps on 2 ranks (one epoch of 256 images at 8 per rank), checkpoints every 4, all kept.
RUN = ("max_steps=16", "save_every_steps=4", "keep_checkpoints=10", "frequent=1")


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    """One uninterrupted 2-rank run that several tests compare against."""
    output = tmp_path_factory.mktemp("train") / "run"
    train(CONFIG, output, *RUN, nproc=2)
    return output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_two_ranks_trains_and_writes_everything(two_rank_run):
    from backbones import get_model

    losses = logged_losses(two_rank_run)
    assert sorted(losses) == list(range(1, 17)), losses
    first, last = float(losses[1]), sum(float(losses[s]) for s in range(13, 17)) / 4
    assert last < first, f"loss did not fall: step 1 {first}, steps 13-16 mean {last}"
    assert list((two_rank_run / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    # README's training outputs: train/loss, train/lr, train/samples_per_sec each logged line (here every step).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(two_rank_run / "tensorboard")).Reload()
    assert {"train/loss", "train/lr", "train/samples_per_sec"} <= set(events.Tags()["scalars"]), events.Tags()
    board = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(board) == list(range(1, 17)) and all(e.value > 0 for e in events.Scalars("train/samples_per_sec"))
    assert all(abs(board[s] - float(losses[s])) <= 1e-4 for s in board), (board, losses)
    steps = sorted(p.name for p in (two_rank_run / "checkpoints").iterdir())
    assert steps == [f"step_{s:09d}" for s in (4, 8, 12, 16)], steps
    for ckpt in (two_rank_run / "checkpoints").iterdir():
        assert sorted(p.name for p in ckpt.iterdir()) == sorted(
            ["common.pt", "manifest.json", "head_rank0.pt", "head_rank1.pt", "rng_rank0.pt", "rng_rank1.pt"])
    model = get_model("tiny", num_features=32, widths=(8, 16, 16, 32))
    model.load_state_dict(load_model(two_rank_run), strict=True)
    log = (two_rank_run / "training.log").read_text()
    assert "network_kwargs" in log and "samples/s" in log and "lr" in log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_continues_with_the_same_losses_and_weights(two_rank_run, tmp_path):
    output = copy_checkpoints_until(two_rank_run, tmp_path / "resumed", step=8)
    proc = train(CONFIG, output, *RUN, "resume=true", nproc=2)
    assert "resumed from" in proc.stdout
    want, got = logged_losses(two_rank_run), logged_losses(output)
    assert sorted(got) == list(range(9, 17)), f"resumed run logged steps {sorted(got)}; expected 9..16"
    assert {s: want[s] for s in got} == got
    assert max_difference(load_model(two_rank_run), load_model(output)) <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_node_launch_trains_like_one_node(two_rank_run, tmp_path):
    """Two torchrun processes (--nnodes=2, one rank each, c10d rendezvous on 127.0.0.1) started through
    scripts/dist.sh --run, as a user starts one per node."""
    output = tmp_path / "two_nodes"
    nodes = two_nodes(CONFIG, output, RUN, RUN)
    assert [code for code, _ in nodes] == [0, 0], "\n".join(out[-3000:] for _, out in nodes)
    got, want = logged_losses(output), logged_losses(two_rank_run)
    assert got == want, (f"two-node losses differ at steps {[s for s in want if got.get(s) != want[s]]}: "
                         f"{got} vs {want}\n" + nodes[0][1][-3000:])
    assert max_difference(load_model(two_rank_run), load_model(output)) <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_torch_distributed_launch_and_its_local_rank_argument_are_accepted(tmp_path):
    """arcface_torch's speed benchmark starts ``python -m torch.distributed.launch``, which passes
    ``--local-rank=N``; ``--local_rank`` is its older spelling."""
    launch = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=1", "--master_addr=127.0.0.1",
              f"--master_port={free_port()}", "train.py", CONFIG, "--set", f"output={tmp_path / 'launch'}",
              "max_steps=2", "frequent=1"]
    proc = subprocess.run(launch, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(logged_losses(tmp_path / "launch")) == [1, 2]
    plain = train(CONFIG, tmp_path / "plain", "max_steps=2", "frequent=1", "--local_rank", "0")
    assert "step 2/2" in plain.stdout


@pytest.mark.process
def test_train_cli_rejects_a_misspelt_key_with_a_suggestion(tmp_path):
    proc = train(CONFIG, tmp_path, "momentun=0.8", check=False, timeout=120)
    assert proc.returncode == 2
    assert "momentun" in proc.stderr and "'momentum'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    # The in-process run of the tests that check mistakes (tests.helpers.train_here) says exactly what this one does.
    here = train_here(CONFIG, tmp_path, "momentun=0.8", check=False)
    assert (here.returncode, here.stdout, here.stderr) == (proc.returncode, proc.stdout, proc.stderr)


# ---------------------------------------------------------------------------------------- accumulation
def _accumulation_steps(rank: int, world_size: int) -> list[torch.Tensor]:
    """One optimizer step with 2 micro-batches of B and one with a single batch of 2B, from equal weights."""
    from torch import nn

    import train
    from losses import ArcFace
    from partial_fc import PartialFC

    results = []
    for acc in (2, 1):
        torch.manual_seed(0)
        # No batch statistics: accumulation over micro-batches is then exactly a bigger batch.
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 16), nn.PReLU(16), nn.Linear(16, 16))
        head = PartialFC(ArcFace(s=8.0, margin=0.2), 16, 10, 1.0)
        torch.manual_seed(1)
        head.weight.data.normal_(0, 0.5)
        job = tiny_job(rank, world_size, [f"gradient_acc={acc}", f"batch_size={8 // acc}", "sample_rate=1.0",
                                          "num_classes=10", "clip_grad_norm=0", "warmup_epoch=0", "max_steps=4"],
                       model, head)
        g = torch.Generator().manual_seed(100 + rank)
        images = torch.randn(8, 3, 4, 4, generator=g)
        labels = torch.randint(0, 10, (8,), generator=g)
        micro = [(images[i * 8 // acc:(i + 1) * 8 // acc], labels[i * 8 // acc:(i + 1) * 8 // acc])
                 for i in range(acc)]
        train.optimizer_step(job, TrainState(step=1), micro)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()] + [head.weight.detach().flatten()]))
    return results


@pytest.mark.process
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2])
def test_gradient_accumulation_of_two_micro_batches_equals_one_double_batch(world_size):
    for accumulated, single in on_ranks(_accumulation_steps, world_size):
        assert torch.allclose(accumulated, single, atol=1e-6, rtol=1e-5), (accumulated - single).abs().max()


# ---------------------------------------------------------------------------------------- export
@pytest.mark.process
@pytest.mark.timeout(180)
def test_onnx_export_round_trip_and_inference(two_rank_run, tmp_path):
    from torchvision.io import encode_jpeg

    onnx_path = tmp_path / "tiny.onnx"
    kwargs = '{"widths": [8, 16, 16, 32]}'
    proc = subprocess.run([sys.executable, "scripts/torch2onnx.py", "--network", "tiny", "--embedding-size", "32",
                           "--network-kwargs", kwargs, "--weights", str(two_rank_run / "model.pt"),
                           "--output", str(onnx_path)], cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert onnx_path.is_file() and "max |torch - onnxruntime|" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr  # our choice of exporter is not the user's to be warned about

    import onnxruntime

    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    for batch in (1, 5):  # the batch axis is dynamic
        out = session.run(None, {session.get_inputs()[0].name: torch.zeros(batch, 3, 112, 112).numpy()})[0]
        assert out.shape == (batch, 32)

    image = tmp_path / "face.jpg"
    image.write_bytes(encode_jpeg(torch.randint(0, 256, (3, 112, 112), dtype=torch.uint8)).numpy().tobytes())
    proc = subprocess.run([sys.executable, "scripts/inference.py", "--network", "tiny", "--embedding-size", "32",
                           "--network-kwargs", kwargs, "--weights", str(two_rank_run / "model.pt"),
                           "--image", str(image), "--output", str(tmp_path / "emb.npy")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import numpy as np

    assert np.load(tmp_path / "emb.npy").shape == (32,)

    proc = subprocess.run([sys.executable, "scripts/torch2onnx.py", "--network", "r18", "--weights",
                           str(two_rank_run / "model.pt"), "--output", str(tmp_path / "x.onnx")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not match network r18" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------- verification set
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_missing_verification_file_is_skipped_on_every_rank(tmp_path):
    """configs/base.py promises that missing val_targets files are skipped: with 2 ranks, rank 0 decides for
    both, one warning names the file, and training goes on (no rank waits for one that stopped)."""
    data = faces(tmp_path / "faces")
    output = tmp_path / "run"
    proc = train(CONFIG, output, f"rec={data}", "num_classes=8", "num_image=32", "batch_size=4", "max_steps=4",
                 "val_targets=missing_set", "verbose=2", "frequent=1", nproc=2)
    log = (output / "training.log").read_text()
    warning = f"verification target missing_set: {data / 'missing_set.bin'} does not exist; skipped"
    assert log.count(warning) == 1, log[-3000:]
    assert "step 4/4" in log and "Traceback" not in proc.stderr


@pytest.mark.process
def test_num_classes_and_num_image_left_none_come_from_the_rec(tmp_path):
    """configs/base.py: ``num_classes``/``num_image`` = None are read from the dataset (the insightface
    header record and index of the MXNet-written fixture: 6 classes, 30 images)."""
    output = tmp_path / "run"
    train(CONFIG, output, f"rec={FIXTURES / 'rec_insightface'}", "num_classes=None", "num_image=None",
          "batch_size=4", "max_steps=2", "frequent=1", "save_every_steps=0")
    log = (output / "training.log").read_text()
    assert (f"data {FIXTURES / 'rec_insightface'}: num_classes = 6 (from the dataset), num_image = 30 (from the "
            f"dataset)") in log, log[-3000:]
    assert "step 2/2" in log
    assert load_model(output)  # the run ended with its model


# ---------------------------------------------------------------------------------------- CUDA hygiene, on the CPU
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compile_key_trains_the_compiled_backbone_and_saves_the_plain_one(tmp_path):
    # aot_eager: traced by dynamo and AOT autograd like inductor, without generated C++ kernels. Inductor lays
    # this network's convolutions out channels-last on the CPU, which the trainer refuses for its narrow widths
    # (the test below); CUDA runs use inductor (tests/test_cuda.py).
    proc = train(CONFIG, tmp_path, "compile=true", "compile_backend=aot_eager", "max_steps=3", "frequent=1",
                 "save_every_steps=3")
    log = (tmp_path / "training.log").read_text()
    assert "step 3/3" in log and "compile" in log, proc.stdout[-2000:]
    from backbones import get_model

    model = get_model("tiny", num_features=32, widths=(8, 16, 16, 32))
    model.load_state_dict(load_model(tmp_path), strict=True)  # model.pt holds no "_orig_mod." prefix


@pytest.mark.process
@pytest.mark.timeout(300)
def test_compile_head_key_trains_like_the_eager_head(tmp_path):
    """``compile_head = True`` (docs/partial_fc.md): the fused head's local parts through torch.compile (inductor's
    C++ here) train the same steps as the eager head: logged losses and the saved backbone to rounding."""
    runs = {}
    for name, sets in (("eager", ()), ("compiled", ("compile_head=true",))):
        train(CONFIG, tmp_path / name, "max_steps=4", "frequent=1", "save_every_steps=4", *sets)
        runs[name] = (logged_losses(tmp_path / name), load_model(tmp_path / name))
    (eager, eager_model), (compiled, compiled_model) = runs["eager"], runs["compiled"]
    assert sorted(eager) == sorted(compiled) == [1, 2, 3, 4]
    close = all(abs(float(eager[k]) - float(compiled[k])) <= 1e-4 * abs(float(eager[k])) for k in eager)
    assert close, (eager, compiled)
    # The heads agree to ~1e-7 (test_partial_fc.py); four SGD steps at lr 0.1 through the backbone's BatchNorms carry
    # that rounding to ~1e-4 in the weights (measured 0.9e-4 and 1.4e-4); one step moves them by up to ~0.15.
    assert max_difference(eager_model, compiled_model) < 1e-3


def _ddp_warnings(rank: int, world_size: int) -> list[str]:
    import warnings

    from utils.distributed import wrap_ddp

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = wrap_ddp(torch.nn.Linear(4, 4), torch.device("cpu"))
    assert ddp.gradient_as_bucket_view
    return [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.mark.process
@pytest.mark.timeout(60)
def test_ddp_wrapper_raises_no_deprecation_warning():
    assert run_on_local_ranks(_ddp_warnings, 1) == [[]]


def test_tf32_and_cudnn_benchmark_keys_set_torch_s_switches_on_cuda_only():
    from utils.precision import configure_cuda

    def switches():
        return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)

    saved = switches()
    try:
        for tf32, benchmark in ((False, True), (True, False), (True, True)):
            configure_cuda(torch.device("cuda"), tf32, benchmark)
            assert switches() == (tf32, tf32, benchmark)
        configure_cuda(torch.device("cpu"), False, False)  # the CPU has neither: left alone
        assert switches() == (True, True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved


@pytest.mark.process
def test_model_json_describes_model_pt(two_rank_run):
    import json

    from utils.checkpoint import find_latest, load_common

    card = json.loads((two_rank_run / "model.json").read_text())
    saved = load_common(find_latest(two_rank_run), mmap=True)["fingerprint"]  # the run's own fingerprint
    assert card == {"format": 1, "network": "tiny", "network_kwargs": {"widths": [8, 16, 16, 32]}, "embedding_size": 32,
                    "input_size": [112, 112], "normalisation": "RGB, (x - 127.5) / 127.5", "fingerprint": saved,
                    "step": 16}
    assert len(saved) == 16


# ---------------------------------------------------------------------------------------- channels-last
WIDE_TINY = 'network_kwargs={"widths": (16, 16, 16, 32)}'  # no strided 1x1 convolution below 16 input channels


@pytest.mark.process
@pytest.mark.timeout(240)
def test_channels_last_trains_like_the_default_memory_format(tmp_path):
    """README: channels_last changes the memory format only, so one step's weights match to rounding."""
    runs = {}
    for fmt in ("false", "true"):
        train(CONFIG, tmp_path / fmt, WIDE_TINY, f"channels_last={fmt}", "max_steps=1", "save_every_steps=1")
        runs[fmt] = load_model(tmp_path / fmt)
    difference = max_difference(runs["false"], runs["true"])
    # Other convolution kernels round differently (~1e-5 after one step at lr 0.1): 0 would mean that the
    # key changed nothing.
    assert 0 < difference <= 5e-5, difference


@pytest.mark.process
@pytest.mark.timeout(120)
def test_channels_last_is_refused_on_the_cpu_for_narrow_strided_convolutions(tmp_path):
    proc = train(CONFIG, tmp_path, "channels_last=true", "max_steps=2", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "layer1.0.downsample.0 (8 -> 8, 1x1, stride 2)" in errors[0], proc.stderr[-2000:]
    assert "set channels_last = False" in errors[0]
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_inductor_is_refused_on_the_cpu_for_narrow_strided_convolutions(tmp_path):
    proc = train(CONFIG, tmp_path, "compile=true", "max_steps=2", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "compile = True with compile_backend = 'inductor' on the CPU" in errors[0], errors
    assert "layer1.0.downsample.0 (8 -> 8, 1x1, stride 2)" in errors[0]
    assert "set compile = False or compile_backend = 'aot_eager'" in errors[0]


def test_a_path_that_cannot_be_checked_is_a_config_mistake_on_that_rank(monkeypatch):
    """A folder on the way that this user may not read raises OSError from the path checks: it is the rank's
    one-line mistake (agreed with the others), not a traceback that leaves them waiting in the all-gather."""
    from trainer import preflight
    from utils.config import load_config

    def unreadable(cfg):
        raise PermissionError(13, "Permission denied", "/data/private/faces")

    monkeypatch.setattr(preflight, "check_paths", unreadable)
    with pytest.raises(ValueError, match=r"cannot check the config's paths .*Permission denied: '/data/private/faces'"):
        preflight.check_on_every_rank(load_config(CONFIG), 0)


def test_when_a_run_saves_with_short_epochs():
    """Epoch ends save unless epochs are shorter than save_every_steps; the last step always saves."""
    from trainer.checkpointing import checkpoint_due

    def saves(epoch: int, total: int, every: int) -> list[int]:
        return [s for s in range(1, total + 1) if checkpoint_due(s, s % epoch == 0, epoch, total, every)]

    assert saves(4, 40, 10) == [10, 20, 30, 40]  # 4-step epochs: every 10 steps, not every 4
    assert saves(16, 41, 10) == [10, 16, 20, 30, 32, 40, 41]  # epochs of 16: their ends and every 10 steps
    assert saves(4, 13, 0) == [4, 8, 12, 13]  # save_every_steps = 0: epoch ends and the last step


@pytest.mark.process
def test_a_small_dataset_s_short_epochs_write_a_checkpoint_every_save_every_steps(tmp_path):
    """A step-based run over 4-step epochs (32 images, batch 8) writes a checkpoint every save_every_steps steps,
    not one per epoch, and its log says which key set its length."""
    output = tmp_path / "run"
    saved = []
    train(CONFIG, output, "num_image=32", "max_steps=20", "save_every_steps=10", "keep_checkpoints=5",
          "frequent=10")
    log = (output / "training.log").read_text()
    saved = [line.split("checkpoint ")[1].split(" ")[0] for line in log.splitlines() if "(step " in line
             and "checkpoint " in line]
    assert [p.rsplit("step_", 1)[1] for p in saved] == ["000000010", "000000020"], log[-3000:]
    assert "training: 20 steps, set by max_steps = 20 (num_epoch = 20 would be 80); 4 steps per epoch" in log


@pytest.mark.process
def test_a_checkpoint_of_the_previous_identity_rule_resumes(tmp_path):
    """An image-folder run whose checkpoint recorded the data as releases before the one identity-folder rule
    identified it (every file under rec, a Thumbs.db too) resumes by itself, keeping that identity."""
    import json

    from dataset import data_identity, legacy_data_identity
    from utils.checkpoint import MANIFEST, find_latest
    from utils.config import fingerprint, load_config

    data = faces(tmp_path / "faces")
    (data / "id0" / "Thumbs.db").write_bytes(b"thumbnails")
    output = tmp_path / "run"
    sets = [f"rec={data}", "num_classes=8", "num_image=32", "batch_size=4", "frequent=1", "save_every_steps=2"]
    train(CONFIG, output, *sets, "max_steps=4")
    legacy = legacy_data_identity(str(data))
    assert legacy is not None and legacy != data_identity(str(data))
    # The checkpoint as the previous release wrote it: its data identity and the fingerprint over it.
    latest = find_latest(output)
    common = torch.load(latest / "common.pt", weights_only=True)
    cfg = load_config(CONFIG, [*sets, "max_steps=4"])
    common["data"], common["fingerprint"] = legacy, fingerprint(cfg, legacy)
    torch.save(common, latest / "common.pt")
    manifest = json.loads((latest / MANIFEST).read_text())
    manifest["files"]["common.pt"] = (latest / "common.pt").stat().st_size
    (latest / MANIFEST).write_text(json.dumps(manifest))
    train(CONFIG, output, *sets, "max_steps=4", "num_epoch=20")  # the same config: auto-resume, nothing to train
    log = (output / "training.log").read_text()
    assert "identifies the data as releases before the identity-folder rule did" in log, log[-3000:]
    assert f"resumed from {latest} at step 4" in log
