"""configs/<recipe>.py against the published values of arcface_torch's recipes (same names, same values).

``PUBLISHED`` below is what we promise: each recipe's values as arcface_torch's recipe files write them (read
from its repository). ``test_table_matches_recipes_tsv`` cross-checks it against the recipes table
``tests/fixtures/recipes.tsv`` (every arcface_torch recipe's effective values, read from its repository). Three
published values are refused by our config rules; ``EXPRESSED_AS`` says how each recipe writes the same training
behaviour instead, and a test per entry shows that the behaviour is the same.

``tests/fixtures/recipes_resolved.json`` pins every shipped config's resolved values and fingerprint as they were
before the key declarations moved into ``utils/config.py`` (``test_every_config_resolves_as_pinned``): a refactor
of the loader must not change what any recipe trains. Rewrite it only for a deliberate change of a recipe or a
default (``python -m tests.test_recipes --write-resolved``), and say so in the commit.
"""
from __future__ import annotations

import ast
import json
import sys

import pytest
import torch

from tests.helpers import FIXTURES, ROOT, reference_polynomial_warmup
from utils.config import (
    BASE_CONFIG,
    CONFIG_DIR,
    _coerce,
    _load_module_config,
    derive,
    fingerprint,
    load_config,
    resolve_config_path,
)
from utils.config_keys import KEYS
from utils.lr_scheduler import lr_at

ARC, COS = (1.0, 0.5, 0.0), (1.0, 0.0, 0.4)  # margin_list of ArcFace and CosFace
# (num_classes, num_image, rec) of each training set, as the recipes write them.
MS1MV2 = (85742, 5822653, "/train_tmp/faces_emore")
MS1MV3 = (93431, 5179510, "/train_tmp/ms1m-retinaface-t1")
GLINT360K = (360232, 17091657, "/train_tmp/glint360k")
WF4M = (205990, 4235242, "/train_tmp/WebFace4M")
WF12M = (617970, 12720066, "/train_tmp/WebFace12M")
WF12M_CONFLICT = (1017970, 12720066, "/train_tmp/WebFace12M_Conflict")
WF12M_FLIP40 = (617970, 12720066, "/train_tmp/WebFace12M_FLIP40")
WF42M = (2059906, 42474557, "/train_tmp/WebFace42M")
SPEED_TEST = (300000, 100000, "synthetic")

COLUMNS = ("network", "margin_list", "sample_rate", "interclass_filtering_threshold", "optimizer", "lr", "weight_decay",
           "batch_size", "gradient_acc", "num_epoch", "warmup_epoch", ("num_classes", "num_image", "rec"))
