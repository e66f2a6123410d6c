"""A short demo-like run: scripts/demo.py end to end on a small synthetic set, 2 gloo ranks, a few dozen
steps; verification accuracy must move above the untrained baseline on every target."""
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
config.max_steps = 40
config.verbose = 40
config.save_every_steps = 20
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_short_demo_beats_the_untrained_baseline(tmp_path):
    config = tmp_path / "demo_small.py"
    output = tmp_path / "out"
    config.write_text((ROOT / "configs" / "demo_cpu.py").read_text()
                      + SMALL.format(rec=str(tmp_path / "data"), output=str(output)))
    proc = subprocess.run([sys.executable, "scripts/demo.py", "--config", str(config), "--pairs", "300"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
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
    assert "verification at step 40" in (output / "training.log").read_text()


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
