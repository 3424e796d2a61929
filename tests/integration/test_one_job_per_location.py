"""One job per checkpoint location, with real trainers: a job of another identity is refused
when it starts, before it restores or writes anything, with a message that names both jobs
and the location, and without a restart; a job of the same identity resumes.

The identity's logic with replicas as threads (threaded_job.py: the TrainingJob's name and
uid in their environment, as the operator gives them), and `transom run`'s own (its job
name, the flag that continues a job, the exit code of a refused run) with real processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from threaded_job import TinyGPT
from transom import contract
from transom.checkpoint import layout
from transom.checkpoint.engine import CheckpointConfig
from transom.job_identity import JobIdentity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
FIRST = JobIdentity("demo", "7d1e4a52-0c8b-4e0f-9b7a-2f6d3c1e8a90")
AGAIN = JobIdentity("demo", "3b9f0d6e-5a21-4c7d-8e43-9d0a1b2c3f47")  # deleted and created again: another job
SMALL = ["--dim", "32", "--context", "32", "--batch-size", "8"]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root`: its size and modification time (what a writer would change)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_another_job_is_refused_at_start_and_the_owner_resumes(threaded_job, tmp_path):
    gpt, ckpt = TinyGPT(), tmp_path / "ckpt"
    config = CheckpointConfig(str(ckpt), interval_steps=5, keep=2)
    first = threaded_job(2, gpt.steps(10), gpt.build, checkpoint=config, job=FIRST)
    assert first.returncode == 0, first.output[-3000:]
    assert (ckpt / layout.JOB_RECORD).is_file() and first.summary["last_checkpoint"] == 10
    before = tree(ckpt)

    other = threaded_job(2, gpt.steps(20), gpt.build, checkpoint=config, job=AGAIN)
    said = (f"CheckpointLocationTaken: checkpoint location {ckpt} belongs to TrainingJob demo (uid {FIRST.uid}), "
            f"not to this job, TrainingJob demo (uid {AGAIN.uid})")
    assert other.returncode != 0 and other.output.count(said) == 2, other.output[-3000:]  # each replica, once
    assert f"delete {ckpt}/{layout.JOB_RECORD}" in other.output
    assert other.summary["completed_step"] is None and other.summary["last_checkpoint"] is None
    assert "restored checkpoint" not in other.output  # refused before the restore
    assert tree(ckpt) == before, "a refused job wrote or deleted something"

    again = threaded_job(2, gpt.steps(20), gpt.build, checkpoint=config, job=FIRST)
    assert again.returncode == 0, again.output[-3000:]
    assert [again.results[r]["restored_step"] for r in range(2)] == [10, 10]
    assert again.summary["last_checkpoint"] == 20


def test_a_second_transom_run_is_refused_unless_it_names_the_job_it_continues(transom_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    run = ["--replicas", "1", "--checkpoint-uri", str(ckpt)]
    first = transom_run(run, ["--steps", "4", *SMALL])
    assert first.returncode == 0, first.output[-3000:]
    name = first.summary["job"]
    assert name.startswith("local-") and f"--job-name {name}` continues it" in first.output

    second = transom_run(run, ["--steps", "8", *SMALL])
    assert second.returncode == contract.EXIT_SCRIPT_ERROR, second.output[-3000:]
    error = second.summary["script_error"]
    assert error.startswith(f"ScriptError: CheckpointLocationTaken: checkpoint location {ckpt} belongs to "
                            f"`transom run` job {name}, not to this job, `transom run` job {second.summary['job']}")
    assert f"run it with `transom run --job-name {name}`" in error
    assert second.incarnations(0) == 1  # not restarted

    resumed = transom_run([*run, "--job-name", name], ["--steps", "8", *SMALL])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resumed from the checkpoint of step 4" in resumed.output and resumed.summary["completed_step"] == 8