PUBLISHED = {
    "3millions": ("mbf", COS, 0.1, 0, "sgd", 0.1, 5e-4, 512, 1, 30, -1, SPEED_TEST),
    "glint360k_mbf": ("mbf", COS, 1.0, 0, "sgd", 0.1, 1e-4, 128, 1, 20, 0, GLINT360K),
    "glint360k_r100": ("r100", COS, 1.0, 0, "sgd", 0.1, 1e-4, 128, 1, 20, 0, GLINT360K),
    "glint360k_r50": ("r50", COS, 1.0, 0, "sgd", 0.1, 1e-4, 128, 1, 20, 0, GLINT360K),
    "ms1mv2_mbf": ("mbf", ARC, 1.0, 0, "sgd", 0.1, 1e-4, 128, 1, 40, 0, MS1MV2),
    "ms1mv2_r100": ("r100", ARC, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, MS1MV2),
    "ms1mv2_r50": ("r50", ARC, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, MS1MV2),
    "ms1mv3_mbf": ("mbf", ARC, 1.0, 0, "sgd", 0.1, 1e-4, 128, 1, 40, 0, MS1MV3),
    "ms1mv3_r100": ("r100", ARC, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, MS1MV3),
    "ms1mv3_r50": ("r50", ARC, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, MS1MV3),
    "ms1mv3_r50_onegpu": ("r50", ARC, 1.0, 0, "sgd", 0.02, 5e-4, 128, 1, 20, 0, MS1MV3),
    "wf12m_conflict_r50": ("r50", COS, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 2, WF12M_CONFLICT),
    "wf12m_conflict_r50_pfc03_filter04": ("r50", COS, 0.3, 0.4, "sgd", 0.1, 5e-4, 128, 1, 20, 2, WF12M_CONFLICT),
    "wf12m_flip_pfc01_filter04_r50": ("r50", COS, 0.1, 0.4, "sgd", 0.1, 5e-4, 128, 1, 20, 2, WF12M_FLIP40),
    "wf12m_flip_r50": ("r50", COS, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 2, WF12M_FLIP40),
    "wf12m_mbf": ("mbf", COS, 1.0, 0, "sgd", 0.1, 1e-4, 128, 1, 20, 0, WF12M),
    "wf12m_pfc02_r100": ("r100", COS, 0.2, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, WF12M),
    "wf12m_r100": ("r100", COS, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, WF12M),
    "wf12m_r50": ("r50", COS, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, WF12M),
    "wf42m_pfc0008_32gpu_r100": ("r100", COS, 0, 0, "sgd", 0.4, 5e-4, 512, 1, 20, 2, WF42M),
    "wf42m_pfc02_16gpus_mbf_bs8k": ("mbf", COS, 0.2, 0, "sgd", 0.4, 1e-4, 512, 1, 20, 2, WF42M),
    "wf42m_pfc02_16gpus_r100": ("r100", COS, 0.2, 0, "sgd", 0.3, 5e-4, 256, 1, 20, 1, WF42M),
    "wf42m_pfc02_16gpus_r50_bs8k": ("r50", COS, 0.2, 0, "sgd", 0.6, 5e-4, 512, 1, 20, 4, WF42M),
    "wf42m_pfc02_32gpus_r50_bs4k": ("r50", COS, 0.2, 0, "sgd", 0.4, 5e-4, 128, 1, 20, 2, WF42M),
    "wf42m_pfc02_8gpus_r50_bs4k": ("r50", COS, 0.2, 0, "sgd", 0.4, 5e-4, 512, 1, 20, 2, WF42M),
    "wf42m_pfc02_r100": ("r100", COS, 0.2, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, WF42M),
    "wf42m_pfc02_r100_16gpus": ("r100", COS, 0.2, 0, "sgd", 0.2, 5e-4, 128, 1, 20, 2, WF42M),
    "wf42m_pfc02_r100_32gpus": ("r100", COS, 0.2, 0, "sgd", 0.4, 5e-4, 128, 1, 20, 2, WF42M),
    "wf42m_pfc02_vit_h": ("vit_h", COS, 0.5, 0, "adamw", 0.001, 0.1, 768, 1, 16, 2, WF42M),
    "wf42m_pfc03_32gpu_r100": ("r100", COS, 0.3, 0, "sgd", 0.4, 5e-4, 128, 1, 20, 2, WF42M),
    "wf42m_pfc03_32gpu_r18": ("r18", COS, 0.3, 0, "sgd", 0.4, 5e-4, 128, 1, 20, 2, WF42M),
    "wf42m_pfc03_32gpu_r200": ("r200", COS, 0.3, 0, "sgd", 0.4, 5e-4, 128, 1, 20, 2, WF42M),
    "wf42m_pfc03_32gpu_r50": ("r50", COS, 0.3, 0, "sgd", 0.4, 5e-4, 128, 1, 20, 2, WF42M),
    "wf42m_pfc03_40epoch_64gpu_vit_b": ("vit_b_dp005_mask_005", COS, 0.3, 0, "adamw", 0.001, 0.1, 384, 1, 40, 4, WF42M),
    "wf42m_pfc03_40epoch_64gpu_vit_l": ("vit_l_dp005_mask_005", COS, 0.3, 0, "adamw", 0.001, 0.1, 384, 1, 40, 4, WF42M),
    "wf42m_pfc03_40epoch_64gpu_vit_s": ("vit_s_dp005_mask_0", COS, 0.3, 0, "adamw", 0.001, 0.1, 384, 1, 40, 4, WF42M),
    "wf42m_pfc03_40epoch_64gpu_vit_t": ("vit_t_dp005_mask0", COS, 0.3, 0, "adamw", 0.001, 0.1, 384, 1, 40, 4, WF42M),
    "wf42m_pfc03_40epoch_8gpu_vit_b": ("vit_b_dp005_mask_005", COS, 0.3, 0, "adamw", 0.001, 0.1, 256, 12, 40, 4, WF42M),
    "wf42m_pfc03_40epoch_8gpu_vit_t": ("vit_t_dp005_mask0", COS, 0.3, 0, "adamw", 0.001, 0.1, 512, 1, 40, 4, WF42M),
    "wf4m_mbf": ("mbf", COS, 1.0, 0, "sgd", 0.1, 1e-4, 128, 1, 20, 0, WF4M),
    "wf4m_r100": ("r100", COS, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, WF4M),
    "wf4m_r50": ("r50", COS, 1.0, 0, "sgd", 0.1, 5e-4, 128, 1, 20, 0, WF4M),
}
# Values every recipe shares.
COMMON = {"embedding_size": 512, "fp16": True, "momentum": 0.9, "dali": False, "dali_aug": False}
# Recipes whose DALI settings differ from COMMON.
DALI = {"wf42m_pfc02_vit_h": {"dali": True, "dali_aug": True}}
# Operational settings the recipe files write (not training values: not in the fingerprint). Elsewhere they
# keep the defaults of configs/base.py (verbose 2000; verification on lfw, cfp_fp and agedb_30).
NO_VERIFICATION = {
    "3millions", "wf12m_conflict_r50", "wf12m_conflict_r50_pfc03_filter04", "wf12m_flip_pfc01_filter04_r50",
    "wf12m_flip_r50", "wf12m_mbf", "wf12m_pfc02_r100", "wf12m_r100", "wf12m_r50", "wf42m_pfc02_16gpus_mbf_bs8k",
    "wf42m_pfc02_vit_h", "wf42m_pfc03_40epoch_64gpu_vit_b", "wf42m_pfc03_40epoch_64gpu_vit_l",
    "wf42m_pfc03_40epoch_64gpu_vit_s", "wf42m_pfc03_40epoch_64gpu_vit_t", "wf42m_pfc03_40epoch_8gpu_vit_b",
    "wf42m_pfc03_40epoch_8gpu_vit_t"}
