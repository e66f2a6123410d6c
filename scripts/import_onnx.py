"""Import one of insightface's ONNX recognition models as a backbone that every tool here takes, and that trains.

    python scripts/import_onnx.py buffalo_l/w600k_r50.onnx models/w600k_r50
    python -m eval.verify --weights models/w600k_r50 --data-dir DIR --targets lfw
    python train.py configs/finetune_example --set init_backbone=models/w600k_r50/model.pt rec=... num_classes=...

MODEL.onnx is a model-zoo file (buffalo_l's w600k_r50.onnx, antelopev2's glintr100.onnx, buffalo_s's
w600k_mbf.onnx) or any IResNet or MobileFaceNet that arcface_torch's torch2onnx.py exported. The tool writes
OUT_DIR/model.pt (arcface_torch's layout) and OUT_DIR/model.json (with the source's name, sha256 and folded batch
norms) together, or nothing, after the import and onnxruntime embed the same random images (the largest relative
difference is printed). docs/finetuning.md#from-insightfaces-onnx-models: what is carried over, and fine-tuning.

Exit status: 0 written; 1 the imported backbone does not compute what the file does (a relative difference over
1e-3; nothing written); 2 a file that is not a recognition model this tool imports (one line: what was found and
what is supported), or an OUT_DIR that already holds a model; 130/143 interrupted, nothing written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backbones.onnx_import import FOLDED_KEY, max_relative_difference, read_onnx
from dataset.images import PIXEL_MEAN, PIXEL_STD
from eval.model_card import MODEL_CARD, model_card, write_model_card
from eval.model_source import WEIGHTS_FILE
from utils.cli import BadData, UsageError, run_tool
from utils.files import path_problem, save_atomic, staged

TOOL = "import_onnx"
TOLERANCE = 1e-3  # largest relative |torch - onnxruntime| of an import that computes what the file does


def import_model(source: Path, out: Path) -> None:
    """Read ``source``, check it against onnxruntime, write ``out``/model.pt and model.json together."""
    if path_problem(out, folder=True) == "is a file, not a folder":
        raise UsageError(f"{out}: is a file, not a folder")
    held = [name for name in (WEIGHTS_FILE, MODEL_CARD) if (out / name).exists()]
    if held:
        raise UsageError(f"{out} already holds {' and '.join(held)}; import into a new folder, or remove them first")
    imported = read_onnx(source, PIXEL_MEAN, PIXEL_STD)
    difference = max_relative_difference(imported, source)
    if difference > TOLERANCE:
        raise BadData(f"{source}: the imported {imported.network} differs from onnxruntime by {difference:.1e} "
                      f"(relative), over {TOLERANCE:g}; nothing written")
    card = model_card(imported.network, imported.network_kwargs, imported.embedding_size, **imported.facts)
    with staged(out, last=(MODEL_CARD,)) as folder:
        save_atomic(imported.state_dict, folder / WEIGHTS_FILE)
        write_model_card(folder / MODEL_CARD, card)
    folded = imported.facts[FOLDED_KEY]
    print(f"imported {source} as {imported.network} ({imported.embedding_size}-d embedding, {folded} folded batch "
          f"norms put back at identity statistics) into {out / WEIGHTS_FILE} and {MODEL_CARD}; max relative "
          f"|torch - onnxruntime| = {difference:.1e}")
    if folded:
        print("fine-tune it with freeze_bn = True: its folded batch norms have no statistics to train with "
              "(docs/finetuning.md)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, metavar="MODEL.onnx", help="the ONNX recognition model")
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help=f"where {WEIGHTS_FILE} and {MODEL_CARD} go")
    args = parser.parse_args(argv)
    return run_tool(TOOL, lambda: import_model(args.source, args.out), on_interrupt="; nothing written")


if __name__ == "__main__":
    sys.exit(main())
