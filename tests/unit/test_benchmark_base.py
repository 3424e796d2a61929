"""benchmarks/_base.py: `--base REV` runs an older commit's library beside the checkout's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _base import base_env  # noqa: E402


def test_a_base_revision_is_exported_for_the_benchmarks_lifetime():
    with base_env("HEAD") as env:
        launcher, operator = (Path(p) for p in env["PYTHONPATH"].split(":"))
        assert (launcher / "transom" / "ft" / "trainer.py").is_file()
        assert (operator / "transom_operator" / "controller.py").is_file()
    assert not launcher.exists()  # removed with the run
    with base_env(None) as env:
        assert env == {}


def test_an_unknown_revision_is_refused_with_gits_reason():
    with pytest.raises(SystemExit, match="--base no-such-rev: git archive failed"):
        with base_env("no-such-rev"):
            pass