VERIFY_EVERY_10000 = {
    "wf42m_pfc02_16gpus_mbf_bs8k", "wf42m_pfc02_16gpus_r50_bs8k", "wf42m_pfc02_32gpus_r50_bs4k",
    "wf42m_pfc02_8gpus_r50_bs4k", "wf42m_pfc02_r100", "wf42m_pfc02_r100_16gpus", "wf42m_pfc02_r100_32gpus"}

# Published values our rules refuse -> the value the shipped config writes for the same behaviour.
EXPRESSED_AS = {
    # arcface_torch's scheduler never warms up for a negative warm-up: it decays from the peak at step 0.
    ("3millions", "warmup_epoch"): 0,
    # sample_rate 0 keeps only the batch's own class centres; so does any rate with int(rate * C_local) == 0.
    ("wf42m_pfc0008_32gpu_r100", "sample_rate"): 1e-7,
    # Refused (see configs/base.py): the recipe trains without the extra DALI augmentation.
    ("wf42m_pfc02_vit_h", "dali_aug"): False,
}
# Backbones another branch is adding; a recipe may name them until they are registered.
# Shipped configs that are not arcface_torch recipes.
OURS = {"debug_cpu", "demo_cpu", "demo_cpu_adaface", "finetune_example", "image_folder_r50"}


def published(name: str) -> dict:
    """Every published value of recipe ``name`` as {key: value}."""
    row, values = PUBLISHED[name], dict(COMMON)
    for column, value in zip(COLUMNS, row, strict=True):
        values.update(zip(column, value) if isinstance(column, tuple) else [(column, value)])
    values.update(DALI.get(name, {}))
    return values


def shipped() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in ("__init__", "base"))


def test_every_recipe_is_shipped_and_nothing_else():
    assert sorted(set(shipped()) - OURS) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_has_the_published_values(name):
    cfg = load_config(f"configs/{name}")
    for key, value in published(name).items():
        want = EXPRESSED_AS.get((name, key), value)
        default = KEYS[key].default
        kind = int if default is None else type(default)  # num_classes, num_image: None = the dataset's
        assert cfg[key] == want and type(cfg[key]) is kind, (key, cfg[key], want)
    assert cfg.val_targets == (() if name in NO_VERIFICATION else ("lfw", "cfp_fp", "agedb_30"))
    assert cfg.verbose == (10000 if name in VERIFY_EVERY_10000 else 2000)
    assert cfg.lr_power == 1.0  # the linear decay of arcface_torch's current trainer
    d = derive(cfg, 8)
    assert d.total_steps > d.warmup_steps >= 0


