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
