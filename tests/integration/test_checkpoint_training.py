"""Checkpoints of real training runs: the tiny GPT example's training with a checkpoint URI.

A job that stops and is started again resumes from its newest checkpoint and ends with the
same weights, bit for bit, as a job that never stopped, also with FSDP2 inside each replica;
a checkpoint restores into a different number of replicas, and a replica that fails after
the resume does not restore the checkpoint but catches up from a peer. Storage that goes
away in the middle of a run is named in the coordinator's events while training goes on,
and the checkpoints resume when it is back.

FSDP2 needs a torch.distributed world per replica, so that job is `transom run` with
processes; the others are the checkpoint engine's and the trainer's logic, with replicas as
threads of this process (threaded_job.py).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from threaded_job import TinyGPT
from transom.checkpoint import layout
from transom.checkpoint.engine import CheckpointConfig
from transom.checkpoint.restore import IncompatibleCheckpoint, load_step
from transom.checkpoint.storage import Storage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SMALL = ["--dim", "32", "--context", "32", "--batch-size", "8"]
CAP = ["--steps", "500"]  # a cap for the jobs that end on an event (--end-on)


def committed(root: Path) -> list[int]:
    return sorted(step for p in root.iterdir()
                  if (p / layout.MANIFEST).exists() and (step := layout.parse_step_dir(p.name)) is not None)


def manifest(root: Path, step: int) -> layout.Manifest:
    return layout.Manifest.from_json((root / layout.step_dir(step) / layout.MANIFEST).read_text())


def first_committed_step(result, replica: int) -> int:
    return min(r["step"] for r in result.records(replica) if r["committed"])


def ok(result) -> None:
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.compat
def test_a_stopped_job_resumes_bit_identical(threaded_job, tmp_path):
    gpt, ckpt = TinyGPT(), tmp_path / "ckpt"
    with_ckpt = CheckpointConfig(str(ckpt), interval_steps=10, keep=2)
    reference = threaded_job(2, gpt.steps(60), gpt.build)
    ok(reference)

    first = threaded_job(2, gpt.steps(25), gpt.build, checkpoint=with_ckpt)
    ok(first)
    # Due at 10 and 20 (20 is skipped if 10 is still persisting), and 25 at the end; keep 2.
    done = committed(ckpt)
    assert len(done) == 2 and done[-1] == 25 and set(done) <= {10, 20, 25}, done
    assert first.summary["last_checkpoint"] == 25  # reported to the coordinator
    assert manifest(ckpt, 25).num_parts == 2  # both replicas wrote a part

    second = threaded_job(2, gpt.steps(60), gpt.build, checkpoint=with_ckpt)
    ok(second)
    # Both restore: a peer that restored the same step is not "ahead" (recovering from it
    # would cost the first step this replica's gradients, and bit-identity).
    assert [second.results[r]["restored_step"] for r in range(2)] == [25, 25], second.output[-3000:]
    assert first_committed_step(second, 0) == 26 and first_committed_step(second, 1) == 26
    assert committed(ckpt)[-1] == 60 and second.summary["last_checkpoint"] == 60
    assert second.digests() == reference.digests(), "the resumed run must end where the uninterrupted one did"


def test_a_resume_from_an_interval_checkpoint_is_bit_identical_under_a_schedule(threaded_job, tmp_path):
    # The documented loop steps its scheduler after optimizer.step(): a checkpoint of step N
    # must hold the schedule at position N (the state step N+1 starts from), or every step
    # of a resumed run trains at the previous step's learning rate.
    gpt, ckpt = TinyGPT(), tmp_path / "ckpt"
    reference = threaded_job(1, gpt.steps(30), gpt.build, extra=gpt.schedule)
    ok(reference)
    # The only replica fails at step 25, without a final checkpoint; its restart resumes
    # from the newest interval checkpoint.
    resumed = threaded_job(1, gpt.steps(30), gpt.build, extra=gpt.schedule, faults={0: ["raise:step=25"]},
                           checkpoint=CheckpointConfig(str(ckpt), interval_steps=10, keep=5))
    ok(resumed)
    restored = resumed.results[0]["restored_step"]
    assert restored in (10, 20), resumed.output[-3000:]
    for step in committed(ckpt):
        schedule = load_step(Storage(str(ckpt)), step)["extra"]
        assert schedule["last_epoch"] == step, f"checkpoint {step} holds the schedule at {schedule['last_epoch']}"
    assert resumed.digests() == reference.digests(), "the resumed run must end where the uninterrupted one did"


def test_a_checkpoint_restores_into_more_replicas_and_a_failed_one_catches_up(threaded_job, tmp_path):
    gpt, ckpt = TinyGPT(), tmp_path / "ckpt"
    ok(threaded_job(2, gpt.steps(10), gpt.build, checkpoint=CheckpointConfig(str(ckpt))))
    assert committed(ckpt) == [10]
    # Three replicas resume from the two-replica checkpoint. Replica 1 fails at step 20; its
    # restart sees healthy peers past the newest checkpoint, so it does not restore but
    # catches up from a peer. No interval checkpoint is written meanwhile (only the final one
    # at close): with one every few steps, a restart that happened to meet the peers exactly
    # at a fresh checkpoint's step would restore it instead (by design: then restoring costs
    # nobody anything), and the test would depend on the machine's speed.
    more = threaded_job(3, gpt.steps(500), gpt.build, checkpoint=CheckpointConfig(str(ckpt), interval_steps=1000),
                        faults={1: ["raise:step=20"]}, end_on=["caught_up:1"])
    more.assert_finished_together(3)
    end = more.end_step()
    assert all(first_committed_step(more, r) == 11 for r in range(3))
    assert more.output.count("restored checkpoint step 10") == 3  # every first attempt, not the restarted one
    assert [more.results[r]["restored_step"] for r in range(3)] == [10, None, 10]
    assert "recovering from it instead of restoring the checkpoint" in more.output
    assert more.incarnations(1) == 2
    assert any(r["recovering"] and r["committed"] for r in more.records(1))
    assert committed(ckpt)[-1] == end and manifest(ckpt, end).num_parts == 3


def test_fsdp2_example_killed_or_stopped_resumes_bit_identical(transom_run, tmp_path):
    # The example's loop: FSDP2 inside each replica, AdamW, a warmup-cosine schedule as
    # extra_state, clipping right after backward().
    ckpt, crashed = tmp_path / "ckpt", tmp_path / "crashed"
    run = ["--replicas", "2", "--nproc-per-replica", "2", "--job-name", "fsdp"]  # the second run continues it
    script = ["--steps", "24", "--checkpoint-interval", "4", "--inner", "fsdp", *SMALL]
    # The uninterrupted job, checkpointed every 4 steps on its way to 24 (a due checkpoint is
    # skipped while the one before still persists) ...
    whole = transom_run([*run, "--checkpoint-uri", str(ckpt)], script)
    ok(whole)
    done = committed(ckpt)
    assert done[-1] == 24 and len(done) == 2, done  # keep 2
    middle = done[0]
    m = manifest(ckpt, middle)
    assert (m.num_shards, m.num_parts) == (2, 4)  # a shard per rank, each split between 2 replicas
    assert {e.key.split("/")[0] for e in m.entries} == {"shard-0", "shard-1"}
    assert any("__meta__" in json.dumps(s) for s in m.structures)  # DTensor placements recorded
    # ... the job as if it had stopped after that checkpoint, started again ...
    shutil.rmtree(ckpt / layout.step_dir(24))
    second = transom_run([*run, "--checkpoint-uri", str(ckpt)], script)
    ok(second)
    assert second.output.count(f"resumed from the checkpoint of step {middle}") == 2  # rank 0 of each replica
    assert second.digests() == whole.digests()
    # ... and the job whose replicas are both SIGKILLed at step 22 (rank 1 of each: each
    # replica restarts whole) restores its newest checkpoint and ends where the uninterrupted
    # one did. minReplicas 2: the replica back first waits for the other (alone, it would
    # train on at its own learning rate).
    kills = ["--inject", "kill:replica=0,step=22,rank=1", "--inject", "kill:replica=1,step=22,rank=1"]
    killed = transom_run([*run, "--min-replicas", "2", *kills, "--checkpoint-uri", str(crashed)], script)
    ok(killed)
    assert killed.incarnations(0) >= 2 and killed.incarnations(1) >= 2
    resumed = re.findall(r"resumed from the checkpoint of step (\d+)", killed.output)
    assert len(resumed) == 2 and len(set(resumed)) == 1 and 0 < int(resumed[0]) <= 20, killed.output[-3000:]
    assert killed.digests() == whole.digests()
    # A replica of another shape is refused with a message that says why.
    with pytest.raises(IncompatibleCheckpoint, match="sharded over 2 ranks per replica and this replica has 1"):
        load_step(Storage(str(ckpt)), middle, num_shards=1)


class _RetryWatch(logging.Handler):
    """Sets `seen` when the checkpoint writer logs a failed write it will retry."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying" in record.getMessage():
            self.seen.set()


