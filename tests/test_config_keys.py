"""The key declarations (utils/config_keys.py) against the code: every key the product reads or a recipe sets is
declared, every declared key is read somewhere, and the views other modules keep of them agree."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT
from utils.config_keys import FIXED_KEYS, KEYS, SCHEDULE_KEYS

# Config's own attributes and methods, not keys.
CONFIG_API = {"to_dict", "updated", "get", "items", "keys", "values", "source", "name"}
# Files whose `cfg` is another settings object, by the class its parameters are annotated with.
OTHER_CFG = {"dataset/synthetic_faces.py": "NuisanceConfig", "bench/head.py": "HeadConfig"}
SKIP = {"tests", ".venv", "work_dirs", "data"}
# Keys declared only to be refused: arcface_torch's recipes write them; their rule admits the one value we train
# with, so no code reads them.
REFUSED_ONLY = {"dali_aug"}


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))


def _is_cfg(node: ast.AST) -> bool:
    """``cfg``, ``job.cfg``, ``self.cfg``: the names the product gives a training configuration."""
    return (isinstance(node, ast.Name) and node.id == "cfg") or (isinstance(node, ast.Attribute) and node.attr == "cfg")


def keys_read(tree: ast.AST) -> set[str]:
    """Keys read from a configuration in a module: ``cfg.KEY``, ``cfg["KEY"]``, ``cfg.get("KEY")``, and the
    keywords of ``cfg.updated(KEY=...)``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_cfg(node.value) and node.attr not in CONFIG_API:
            found.add(node.attr)
        elif (isinstance(node, ast.Subscript) and _is_cfg(node.value) and isinstance(node.slice, ast.Constant)
              and isinstance(node.slice.value, str)):
            found.add(node.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_cfg(node.func.value):
            if node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant):
                found.add(node.args[0].value)
            elif node.func.attr == "updated":
                found |= {kw.arg for kw in node.keywords if kw.arg}
    return found


def keys_set(tree: ast.AST) -> set[str]:
    """Keys a recipe sets: ``config.KEY = ...``."""
    return {target.attr for node in ast.walk(tree) if isinstance(node, ast.Assign) for target in node.targets
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "config"}


def _trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p)) for p in _sources()}


@pytest.fixture(scope="module")
def trees() -> dict[str, ast.AST]:
    return _trees()


def test_every_key_the_product_reads_or_a_recipe_sets_is_declared(trees):
    undeclared = {}
    for path, tree in trees.items():
        used = keys_set(tree) if path.startswith("configs/") else set() if path in OTHER_CFG else keys_read(tree)
        if used - set(KEYS):
            undeclared[path] = sorted(used - set(KEYS))
    assert undeclared == {}, "declare these keys in utils/config_keys.py"


def test_every_declared_key_is_read_by_the_product(trees):
    read = set().union(*(keys_read(tree) for path, tree in trees.items()
                         if not path.startswith("configs/") and path not in OTHER_CFG))
    assert sorted(set(KEYS) - read - REFUSED_ONLY) == []
    assert not REFUSED_ONLY & read and all(KEYS[name].rule is not None for name in REFUSED_ONLY)


def test_files_exempted_from_the_scan_hold_another_settings_object(trees):
    for path, kind in OTHER_CFG.items():
        hints = {ast.unparse(node.annotation) if node.annotation else None for node in ast.walk(trees[path])
                 if isinstance(node, ast.arg) and node.arg == "cfg"}
        assert hints == {kind}, (path, hints)


def test_the_scan_finds_reads_and_settings():
    tree = ast.parse("def f(cfg, job):\n    cfg.lr; job.cfg['seed']; cfg.get('rec'); cfg.updated(num_image=1)\n"
                     "    cfg.to_dict(); other.fp16\n")
    assert keys_read(tree) == {"lr", "seed", "rec", "num_image"}
    assert keys_set(ast.parse("config = edict()\nconfig.lr = 0.1\nx.y = 1\n")) == {"lr"}


def test_the_resume_roles_are_the_ones_resumes_had():
    """What an explicit resume refuses to change (with the reason it says) and what continues the schedule: the
    tables the trainer kept before the keys were declared."""
    assert dict(FIXED_KEYS) == {
        "network": "the saved weights are that network's",
        "network_kwargs": "the saved weights have that network's shapes",
        "embedding_size": "the saved weights and class centres have that width",
        "num_classes": "the head holds one saved row per class",
        "optimizer": "the saved optimizer state is that optimizer's",
        "sub_centers": "the head holds that many saved centres per class",
        "margin": "the head's saved state is that margin's: AdaFace keeps running norm statistics",
    }
    assert sorted(SCHEDULE_KEYS) == sorted(("lr", "max_steps", "num_epoch", "warmup_epoch", "lr_power"))
