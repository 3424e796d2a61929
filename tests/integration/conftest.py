"""Fixtures for multi-process runs: `transom run` as a real subprocess tree.

Every replica is a real `transom launch` process supervising real worker processes that
talk over real Gloo sockets; faults are real signals. The fixture returns the run's summary
and the per-step records the workers wrote, so tests assert on what happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_tiny_gpt.py"


@dataclass
class RunResult:
    returncode: int
    summary: dict
    output: str
    stats_dir: Path

    def records(self, replica: int) -> list[dict]:
        """All step records of a replica, over its incarnations, in time order."""
        out = []
        for path in sorted(self.stats_dir.glob(f"steps-r{replica}-g*-a*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # the last line of a SIGKILLed worker may be cut short
        return sorted(out, key=lambda r: r["t"])

    def digests(self) -> dict[tuple[int, int], str]:
        """(replica, rank) -> sha256 of the rank's final parameters."""
        out = {}
        for path in self.stats_dir.glob("final-r*-k*.json"):
            f = json.loads(path.read_text())
            out[(f["replica"], f["rank"])] = f["digest"]
        return out

    def incarnations(self, replica: int) -> int:
        return len(list(self.stats_dir.glob(f"steps-r{replica}-g*-a*.jsonl")))


@pytest.fixture
def transom_run(tmp_path):
    counter = iter(range(100))

    def run(run_args: list[str], script_args: list[str], timeout_s: float = 240,
            script: Path | str = EXAMPLE, preexec_fn=None) -> RunResult:
        """`transom run RUN_ARGS -- python SCRIPT SCRIPT_ARGS` (`script` "-c": inline code);
        `preexec_fn` runs in the child before it starts (to put it into a cgroup)."""
        workdir = tmp_path / f"run{next(counter)}"
        workdir.mkdir()
        summary_path = workdir / "summary.json"
        stats = workdir / "stats"
        cmd = [
            sys.executable, "-m", "transom", "run", *run_args,
            "--summary-json", str(summary_path), "--stats-dir", str(stats), "--timeout", str(timeout_s - 20),
            "--", sys.executable, str(script), *script_args,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=preexec_fn)
        output = proc.stdout + proc.stderr
        assert summary_path.exists(), f"no summary; output:\n{output[-4000:]}"
        return RunResult(proc.returncode, json.loads(summary_path.read_text()), output, stats)

    return run
