"""The data of the fine-tuning recipe's tests (tests/test_finetune.py, tests/test_import_onnx.py): a tiny network
pre-trained on synthetic identities in the aligned crop, and a second, disjoint set of another kind (faces as another
detector and aligner crop them: looser) with few images per identity, plus held-out pairs of that kind.

``finetune_data`` (tests/conftest.py) makes them once per session; docs/finetuning.md quotes what the tests measure
on them.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tests.helpers import train

SEED = 5
PRETRAIN = (300, 8)  # identities x images the model is pre-trained on (the aligned crop of every other test)
PRETRAIN_STEPS = 250
FINETUNE = (100, 6)  # identities x images of the other camera's set it is fine-tuned on (few per identity)
PAIRS = 400  # verification pairs of held-out identities of the other camera
FINETUNE_IDS, HELD_OUT_IDS = 100_000, 200_000  # the other camera's identities (pre-training: 0..299)
TINY = ("network=tiny", "network_kwargs={'widths': (2, 8, 16, 32)}", "embedding_size=256")
# What the test changes of the recipe: the network and data sizes of a CPU test (18 steps an epoch, head warm-up
# two epochs, as the recipe), not its fine-tuning choices.
RECIPE_SIZE = (*TINY, "batch_size=32", "head_warmup_steps=36", "fp16=false", "device=cpu", "num_workers=0",
               "val_targets=", "save_all_states=false")


# ------------------------------------------------------------------------------------------------ data
def _other_camera(image: np.ndarray) -> np.ndarray:
    """(112, 112, 3) uint8 RGB as another detector and aligner crop it: looser, the face at 3/4 of the frame on a
    flat gray background. The features of the early layers are the same; where they lie on the last 7 x 7 feature
    map, which the embedding layer reads position by position, is not."""
    from PIL import Image

    side, at = 84, 14
    out = np.full_like(image, 128)
    out[at:at + side, at:at + side] = np.asarray(Image.fromarray(image).resize((side, side), Image.BILINEAR))
    return out


def _other_camera_images(identity: int, indices, split: str) -> list[bytes]:
    from dataset.synthetic_faces import encode_jpeg, identity_params, render_sample

    params = identity_params(SEED, identity)
    out = []
    for index in indices:
        image, quality = render_sample(SEED, split, params, identity, index)
        out.append(encode_jpeg(_other_camera(image), quality))
    return out


def _write_other_camera_sets(root: Path) -> tuple[Path, Path]:
    """The fine-tuning set (FINETUNE identities x images, training nuisances) and held-out.bin (PAIRS pairs, half
    of the same identity, from identities in neither set)."""
    from dataset.recordio import write_insightface_rec
    from dataset.verification_set import save_bin

    classes, per_class = FINETUNE
    items = ((c, jpeg) for c in range(classes)
             for jpeg in _other_camera_images(FINETUNE_IDS + c, range(per_class), "train"))
    write_insightface_rec(root / "finetune", items, classes)
    rng = np.random.default_rng(SEED)
    images, issame = [], []
    for i in range(PAIRS):
        a, b = rng.choice(PAIRS // 4, size=2, replace=False)
        if i % 2 == 0:
            images += _other_camera_images(HELD_OUT_IDS + int(a), (2 * i, 2 * i + 1), "hard")
        else:
            images += _other_camera_images(HELD_OUT_IDS + int(a), (2 * i,), "hard")
            images += _other_camera_images(HELD_OUT_IDS + int(b), (2 * i + 1,), "hard")
        issame.append(i % 2 == 0)
    save_bin(root / "held_out.bin", images, issame)
    return root / "finetune", root / "held_out.bin"


# ------------------------------------------------------------------------------------------------ pre-training
def _pretrain(root: Path) -> Path:
    """model.pt of the tiny network trained on PRETRAIN identities (the demo's settings, PRETRAIN_STEPS steps of
    32 images)."""
    from dataset.synthetic_faces import write_dataset

    classes, per_class = PRETRAIN
    write_dataset(root / "aligned", num_classes=classes, images_per_class=per_class, pairs=2, seed=SEED)
    train("configs/demo_cpu", root / "pretrained", f"rec={root / 'aligned'}", f"num_classes={classes}",
          f"num_image={classes * per_class}", f"max_steps={PRETRAIN_STEPS}", "bf16=false", "val_targets=",
          "save_all_states=false")
    return root / "pretrained" / "model.pt"


def make_finetune_data(root: Path) -> dict[str, Path]:
    """The pre-trained ``model.pt``, the fine-tuning rec folder and ``held_out.bin`` under ``root``: the pre-training
    runs in its process while this one writes the other camera's sets."""
    with ThreadPoolExecutor(1) as pool:
        pretraining = pool.submit(_pretrain, root)
        tuning, held_out = _write_other_camera_sets(root)
        return {"pretrained": pretraining.result(), "tuning": tuning, "held_out": held_out}
