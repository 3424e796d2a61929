"""An older commit of Transom to run beside the checkout's, in the same benchmark run.

`--base REV` (ftar_overhead.py, recovery.py) adds the system `transom_base`: the same
`transom run` and worker script, with `PYTHONPATH` pointing at REV's `launcher/` and
`operator/` (exported with `git archive`), so a refactor's cost is a ratio taken on one
machine in one run, the two versions alternating, rather than two runs hours apart on a
shared box. The worker scripts are the checkout's: REV must have the training API they use.
"""

from __future__ import annotations

import contextlib
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from _common import REPO

BASE = "transom_base"  # the system's name in the figures


@contextlib.contextmanager
def base_env(rev: str | None) -> Iterator[dict[str, str]]:
    """{"PYTHONPATH": ...} of REV's library, exported for the benchmark's lifetime ({} without REV)."""
    if not rev:
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="transom-base-") as tmp:
        archive = Path(tmp) / "base.tar"
        try:
            subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), rev,
                            "launcher", "operator"], check=True, capture_output=True, text=True, timeout=120)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"--base {rev}: git archive failed: {e.stderr.strip()}") from e
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        yield {"PYTHONPATH": f"{tmp}/launcher:{tmp}/operator"}
