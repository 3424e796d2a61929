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
from pathlib import Path

import pytest

from run_result import RunResult
from threaded_job import ThreadedJob
from transom import contract

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The multi-process runs (marked `slow`) first, in their order: pytest-xdist hands the
    tests out in this order, so the short ones fill the workers at the end instead of one
    worker running a long job alone while the other has nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


EXAMPLE = ROOT / "examples" / "train_tiny_gpt.py"


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


@pytest.fixture
def threaded_job(tmp_path, monkeypatch):
    """`threaded_job(replicas, body, build, **ThreadedJob's settings) -> RunResult`: a job whose
    replicas are threads of this process (threaded_job.py), its files under tmp_path."""
    counter = iter(range(100))

    def run(replicas: int, body, build, **settings) -> RunResult:
        job = ThreadedJob(tmp_path / f"threaded{next(counter)}", replicas, body, build, **settings)
        # What the trainers read from their pod environment (here, the process's).
        monkeypatch.setenv(contract.ENV_STATS_DIR, str(job.stats_dir))
        monkeypatch.setenv(contract.ENV_SIGNALS_DIR, str(job.signals_dir))
        if job.detection is None:
            monkeypatch.delenv(contract.ENV_DETECTION, raising=False)
        else:
            monkeypatch.setenv(contract.ENV_DETECTION, json.dumps(job.detection))
        return job.run()

    return run
