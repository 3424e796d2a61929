"""When a job is done: only when a replica committed the last step, or its script says so.

A script that exits 0 without reaching its target is a failure (the launcher asks the
coordinator before it calls workers that exited 0 done): a real `transom run` process tree.
How a script ends the job (its target, `trainer.close(end_job=True)` to stop early on
purpose, the `with` form) is the trainer's logic, shown with replicas as threads of this
process (threaded_job.py).
"""

from __future__ import annotations

import pytest
import torch

from transom.ft import FaultTolerant

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def test_a_script_that_exits_0_without_training_fails_the_run(transom_run):
    result = transom_run(["--replicas", "2", "--max-restarts", "0"], ["pass"], script="-c", timeout_s=120)
    assert result.returncode == 1, result.output[-3000:]
    s = result.summary
    assert s["completed_step"] is None and s["steps_committed"] == 0 and s["replicas_finished"] == 0
    assert "workers exited 0 before the job completed" in result.output


def build(replica: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(trainer: FaultTolerant, model: torch.nn.Module, step: int) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(31 * step + trainer.replica_id))
    model(x).pow(2).mean().backward()
    trainer.finish_step()


def ends_on_purpose_at(end_at: int):
    """Every replica commits step `end_at` in the same round and then ends the job on purpose
    (the validation loss is good enough, say), the documented way to stop early."""
    def body(replica: int, trainer: FaultTolerant, model: torch.nn.Module) -> int:
        for step in trainer.steps(40):
            train_step(trainer, model, step)
            if trainer.step == end_at:
                trainer.close(end_job=True)
                break
        return trainer.step
    return body


def with_form(steps: int, end_at: int | None = None, raise_at: int | None = None):
    """The loop in `with trainer:` (ft.FaultTolerant's `with` form): leaving the block normally
    ends the job where it is, leaving it by an exception is a failure."""
    def body(replica: int, trainer: FaultTolerant, model: torch.nn.Module) -> int:
        with trainer:
            for step in trainer.steps(steps):
                train_step(trainer, model, step)
                if trainer.step == end_at:
                    break
                if trainer.step == raise_at and replica == 1:
                    raise RuntimeError(f"a bug at step {trainer.step}")
        return trainer.step
    return body


def test_a_script_that_ends_the_job_on_purpose_completes_it(threaded_job):
    result = threaded_job(2, ends_on_purpose_at(10), build)
    assert result.returncode == 0, result.output[-3000:]
    s = result.summary
    assert s["completed_step"] == 10 and s["steps_committed"] == 10
    assert s["replicas_finished"] == 2 and s["replicas_bit_identical"] is True and s["replica_restarts"] == 0


@pytest.mark.parametrize("end_at, expected", [(None, 20), (7, 7)], ids=["to-the-target", "break-early"])
def test_the_with_form_completes_the_job_when_the_block_ends_normally(threaded_job, end_at, expected):
    result = threaded_job(2, with_form(20, end_at=end_at), build)
    assert result.returncode == 0, result.output[-3000:]
    s = result.summary
    assert s["completed_step"] == expected and s["steps_committed"] == expected
    assert s["replicas_finished"] == 2 and s["replicas_bit_identical"] is True and s["replica_restarts"] == 0


def test_the_with_form_reports_a_failure_when_the_block_raises(threaded_job):
    # Replica 1 leaves its block by an exception at step 5, with no attempt left: its failure
    # is reported at once, and replica 0 (minReplicas 1) completes the job alone.
    result = threaded_job(2, with_form(20, raise_at=5), build, attempts=1)
    assert result.returncode == 1, result.output[-3000:]  # a replica failed for good
    failed = [e for e in result.summary["events"] if e.startswith("failed: replica 1")]
    assert failed == ["failed: replica 1: closed at step 5, before the target 20: RuntimeError: a bug at step 5"], \
        result.summary["events"]
    assert "replica 1: RuntimeError: a bug at step 5" in result.output
    assert result.summary["completed_step"] == 20 and result.summary["replicas_finished"] == 1