def test_storage_lost_mid_run_is_named_and_checkpoints_resume_when_it_is_back(threaded_job, tmp_path):
    # The checkpoint directory goes away under the running job (a file where the directory
    # was: every write fails with a real OSError, as on a lost mount) after its first commit,
    # and comes back once a write has failed and 4 s have passed. The outage follows the job's
    # events, not the clock: on a loaded machine the first commit, or the next write, can come
    # late (an outage on a timer once ended before any write had tried).
    ckpt, away = tmp_path / "ckpt", tmp_path / "ckpt.away"
    lost_at: list[float] = []
    outage_error: list[BaseException] = []
    job_done = threading.Event()
    watch = _RetryWatch()

    def lose_then_restore() -> None:
        try:
            while not job_done.is_set() and not (ckpt.exists() and committed(ckpt)):
                time.sleep(0.05)
            if job_done.is_set():
                return
            ckpt.rename(away)
            ckpt.write_text("not a directory")
            lost_at.append(time.monotonic())
            time.sleep(4)
            watch.seen.wait(timeout=300)
            ckpt.unlink()
            away.rename(ckpt)
        except BaseException as e:  # noqa: BLE001 - named in the test's failure below
            outage_error.append(e)

    logging.getLogger("transom.checkpoint").addHandler(watch)
    outage = threading.Thread(target=lose_then_restore, daemon=True)
    outage.start()
    # The job ends once the writers write again (the final checkpoint, at its last step, is
    # written after that); the step cap is only a cap.
    gpt = TinyGPT()
    try:
        run = threaded_job(2, gpt.steps(5000), gpt.build, checkpoint=CheckpointConfig(str(ckpt), interval_steps=10),
                           end_on=["checkpoint_trouble_over"])
    finally:
        job_done.set()
        watch.seen.set()
        outage.join(timeout=30)
        logging.getLogger("transom.checkpoint").removeHandler(watch)
    assert not outage_error, f"the outage itself failed: {outage_error[0]!r}"
    assert lost_at, "the job ended before its first checkpoint was committed"
    run.assert_finished_together(2)
    end = run.end_step()
    events = run.summary["events"]
    started = [e for e in events if e.startswith("checkpoint_trouble:")]
    over = [e for e in events if e.startswith("checkpoint_trouble_over:")]
    assert started and over, events
    assert "cannot write its checkpoint" in started[0] and 'Error" (retrying)' in started[0], started
    assert events.index(started[0]) < events.index(over[0])
    assert committed(ckpt)[-1] == end and run.summary["last_checkpoint"] == end
