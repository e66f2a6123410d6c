"""The README's facts that code can check stay true."""
from __future__ import annotations

from tests.helpers import ROOT


def test_readme_config_table_is_generated_from_base():
    from utils.config import keys_table

    assert keys_table().strip() in (ROOT / "README.md").read_text(), (
        "README's config table is stale: paste the output of `python -m utils.config`")


def test_readme_lists_every_registered_backbone():
    from backbones import list_models

    readme = (ROOT / "README.md").read_text()
    assert [m for m in list_models() if f"| `{m}`" not in readme] == []


def test_readme_cpu_heap_line_is_the_one_the_launchers_set():
    from utils.cpu_memory import heap_env

    line = f"export GLIBC_TUNABLES={heap_env({}, keep_freed=True)['GLIBC_TUNABLES']}\n"
    assert line in (ROOT / "README.md").read_text()
