"""The layers of the code base, checked on the source: who may import whom.

The rules are docs/ARCHITECTURE.md's table "Who imports whom" (read from the page, so the drawing and the
code cannot drift apart); besides: nothing imports ``scripts/``, ``bench/`` or ``train`` (entry points;
``bench`` shares its own ``bench.common``) but a part whose row names it (``scripts`` -> ``bench``: the GPU check
runs the benchmarks' checks); no CLI imports another CLI; no module imports another module's ``_private`` name.
Tests are exempt: they import entry points and private names to test them.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers import ROOT

CLIS = {"eval.verify", "eval.ijb"}  # plus every module under scripts/


def drawn_rules(page: Path) -> dict[str, set[str]]:
    """``{part: the parts it may import, itself included}`` from the architecture page's table."""
    text = page.read_text()
    table = text[text.index("| part | may import |"):].split("\n\n")[0].splitlines()[2:]
    rules = {}
    for row in table:
        part, allowed = (cell.strip() for cell in row.strip("|").split("|"))
        rules[part.strip("`")] = {part.strip("`")} | {a.strip().strip("`") for a in allowed.split(",") if "`" in a}
    return rules


ALLOWED = drawn_rules(ROOT / "docs" / "ARCHITECTURE.md")  # part -> the project's top-level parts it may import
ENTRY_POINTS = {"scripts", "bench", "train"}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(root: Path) -> list[Path]:
    skip = {"tests", ".venv", "work_dirs", "data"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, imported names, line)`` of every import in ``path``, at any depth (lazy imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def _project_packages(root: Path) -> set[str]:
    """Top-level folders holding Python files (packages, and namespace folders such as ``bench``) and modules."""
    skip = {"tests", ".venv", "work_dirs", "data"}
    return {p.name for p in root.iterdir() if p.is_dir() and p.name not in skip and any(p.glob("*.py"))} | {
        p.stem for p in root.glob("*.py")}


def _violations(root: Path = ROOT) -> list[str]:
    """One line per import under ``root`` that breaks a rule."""
    project = _project_packages(root)
    found = []
    for path in _sources(root):
        me = _module_name(path, root)
        top = me.split(".")[0]
        is_cli = me in CLIS or top == "scripts"
        for module, names, line in _imports(path):
            target = module.split(".")[0]
            if target not in project:
                continue
            where = f"{path.relative_to(root)}:{line} imports {module}"
            if top in ALLOWED and target not in ALLOWED[top]:
                found.append(f"{where}: {top} may import only {sorted(ALLOWED[top])}")
            if target in ENTRY_POINTS and target != top and target not in ALLOWED.get(top, ()):
                found.append(f"{where}: nothing imports an entry point ({target}) unless its row allows it")
            if (module in CLIS or target == "scripts") and module != me:
                found.append(f"{where}: {'a CLI' if is_cli else 'a module'} imports a CLI")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and module != me:
                found.append(f"{where}: private name(s) {private} of another module")
    return found


def test_the_layering_rules_hold():
    assert _violations() == []


@pytest.mark.parametrize("module, source, rule", [
    ("utils/probe.py", "from eval.verification import evaluate\n", "utils may import only"),
    ("dataset/probe.py", "import backbones\n", "dataset may import only"),
    ("eval/probe.py", "def f():\n    from scripts.rec_info import rec_info\n", "nothing imports an entry point"),
    ("eval/ijb.py", "from eval.verify import target_paths\n", "a CLI imports a CLI"),
    ("eval/probe.py", "from dataset.recordio import _parse_idx\n", "private name"),
    ("partial_fc/probe.py", "from trainer.build import build\n", "partial_fc may import only"),
    ("utils/probe.py", "from partial_fc import PartialFC\n", "utils may import only"),
    ("partial_fc/probe.py", "from bench.local_ranks import free_port\n", "nothing imports an entry point"),
    ("dataset/probe.py", "from scripts.make_rec import main\n", "nothing imports an entry point"),
])
def test_the_checker_finds_a_violation(tmp_path, module, source, rule):
    """The checker itself, on a small tree that breaks one rule."""
    for package in ("utils", "dataset", "eval", "scripts", "backbones", "partial_fc", "trainer"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "bench").mkdir()  # a folder of scripts without __init__.py, as the real one
    (tmp_path / "bench" / "local_ranks.py").write_text("")
    (tmp_path / module).write_text(source)
    assert any(rule in v and module in v for v in _violations(tmp_path)), _violations(tmp_path)


def test_an_entry_point_is_imported_only_where_its_row_allows_it(tmp_path):
    """``scripts`` may import ``bench`` (its row says so: the GPU check runs the benchmarks' checks); ``bench``
    imports no ``scripts``."""
    assert "bench" in ALLOWED["scripts"] and "scripts" not in ALLOWED["bench"]
    for package in ("scripts", "bench"):
        (tmp_path / package).mkdir()
    (tmp_path / "bench" / "plan.py").write_text("")
    (tmp_path / "scripts" / "probe.py").write_text("from bench.plan import predict\n")
    assert _violations(tmp_path) == []
    (tmp_path / "bench" / "probe.py").write_text("from scripts.probe import x\n")
    assert any("bench/probe.py" in v and "nothing imports an entry point" in v for v in _violations(tmp_path))


def test_the_drawn_table_covers_every_part_of_the_tree_and_no_other():
    parts = _project_packages(ROOT) | {"configs"}
    assert parts == set(ALLOWED), (sorted(parts - set(ALLOWED)), sorted(set(ALLOWED) - parts))
    assert ALLOWED["utils"] == {"utils"} and ALLOWED["dataset"] == {"dataset", "utils"}
    assert ALLOWED["partial_fc"] == {"partial_fc", "losses", "utils"}


def test_the_head_is_one_package_as_drawn():
    """Everything that knows the sharded class centres is in ``partial_fc/``: the files the page names exist, and
    no module elsewhere defines the head's pieces (the sharded cross-entropy, the row-sparse optimizers, the head's
    checkpoint shards)."""
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`(\w+\.py)` \(", page[page.index("`partial_fc/` in more detail"):]))
    assert named == {p.name for p in (ROOT / "partial_fc").glob("*.py")} - {"__init__.py"}, named
    head_names = {"sharded_cross_entropy", "sharded_log_sum_exp", "RowSparseSGD", "RowSparseAdamW", "head_shard",
                  "load_head_rows", "class_partition", "PartialFC"}
    defined = {}
    for path in _sources(ROOT):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in head_names:
                defined.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert all(all(f.startswith("partial_fc/") for f in files) for files in defined.values()), defined
    assert set(defined) == head_names, sorted(head_names - set(defined))


def test_every_library_part_logs_through_the_trainer_s_logger():
    """``setup_logging`` routes the module loggers of every part below the entry points (rank 0 only)."""
    from utils.logging_setup import LIBRARY_PACKAGES

    assert set(LIBRARY_PACKAGES) == set(ALLOWED) - ENTRY_POINTS - {"configs"}
