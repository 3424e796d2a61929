"""When a job is done: only when a replica committed the last step, or its script says so.

Real `transom run` process trees. A script that exits 0 without reaching its target is a
failure (the launcher asks the coordinator before it calls workers that exited 0 done),
and `trainer.close(end_job=True)` is how a script ends the job early on purpose.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]
SMALL_JOB = Path(__file__).parent / "scripts" / "small_job.py"


def test_a_script_that_exits_0_without_training_fails_the_run(transom_run):
    result = transom_run(["--replicas", "2", "--max-restarts", "0"], ["pass"], script="-c", timeout_s=120)
    assert result.returncode == 1, result.output[-3000:]
    s = result.summary
    assert s["completed_step"] is None and s["steps_committed"] == 0 and s["replicas_finished"] == 0
    assert "workers exited 0 before the job completed" in result.output


def test_a_script_that_ends_the_job_on_purpose_completes_it(transom_run):
    result = transom_run(["--replicas", "2"], ["--steps", "40", "--end-at", "10"], script=SMALL_JOB)
    assert result.returncode == 0, result.output[-3000:]
    s = result.summary
    assert s["completed_step"] == 10 and s["steps_committed"] == 10
    assert s["replicas_finished"] == 2 and s["replicas_bit_identical"] is True and s["replica_restarts"] == 0


@pytest.mark.parametrize("end_at, expected", [(None, 20), (7, 7)], ids=["to-the-target", "break-early"])
def test_the_with_form_completes_the_job_when_the_block_ends_normally(transom_run, end_at, expected):
    extra = ["--end-at", str(end_at)] if end_at is not None else []
    result = transom_run(["--replicas", "2"], ["--steps", "20", "--with-form", *extra], script=SMALL_JOB)
    assert result.returncode == 0, result.output[-3000:]
    s = result.summary
    assert s["completed_step"] == expected and s["steps_committed"] == expected
    assert s["replicas_finished"] == 2 and s["replicas_bit_identical"] is True and s["replica_restarts"] == 0


def test_the_with_form_reports_a_failure_when_the_block_raises(transom_run):
    result = transom_run(["--replicas", "2", "--max-restarts", "0"],
                         ["--steps", "20", "--with-form", "--raise-at", "5"], script=SMALL_JOB, timeout_s=120)
    assert result.returncode == 1, result.output[-3000:]
    assert result.summary["completed_step"] is None
    assert "a bug at step 5" in result.output
