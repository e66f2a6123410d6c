"""A short demo-like run: scripts/demo.py end to end on a small synthetic set, 2 gloo ranks, a few dozen
steps; verification accuracy must move above the untrained baseline on every target (with the demo's earlier
(2, 16, 64, 128) network, 40 steps did not on syn_hard in fp32, on a CPU without bf16 arithmetic: 0.6833 both; 80
steps gave 0.79 against 0.68). 150 pairs a target: the trained network's lead, about 0.2, is several standard
deviations of an accuracy on that many pairs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, subprocess_env

SMALL = """
config.rec = {rec!r}
config.output = {output!r}
config.num_classes = 40
config.num_image = 480
config.batch_size = 16
config.max_steps = 80
config.verbose = 80
config.save_every_steps = 20
"""
PAIRS = 150  # per verification target


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_short_demo_beats_the_untrained_baseline(tmp_path):
    config = tmp_path / "demo_small.py"
    output = tmp_path / "out"
    config.write_text((ROOT / "configs" / "demo_cpu.py").read_text()
                      + SMALL.format(rec=str(tmp_path / "data"), output=str(output)))
    # A shell's OMP_NUM_THREADS made for one process: the demo gives each rank its share of the cores instead.
    env = {**subprocess_env(), "OMP_NUM_THREADS": "5"}
    proc = subprocess.run([sys.executable, "scripts/demo.py", "--config", str(config), "--pairs", str(PAIRS)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "=== 1/3 generating synthetic identities: " in proc.stdout and "(kept for the next run)" in proc.stdout
    from scripts.demo import usable_cores

    per_rank = max(1, usable_cores() // 2)
    assert f"{per_rank} torch threads per rank" in (output / "training.log").read_text()
    results = json.loads((output / "results.json").read_text())
    assert sorted(results) == ["syn_easy", "syn_hard"]
    for target, r in results.items():
        assert set(r) == {"acc", "acc_untrained"}
        assert r["acc"] > r["acc_untrained"], f"{target}: trained {r['acc']} <= untrained {r['acc_untrained']}"
    assert "| syn_easy |" in proc.stdout and "results:" in proc.stdout
    for name in ("training.log", "model.pt", "roc.png"):
        assert (output / name).is_file(), name
    assert list((output / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "data" / "preview.png").is_file()
    assert "verification at step 80" in (output / "training.log").read_text()
    # bf16 (the demo's config) where this CPU computes it, fp32 elsewhere; training and verification alike.
    from utils.precision import cpu_computes_bf16

    precision = "bf16" if cpu_computes_bf16() else "fp32"
    assert f"training on 2 CPU ranks x {per_rank} thread" in proc.stdout and f"({precision})" in proc.stdout
    assert f"--precision {precision}" in proc.stdout
    # README: a second run resumes at the last step, trains nothing and verifies again, with the same results
    again = subprocess.run([sys.executable, "scripts/demo.py", "--config", str(config), "--pairs", str(PAIRS)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "resumed from" in again.stdout and "at step 80 " in again.stdout
    assert f"=== 1/3 synthetic identities: already in {tmp_path / 'data'}, nothing to generate" in again.stdout
    assert "done: 80 steps" in again.stdout and " step 20/80 " not in again.stdout
    assert json.loads((output / "results.json").read_text()) == results


@pytest.mark.process
def test_side_by_side_steps_print_in_order_and_stop_on_a_failure(capsys, monkeypatch):
    from scripts import demo

    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)  # side by side, one thread each, on any machine

    ok = [sys.executable, "-c", "import os; print('first', os.environ['OMP_NUM_THREADS'])"]
    demo.run_side_by_side([(ok, "step one"), ([sys.executable, "-c", "print('second')"], "step two")])
    out = capsys.readouterr().out
    assert out.index("=== step one") < out.index("first 1") < out.index("=== step two") < out.index("second")

    failing = [sys.executable, "-c", "import sys; print('broken'); sys.exit(7)"]
    with pytest.raises(SystemExit) as exc:
        demo.run_side_by_side([(failing, "bad step"), (ok, "good step")])
    assert exc.value.code == 7
    captured = capsys.readouterr()
    assert "broken" in captured.out and "demo: bad step failed with exit code 7" in captured.err


@pytest.mark.process
@pytest.mark.timeout(60)
def test_sigterm_stops_the_running_step_with_sigterm_and_exits_143(tmp_path, capsys):
    """SIGTERM (a scheduler) unwinds the demo through utils.cli.run_tool, as main runs it: the running step gets
    SIGTERM too (torchrun forwards it to its ranks; a SIGKILL would orphan them) and is waited for; exit 143."""
    import os
    import signal
    import threading
    import time

    from scripts import demo
    from utils.cli import run_tool

    started, stopped = tmp_path / "started", tmp_path / "stopped"
    step = (f"import pathlib, signal, sys, time\nstopped = pathlib.Path({str(stopped)!r})\n"
            "signal.signal(signal.SIGTERM, lambda *a: (stopped.write_text('term'), sys.exit(0)))\n"
            f"pathlib.Path({str(started)!r}).touch()\ntime.sleep(50)\n")

    def terminate_when_started():
        deadline = time.monotonic() + 40
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_started, daemon=True).start()
    assert run_tool("demo", lambda: demo.run([sys.executable, "-c", step], "a long step", 1)) == 143
    assert stopped.read_text() == "term"
    assert capsys.readouterr().err.splitlines()[-1] == "demo: interrupted"


@pytest.mark.parametrize("hardware_bf16", [True, False])
def test_demo_trains_and_verifies_bf16_only_where_the_cpu_computes_it(tmp_path, monkeypatch, capsys, hardware_bf16):
    # The demo's config asks for bf16; on a CPU that emulates it the demo says so and runs fp32 throughout.
    import utils.precision
    from scripts import demo

    monkeypatch.setattr(utils.precision, "cpu_computes_bf16", lambda: hardware_bf16)
    config = tmp_path / "demo_small.py"
    output = tmp_path / "out"
    config.write_text((ROOT / "configs" / "demo_cpu.py").read_text()
                      + SMALL.format(rec=str(tmp_path / "data"), output=str(output)))
    commands = []
    monkeypatch.setattr(demo, "run", lambda cmd, what, threads: commands.append(cmd))

    def verified(steps):
        for cmd, _ in steps:
            commands.append(cmd)
            row = {"pairs": 300, "acc": 0.9, "val": 0.5}
            path = cmd[cmd.index("--json") + 1]
            output.mkdir(exist_ok=True)
            with open(path, "w") as f:
                json.dump({"syn_easy": row, "syn_hard": row}, f)

    monkeypatch.setattr(demo, "run_side_by_side", verified)
    assert demo.main(["--config", str(config)]) == 0
    train_cmd = next(c for c in commands if "train.py" in c)
    verify_cmds = [c for c in commands if "eval.verify" in c]
    precision = "bf16" if hardware_bf16 else "fp32"
    assert len(verify_cmds) == 2 and all(c[c.index("--precision") + 1] == precision for c in verify_cmds)
    assert ("--set" in train_cmd and train_cmd[train_cmd.index("--set") + 1] == "bf16=false") is not hardware_bf16
    said = "does not compute bfloat16 in hardware" in capsys.readouterr().out
    assert said is not hardware_bf16
    if hardware_bf16:
        return
    # README: the baseline is the same network untrained: the weights the trainer starts from.
    import torch

    import trainer.build
    from eval.model_options import backbone_from_options
    from scripts import verify
    from utils.config import load_config

    untrained = next(c for c in verify_cmds if "--random-init" in c)
    args = verify.parse_args(untrained[untrained.index("eval.verify") + 1:])
    baseline = backbone_from_options(args)
    cfg = load_config(str(config))
    torch.manual_seed(cfg.seed)  # as trainer.build.build, before it builds the backbone
    start = trainer.build.build_backbone(cfg, torch.device("cpu"))
    theirs, ours = start.state_dict(), baseline.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_makefile_venv_byte_compiles_every_installed_module_the_product_imports(tmp_path):
    """`make` compiles the venv with compileall but leaves out installed packages' tests and pip/setuptools:
    nothing the trainer, the verification, the demo, the plots or the tests import may be among them (under
    PYTHONDONTWRITEBYTECODE, which some machines set, such a module would be compiled again by every process)."""
    venv = ROOT / ".venv"
    if not (venv / ".installed").exists() or sys.prefix != str(venv):
        pytest.skip("runs in the .venv that `make` builds")
    code = """
import importlib.util, json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import onnx, onnxruntime, pytest, sklearn.metrics, torch.distributed.run, torch.utils.tensorboard
import train, eval.verify, eval.ijb, scripts.demo, scripts.make_synthetic
plt.figure().savefig(sys.argv[1])
site = [p for p in sys.path if p.endswith("site-packages")][0]
files = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
print(json.dumps([f for f in files if f.startswith(site) and f.endswith(".py")
                  and not __import__("os").path.exists(importlib.util.cache_from_source(f))]))
"""
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "plot.png")], cwd=ROOT,
                          env={**subprocess_env(), "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    missing = json.loads(proc.stdout.strip().splitlines()[-1])
    assert missing == [], f"{len(missing)} imported modules without a .pyc, e.g. {missing[:5]}"


def test_each_demo_step_gets_its_threads_whatever_the_shell_says():
    from scripts.demo import child_env

    assert child_env(1, {"OMP_NUM_THREADS": "8", "PATH": "/bin"}) == {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
