"""A mistake in the training script ends the job at once: no restart, no new generation.

A real `transom run` process tree whose script makes a second backward pass in one step
without `trainer.no_sync()` (a UsageError, which every replica and every retry would raise
again): the launchers exit with EXIT_SCRIPT_ERROR after one attempt, the run stops every
replica and exits with that code, the error is in the summary and printed once, and
nothing the workers started is left running.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from transom import contract

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]
SMALL_JOB = Path(__file__).parent / "scripts" / "small_job.py"
HINT = "the training script is wrong, and retrying cannot help"


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_second_backward_pass_ends_the_run_after_one_attempt_with_the_message(transom_run, tmp_path):
    children = tmp_path / "children"
    children.mkdir()
    # --max-restarts 3: the launchers would restart an ordinary crash three times each.
    result = transom_run(["--replicas", "2", "--max-restarts", "3"],
                         ["--steps", "50", "--second-backward-at", "3", "--child-pid-dir", str(children)],
                         script=SMALL_JOB, timeout_s=120)
    ended = time.time()
    assert result.returncode == contract.EXIT_SCRIPT_ERROR, result.output[-4000:]
    s = result.summary
    assert s["script_error"].startswith("ScriptError: UsageError: a second backward pass in one step"), s
    assert s["completed_step"] is None and s["replica_restarts"] == 0
    # One incarnation per replica: neither restarted in place nor started as a new generation.
    assert [result.incarnations(r) for r in range(2)] == [1, 1]
    records = [r for rep in range(2) for r in result.records(rep)]
    assert max(r["step"] for r in records) == 3
    # The run's own line, once, with what to do; no launcher retried.
    assert result.output.count(HINT) == 1, result.output[-4000:]
    assert "Fix the script" in result.output
    assert "attempt 1" not in result.output and "starting generation" not in result.output
    # From the last step to the end of the run: seconds (retrying took 17-37 s, most of it
    # start-ups; the start-up itself is left out, as it depends on the machine's load).
    assert ended - max(r["t"] for r in records) < 10
    # Each worker's child (files <worker pid>-<child pid>): one worker per replica, all stopped.
    pids = [int(n) for f in children.iterdir() for n in f.name.split("-")]
    assert len(pids) == 4 and not [pid for pid in pids if running(pid)]