@pytest.mark.parametrize("name", shipped())
def test_config_sets_only_what_differs_from_what_it_builds_on(name):
    written, parent = _load_module_config(CONFIG_DIR / f"{name}.py")
    below = load_config(str(resolve_config_path(parent, CONFIG_DIR) if parent else BASE_CONFIG)).to_dict()
    below["output"] = KEYS["output"].default if parent is None else below["output"]
    same = [k for k, v in written.items() if _coerce(KEYS[k], v, "") == below[k]]
    assert same == [], f"configs/{name}.py repeats values of {parent or 'configs/base.py'}: {same}"


@pytest.mark.parametrize("name,key", sorted(EXPRESSED_AS))
def test_expressed_values_are_the_refused_ones(name, key):
    value = published(name)[key]
    with pytest.raises(ValueError, match=rf"{key} = {value!r}.* is not allowed"):
        load_config(f"configs/{name}", [f"{key}={value}"])


@pytest.mark.parametrize("world_size", [1, 8, 32])
def test_3millions_schedule_is_the_reference_with_warmup_minus_one(world_size):
    cfg = load_config("configs/3millions")
    d = derive(cfg, world_size)
    steps = d.total_steps + 2
    reference = reference_polynomial_warmup(cfg.lr, -d.steps_per_epoch, d.total_steps, 1.0, steps)
    ours = [lr_at(s, cfg.lr, d.warmup_steps, d.total_steps, power=cfg.lr_power) for s in range(steps)]
    assert ours == pytest.approx(reference, rel=1e-9, abs=1e-15)


def test_pfc0008_uses_exactly_the_batch_classes():
    from losses import CosFace
    from partial_fc import PartialFC, class_partition

    cfg = load_config("configs/wf42m_pfc0008_32gpu_r100")
    for world in (1, 2, 8, 32, 64, 1024):
        assert all(int(cfg.sample_rate * class_partition(cfg.num_classes, world, r)[1]) == 0 for r in (0, world - 1))
    # One rank holding all 2,059,906 classes (the largest shard there can be), 2-d embeddings to stay small.
    head = PartialFC(CosFace(), 2, cfg.num_classes, sample_rate=cfg.sample_rate, seed=cfg.seed)
    labels = torch.tensor([5, 17, 17, cfg.num_classes - 1])
    head(torch.randn(4, 2), labels).backward()
    rows = head.weight.grad.coalesce().indices().view(-1)
    assert rows.tolist() == [5, 17, cfg.num_classes - 1]


def test_every_recipe_network_is_registered():
    from backbones import list_models

    networks = {published(name)["network"] for name in PUBLISHED}
    assert networks <= set(list_models()), networks - set(list_models())


def test_docs_list_every_shipped_config():
    page = (ROOT / "docs" / "configuration.md").read_text()
    section = page[page.index("## Shipped recipes"):page.index("## The keys")]
    assert [name for name in shipped() if f"`{name}`" not in section] == []


RESOLVED = FIXTURES / "recipes_resolved.json"


def resolved(name: str) -> dict:
    """What ``configs/<name>`` resolves to: every value's repr (tuples, floats and None as they are), in key
    order, and the fingerprint."""
    cfg = load_config(f"configs/{name}")
    return {"fingerprint": fingerprint(cfg), "values": {key: repr(value) for key, value in cfg.to_dict().items()}}


@pytest.mark.parametrize("name", ["base", *shipped()])
def test_every_config_resolves_as_pinned(name):
    pinned = json.loads(RESOLVED.read_text())
    assert sorted(pinned) == sorted(["base", *shipped()])
    now = resolved(name)
    assert list(now["values"].items()) == list(pinned[name]["values"].items())
    assert now["fingerprint"] == pinned[name]["fingerprint"]


def test_table_matches_recipes_tsv():
    """The table above against the recipes table it was written from."""
    lines = [line for line in (FIXTURES / "recipes.tsv").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    header = lines[0].split("\t")
    rows = {fields[0]: dict(zip(header[1:], fields[1:])) for fields in (line.split("\t") for line in lines[1:])}
    assert sorted(rows) == sorted(PUBLISHED)
    for name, row in rows.items():
        ours = published(name)
        assert set(row) <= set(ours), (name, set(row) - set(ours))
        for key, text in row.items():
            assert ast.literal_eval(text) == ours[key], (name, key, text, ours[key])


if __name__ == "__main__" and sys.argv[1:] == ["--write-resolved"]:
    RESOLVED.write_text(json.dumps({name: resolved(name) for name in ["base", *shipped()]}, indent=1) + "\n")
