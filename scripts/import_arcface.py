"""Continue an arcface_torch run here: its ``checkpoint_gpu_<rank>.pt`` files become one of our step checkpoints.

    python scripts/import_arcface.py ARCFACE_OUTPUT_DIR configs/NAME
    torchrun --nproc_per_node=N train.py configs/NAME        # continues at arcface_torch's step, on any N

ARCFACE_OUTPUT_DIR is the ``output`` folder of an arcface_torch ``train_v2.py`` run with ``save_all_states``: one
``checkpoint_gpu_<rank>.pt`` per GPU, each ``{"epoch", "global_step", "state_dict_backbone",
"state_dict_softmax_fc", "state_optimizer", "state_lr_scheduler"}``. configs/NAME describes the run as it goes on
here (its ``network``, ``embedding_size``, ``num_classes``, ``optimizer`` and schedule keys must be the
arcface_torch run's: the same key names). The tool writes ``<output>/checkpoints/step_<S>/`` (S = arcface_torch's
``global_step`` / ``gradient_acc``: optimizer steps), ``model.pt`` and ``model.json``, with the project's own
checkpoint writer, as if a run of that config on the same number of ranks had saved it: ``train.py configs/NAME``
resumes it by itself, on any number of ranks (the head is re-partitioned on load).

Converted: the backbone (rank 0's weights and batch-norm statistics, loaded strictly into the config's network);
every class centre, at the class id arcface_torch's ``PartialFC_V2`` gave it
(``class_start = C // W · r + min(r, C mod W)``, ``num_local = C // W + [r < C mod W]``); the optimizer state of
both (SGD momentum, AdamW moments and step count); the position (epoch; the step, which puts the LR schedule at
the same point). Not converted, because arcface_torch does not save them: the fp16 loss scale (starts afresh), the
random streams (seeded from the step, as after a change of world size), the data order inside an epoch
(arcface_torch saves at epoch ends only, so none is lost).

Checks, each a line that names the file or key: every rank's file present, each readable without running code
(``torch.load(weights_only=True)``) and of the same epoch and step; the shards following the
``class_start``/``num_local`` rule and adding up to the config's ``num_classes``; the centres' width equal to
``embedding_size``; the backbone loading strictly into the config's network; the optimizer the config's; the
config's LR, ``lr_power``, total and warm-up steps (from ``num_image``, ``batch_size``, ``gradient_acc`` and the
number of ranks; ``global_step`` a multiple of ``gradient_acc``), ``weight_decay`` and ``momentum`` those of
arcface_torch's optimizer and scheduler (``--allow-changes`` continues with the config's values instead, each
difference printed as a warning); an ``output`` that holds no run yet (``--archive`` moves what it holds to
``<output>/archive_<time>/``, as the trainer's ``archive_checkpoints`` does).

Exit status: 0 written (one line: what, where, the next command); 1 bad data: a rank's file missing, unreadable,
unsafe or inconsistent with the others; 2 usage: bad options, a config that does not describe the arcface_torch
run, an ``output`` that already holds a run; 130/143 interrupted. Nothing is written unless every check passes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from trainer.import_arcface import import_run
from utils.cli import run_tool, warn

TOOL = "import_arcface"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, metavar="ARCFACE_OUTPUT_DIR",
                        help="arcface_torch's output folder, holding checkpoint_gpu_<rank>.pt")
    parser.add_argument("config", help="configs/NAME (or a .py config file) of the run as it continues here")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys as train.py does (give train.py the same ones)")
    parser.add_argument("--archive", action="store_true",
                        help="move the checkpoints and model.pt already in `output` to output/archive_<time>/")
    parser.add_argument("--allow-changes", action="store_true",
                        help="continue with the config's lr, schedule, weight_decay and momentum where they differ "
                             "from the arcface_torch run's (each difference is printed)")
    args = parser.parse_args(argv)

    def work() -> None:
        print(import_run(args.source, args.config, args.overrides, args.archive, args.allow_changes,
                         lambda message: warn(TOOL, message)))

    return run_tool(TOOL, work)


if __name__ == "__main__":
    sys.exit(main())
