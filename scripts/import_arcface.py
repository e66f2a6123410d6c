"""Continue an arcface_torch run here: its ``checkpoint_gpu_<rank>.pt`` files become one of our step checkpoints.

    python scripts/import_arcface.py ARCFACE_OUTPUT_DIR configs/NAME
    torchrun --nproc_per_node=N train.py configs/NAME        # continues at arcface_torch's step, on any N

ARCFACE_OUTPUT_DIR is the ``output`` folder of an arcface_torch ``train_v2.py`` run with ``save_all_states``;
configs/NAME describes the run as it goes on here (its ``network``, ``embedding_size``, ``num_classes``,
``optimizer``, ``gradient_acc`` and schedule keys must be the arcface_torch run's). The tool writes
``<output>/checkpoints/step_<S>/``, ``model.pt`` and ``model.json`` as if a run of that config had saved them at
arcface_torch's step: the backbone, every class centre at its class id, the optimizer state of both and the
position. Every file is read with ``torch.load(weights_only=True)``; nothing is written unless every check
passes. ``--allow-changes`` continues with the config's LR, schedule, ``weight_decay`` and ``momentum`` where
they differ (each difference printed); ``--archive`` moves a run already in ``output`` aside. What is converted
and checked: docs/migrating.md#continue-a-run.

Exit status: 0 written (one line: what, where, the next command); 1 bad data: a rank's file missing, unreadable,
unsafe or inconsistent with the others; 2 usage: bad options, a config that does not describe the arcface_torch
run, an ``output`` that already holds a run; 130/143 interrupted.
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
