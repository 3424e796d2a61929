"""What the docs name exists: every test a page cites (`test_...`) is a test function or a
test module in tests/, so a renamed or deleted test cannot leave a page pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_docs_cite_exists():
    tests = list((ROOT / "tests").rglob("test_*.py"))
    defined = {m for p in tests for m in re.findall(r"^\s*(?:async )?def (test_\w+)", p.read_text(), re.M)}
    modules = {p.stem for p in tests}
    cited = {(name, page.name) for page in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
             for name in re.findall(r"`(test_\w+)", page.read_text())}
    assert len(cited) > 100  # the pages do cite their proof
    missing = sorted((name, page) for name, page in cited if name not in defined and name not in modules)
    assert missing == [], missing
