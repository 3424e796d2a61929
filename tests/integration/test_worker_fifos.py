"""A worker that puts FIFOs where its launcher reads its files cannot freeze the launcher.

A real `transom run` process tree: replica 1's worker replaces its signals rows, collective
counts, waiting byte, stacks file, ScriptError record and a step record with FIFOs, then
crashes. Its launcher used to block in open() on the first of them (the supervisor's only
loop thread), so the crash was never reported nor restarted: the coordinator declared the
replica failed for missing heartbeats and the run timed out. Now the launcher skips them
with a warning (transom/worker_files.py) and restarts the replica in place, as for any
crash, and the run's summary is written.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]
SMALL_JOB = Path(__file__).parent / "scripts" / "small_job.py"


def test_a_worker_that_replaces_its_files_with_fifos_and_crashes_is_restarted_in_place(transom_run):
    result = transom_run(["--replicas", "2", "--max-restarts", "2"],
                         ["--steps", "40", "--step-seconds", "0.05", "--fifos-then-crash", "1:5"],
                         script=SMALL_JOB, timeout_s=150)
    assert "replaced with FIFOs" in result.output, result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]
    # Restarted in place: a second attempt of generation 0, no new generation.
    assert result.summary["replica_restarts"] == 1, result.summary
    assert result.incarnations(1) == 2 and result.incarnations(0) == 1
    assert result.summary["steps_committed"] == 40
    assert "starting generation" not in result.output
    assert "a FIFO, not a regular file" in result.output, result.output[-4000:]
    # Its second attempt joined (here the other replica may complete the job first: a start-up
    # takes longer than the 40 steps on a loaded machine).
    assert "join  replica 1 generation 0 attempt 1" in result.output, result.output[-4000:]
