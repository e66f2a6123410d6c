"""`make demo`: the whole product on a CPU in minutes.

    python scripts/demo.py [--config configs/demo_cpu.py] [--nproc 2] [--pairs 1200]

1. generates synthetic identities in the real formats (cached in the config's `rec` folder),
2. trains the config with `torchrun --nproc_per_node=2` (gloo), each rank on its share of the cores,
3. verifies the trained model and the same network untrained, prints both per target and writes
   `<output>/results.json`: {"<target>": {"acc": float, "acc_untrained": float}}.

A config with ``bf16 = True`` (the demo's) runs fp32 instead where the CPU does not compute bf16 in hardware,
and says so. A failed step stops the demo with its exit code; Ctrl-C or SIGTERM stops the running step too
(130, 143). docs/cpu.md#the-demo.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import utils.precision
from dataset.synthetic_faces import dataset_stamp, is_complete
from utils.cli import run_tool
from utils.config import load_config
from utils.files import atomic_write

ROOT = Path(__file__).resolve().parents[1]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform says, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def child_env(threads: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a step of the demo: ``threads`` torch threads per process."""
    return {**(os.environ if env is None else env), "OMP_NUM_THREADS": str(threads)}


def run(cmd: list[str], what: str, threads: int) -> None:
    """Run a step of the demo, ``threads`` threads per process, streaming its output; stop the demo if it fails."""
    print(f"\n=== {what}\n$ {' '.join(cmd)}", flush=True)
    _wait([(cmd, what)], [subprocess.Popen(cmd, cwd=ROOT, env=child_env(threads))])


def _wait(steps: list[tuple[list[str], str]], procs: list[subprocess.Popen]) -> None:
    """Wait for the steps' processes, print each captured output in order, and stop the demo with the first
    failure's exit code, naming its step. Ctrl-C or SIGTERM (``utils.cli.Terminated``) sends the processes
    SIGTERM, which torchrun forwards to its ranks, and waits for them before the demo stops."""
    try:
        outputs = [proc.communicate()[0] for proc in procs]
    except BaseException:
        for proc in procs:
            proc.terminate()
            proc.wait()
        raise
    for (cmd, what), proc, output in zip(steps, procs, outputs):
        if output is not None:
            print(f"\n=== {what}\n$ {' '.join(cmd)}\n{output}", end="", flush=True)
        if proc.returncode != 0:
            print(f"demo: {what} failed with exit code {proc.returncode}", file=sys.stderr)
            raise SystemExit(proc.returncode)


def run_side_by_side(steps: list[tuple[list[str], str]]) -> None:
    """Run independent steps at the same time, one CPU thread each (when there are enough cores: two passes of a
    small network on 112x112 batches gain little from intra-op threads), and print each one's output after all
    have ended, in order; stop the demo with the first failure's exit code."""
    if len(steps) > usable_cores():
        for cmd, what in steps:
            run(cmd, what, usable_cores())
        return
    env = child_env(1)
    _wait(steps, [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True) for cmd, _ in steps])


def verify_command(cfg, targets: list[str], model: list[str], precision: str, json_path: Path) -> list[str]:
    """``python -m eval.verify`` on the config's verification sets with the options ``model``."""
    return [sys.executable, "-m", "eval.verify", *model, "--data-dir", str(cfg.rec), "--targets", ",".join(targets),
            "--device", "cpu", "--precision", precision, "--json", str(json_path)]


def demo(args: argparse.Namespace) -> None:
    """The three steps, then the results table."""
    cfg = load_config(args.config)
    data, output = Path(cfg.rec), Path(cfg.output)
    precision = "bf16" if cfg.bf16 and utils.precision.cpu_computes_bf16() else "fp32"
    train_overrides = ["--set", "bf16=false"] if cfg.bf16 and precision == "fp32" else []
    if train_overrides:
        print("demo: this CPU does not compute bfloat16 in hardware (no AVX512-BF16, AMX or Arm BF16); training "
              "and verifying in fp32, which is faster here", flush=True)
    targets, start = list(cfg.val_targets), time.perf_counter()
    per_rank = max(1, usable_cores() // args.nproc)
    per_class = cfg.num_image // cfg.num_classes
    if is_complete(data, dataset_stamp(cfg.num_classes, per_class, args.pairs, cfg.seed)):
        title = f"1/3 synthetic identities: already in {data}, nothing to generate"
    else:
        title = (f"1/3 generating synthetic identities: {cfg.num_classes} x {per_class} training images and 2 x "
                 f"{args.pairs} verification pairs in {data} (kept for the next run)")
    run([sys.executable, "scripts/make_synthetic.py", "--out", str(data), "--num-classes", str(cfg.num_classes),
         "--images-per-class", str(per_class), "--pairs", str(args.pairs), "--seed", str(cfg.seed),
         "--preview", str(data / "preview.png")], title, 1)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
         "train.py", args.config, *train_overrides],
        f"2/3 training on {args.nproc} CPU ranks x {per_rank} thread{'s' if per_rank > 1 else ''} ({precision})",
        per_rank)
    trained_json, untrained_json = output / "verify_trained.json", output / "verify_untrained.json"
    roc = output / "roc.png"
    # The trainer seeds torch with cfg.seed before building the backbone: the same network, untrained.
    untrained_model = ["--network", cfg.network, "--network-kwargs", json.dumps(dict(cfg.network_kwargs)),
                       "--embedding-size", str(cfg.embedding_size), "--random-init", str(cfg.seed)]
    # The trained network is read from the model.json the trainer wrote beside model.pt.
    run_side_by_side([
        (verify_command(cfg, targets, ["--weights", str(output / "model.pt"), "--roc", str(roc)], precision,
                        trained_json), f"3/3 verification of the trained backbone ({precision})"),
        (verify_command(cfg, targets, untrained_model, precision, untrained_json),
         "    verification of the same backbone untrained (baseline), side by side"),
    ])

    trained, untrained = json.loads(trained_json.read_text()), json.loads(untrained_json.read_text())
    results = {t: {"acc": trained[t]["acc"], "acc_untrained": untrained[t]["acc"]} for t in targets}
    atomic_write(output / "results.json", lambda f: f.write((json.dumps(results, indent=2) + "\n").encode()))

    print(f"\n=== results ({time.perf_counter() - start:.0f} s)\n| target | pairs | untrained acc | trained acc | "
          "trained VAL@FAR=1e-3 |\n|---|---|---|---|---|")
    for t in targets:
        print(f"| {t} | {trained[t]['pairs']} | {untrained[t]['acc']:.4f} | {trained[t]['acc']:.4f} | "
              f"{trained[t]['val']:.4f} |")
    events = sorted((output / "tensorboard").glob("events.out.tfevents.*"))
    print(f"\nlog:          {output / 'training.log'}\ntensorboard:  {output / 'tensorboard'} ({len(events)} event "
          f"file(s); tensorboard --logdir {output})\nmodel:        {output / 'model.pt'}\nROC plot:     {roc}\n"
          f"samples:      {data / 'preview.png'}\nresults:      {output / 'results.json'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo_cpu.py")
    parser.add_argument("--nproc", type=int, default=2, help="training processes (gloo ranks)")
    parser.add_argument("--pairs", type=int, default=1200,
                        help="pairs per verification .bin (half same identity, half different)")
    args = parser.parse_args(argv)
    return run_tool("demo", lambda: demo(args))


if __name__ == "__main__":
    sys.exit(main())
