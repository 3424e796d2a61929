"""What `transom run` shows and sums up. With `--log-dir` (what `make demo` runs) the
terminal shows progress, events and the closing table only; the workers' own output, a
SIGKILLed worker's included, lands in one file per replica, named in the summary. A run
stopped by SIGTERM says in its summary how far the job got, and claims nothing about
replicas it could not compare."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launching import EXAMPLE
from waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_log_dir_keeps_the_terminal_to_progress_and_the_logs_per_replica(transom_run, tmp_path):
    logs = tmp_path / "logs"
    result = transom_run(["--replicas", "2", "--inject", "kill:replica=1,step=10", "--log-dir", str(logs),
                          "--end-on", "caught_up:1"], ["--steps", "500", "--log-every", "10"])
    result.assert_finished_together(2)
    terminal = result.output.splitlines()
    # The worker's own lines (the example prints its loss; the launcher logs the kill) are not here...
    assert not any("transom.launch" in line or "transom.ft" in line for line in terminal), result.output[-3000:]
    assert any("FAIL  replica 1" in line for line in terminal)
    assert any(line.split()[:2] == ["replica", "incarnations"] for line in terminal)
    # ...but in the replica's file, every incarnation appended.
    assert sorted(p.name for p in logs.iterdir()) == ["coordinator.log", "replica-0.log", "replica-1.log"]
    killed = (logs / "replica-1.log").read_text()
    assert "killed by SIGKILL" in killed
    assert result.summary["logs"] == {str(r): str(logs / f"replica-{r}.log") for r in range(2)}
    row = next(line.split() for line in terminal if line.split()[:1] == ["1"] and line.endswith("replica-1.log"))
    assert int(row[1]) >= 2, row  # two incarnations of replica 1


def newest_committed(stats: Path) -> int:
    """The newest committed step in the workers' step records so far (0: none yet)."""
    newest = 0
    for path in stats.glob("steps-r*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if record.get("committed"):
                newest = max(newest, record["step"])
    return newest


def test_a_run_stopped_by_sigterm_reports_the_steps_it_committed_and_compares_nothing(tmp_path):
    stats, summary = tmp_path / "stats", tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "transom", "run", "--replicas", "2", "--log-dir", str(tmp_path / "logs"),
           "--summary-json", str(summary), "--stats-dir", str(stats), "--timeout", "200",
           "--", sys.executable, str(EXAMPLE), "--steps", "100000"]
    with open(tmp_path / "output", "w") as out:
        run = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_until(lambda: newest_committed(stats) >= 5, 180, "five committed steps")
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
        seen = newest_committed(stats)  # every worker has stopped: nothing is committed after this
    finally:
        if run.poll() is None:
            run.kill()
    output = (tmp_path / "output").read_text()
    assert run.returncode == 128 + signal.SIGTERM, output[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps_committed"] == seen >= 5 and s["completed_step"] is None, s
    # Nobody finished, so nothing was compared: not "false", which would say the replicas differed.
    assert s["replicas_bit_identical"] is None and s["replicas_compared"] == [] and s["replicas_finished"] == 0, s
    left_out = s["replicas_not_compared"]
    assert [n["replica"] for n in left_out] == [0, 1]
    assert all(n["why"].startswith("it had not finished the job when the run ended") for n in left_out), left_out
