"""The facts of README and docs/ that code can check stay true."""
from __future__ import annotations

import re

from tests.helpers import ROOT

README_MAX_LINES = 150
# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional "title" is ignored).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def test_configuration_page_key_table_is_generated_from_base():
    from utils.config import keys_table

    assert keys_table().strip() in (ROOT / "docs" / "configuration.md").read_text(), (
        "docs/configuration.md's key table is stale: paste the output of `python -m utils.config` into "
        "docs/configuration.md")


def test_backbones_page_lists_every_registered_backbone():
    from backbones import list_models

    page = (ROOT / "docs" / "backbones.md").read_text()
    assert [m for m in list_models() if f"| `{m}`" not in page] == []


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move the details to a page under docs/")


def test_relative_links_in_readme_and_docs_point_at_files():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = FENCE.sub("", page.read_text())  # a code block's brackets are code, not links
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # http:, https:, mailto:, …
            path, _, anchor = target.partition("#")
            file = page.parent / path if path else page  # "#heading": a heading of the same page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def _anchors(page):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.*?)\s*$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
