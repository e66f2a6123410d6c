"""Where the repository and the shared MXNet-written fixtures are (imported by tests; never `conftest`,
whose module name is ambiguous between tests/ and tests/reliability/)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
FIXTURES = SHARED / "fixtures"
