"""Real faults in real multi-process runs: the replicas that did not fail keep training.

Each test runs `transom run` with the tiny GPT example: a coordinator, one launcher per
replica and real worker processes over Gloo. Faults are real signals (SIGKILL, SIGSTOP)
sent by a worker to itself at a chosen step, just before the cross-replica all-reduce its
peers are already waiting in. Each job ends a few steps after the event the test is about
(`--end-on caught_up:R`: the failed replica is back and holds the job's state), however
long the machine takes to get there; its step count is only a cap. Assertions are on what
the workers recorded per step. What two failures cost in loss is the trainer's logic, not
the processes': that job's replicas are threads of this process (threaded_job.py).
"""

from __future__ import annotations

import re

import pytest

from threaded_job import TinyGPT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CAP = ["--steps", "500"]  # a cap, never reached on a working machine: each job ends on its event


def commit_gap(records: list[dict]) -> float:
    """Seconds from the last commit before the first failed attempt to the next commit."""
    for i, r in enumerate(records):
        if not r["committed"]:
            before = [x for x in records[:i] if x["committed"]]
            after = [x for x in records[i:] if x["committed"]]
            assert before and after, "a failure must sit between commits"
            return after[0]["t"] - before[-1]["t"]
    raise AssertionError("this replica never saw a failed step")


@pytest.mark.compat
def test_sigkill_during_allreduce_survivors_go_on_and_replica_rejoins(transom_run):
    result = transom_run(["--replicas", "3", "--inject", "kill:replica=1,step=15", "--end-on", "caught_up:1"], CAP)
    result.assert_finished_together(3)
    s = result.summary
    assert s["failures_injected"] == 1 and s["replica_restarts"] >= 1
    assert s["healthy_stall_seconds"] <= 2.0
    for survivor in (0, 2):
        assert result.incarnations(survivor) == 1
        assert commit_gap(result.records(survivor)) <= 2.0
    # The killed replica came back and caught up from a peer instead of starting over.
    assert result.incarnations(1) == 2
    assert any(r["recovering"] and r["committed"] for r in result.records(1))
    # Ended by its owner, every replica holds the end step as trained: the example prints its digest.
    printed = re.findall(r"replica (\d) rank 0: final step (\d+) parameters ([0-9a-f]+)", result.output)
    assert sorted(r for r, _, _ in printed) == ["0", "1", "2"], result.output[-3000:]
    assert {(int(step), digest) for _, step, digest in printed} == {(result.end_step(), result.digests()[(0, 0)])}


def test_sigstop_survivors_continue_after_collective_timeout(transom_run):
    timeout = 2.0
    result = transom_run(
        ["--replicas", "3", "--collective-timeout", str(timeout), "--heartbeat-timeout", "2",
         "--inject", "stop:replica=1,step=15", "--end-on", "caught_up:1"],
        CAP,
    )
    result.assert_finished_together(3)
    for survivor in (0, 2):
        gap = commit_gap(result.records(survivor))
        # They really waited for the hung peer (a hang is only visible at the timeout) ...
        assert gap >= timeout * 0.8
        # ... and no longer than the timeout plus a step and the quorum change.
        assert gap <= timeout + 1.5
    # The run's stall is that wait and the restarted replica's rejoin, whose cost depends on
    # the machine's load (benchmarks/kill_recovery.py measures it): only the wait is bounded here.
    assert result.summary["healthy_stall_seconds"] >= timeout * 0.8
    assert result.incarnations(1) == 2  # the launcher killed the stopped worker and restarted it


def test_two_of_three_failed_with_min_replicas_two_pauses_then_resumes(threaded_job):
    # Pausing below minReplicas and resuming is the coordinator's logic: replicas as threads,
    # restarted once the coordinator paused (a restart quicker than the survivor's next
    # quorum request would leave nothing to pause for).
    gpt = TinyGPT()
    result = threaded_job(3, gpt.steps(500), gpt.build, min_replicas=2, restart_after="paused",
                          faults={1: ["raise:step=10"], 2: ["raise:step=10"]}, end_on=["caught_up:1", "caught_up:2"])
    result.assert_finished_together(3)
    kinds = [e.split(":")[0] for e in result.summary["events"]]
    assert "paused" in kinds and "resumed" in kinds
    assert kinds.index("paused") < kinds.index("resumed")
    # Alone, the survivor never committed a step: it waited until a replica came back.
    survivor = result.records(0)
    assert all(r["members"] >= 2 for r in survivor if r["committed"]), "trained below minReplicas"
    assert any(not r["committed"] for r in survivor), "the failures must have hit a step of the survivor's"


@pytest.mark.parametrize("inner", ["ddp", "ddp-slices", "fsdp"])
def test_two_process_replica_killed_is_restarted_whole(transom_run, monkeypatch, inner):
    # Under DDP: one group over every rank of both replicas (the default), or HSDP's slices.
    if inner == "ddp-slices":
        monkeypatch.setenv("TRANSOM_DDP_EXCHANGE", "slices")
        inner = "ddp"
    result = transom_run(
        ["--replicas", "2", "--nproc-per-replica", "2", "--inject", "kill:replica=0,step=5,rank=1",
         "--end-on", "caught_up:0"],
        [*CAP, "--inner", inner],
        timeout_s=280,
    )
    result.assert_finished_together(2)
    assert result.incarnations(0) == 2 and result.incarnations(1) == 1
    assert commit_gap(result.records(1)) <= 2.0
    assert any(r["recovering"] and r["committed"] for r in result.records(0))
    # The run names the SIGKILL, not rank 0's collective error that echoed it ("Connection
    # closed by peer", which came first), nor repeats the failure as a refusal.
    events = result.summary["events"]
    assert [e for e in events if e.startswith("failed: replica 0")] == \
        ["failed: replica 0: worker local rank 1 killed by SIGKILL"], events
    assert not [e for e in events if "by peer" in e or e.startswith("refused")], events


def samples_seen(records: list[dict]) -> list[int]:
    """Replica-batches that went into the model after each committed step (its participants)."""
    total, out = 0, []
    for r in records:
        if r["committed"]:
            total += r["participants"]
            out.append(total)
    return out


def test_loss_after_two_failures_matches_failure_free_run_on_the_same_samples(threaded_job):
    # A failed replica contributes no batches until it has rejoined, and how long that takes
    # depends on the machine's load. So the job with failures is compared with a failure-free
    # job of as many steps at the point where that one had used as many replica-batches: the
    # failures must cost the batches the missing replicas did not train on, and nothing more.
    # What it checks is the trainer's logic: the replicas are threads, and fail by an exception.
    gpt = TinyGPT(dim=64, layers=2)
    faulty = threaded_job(3, gpt.steps(500), gpt.build, faults={1: ["raise:step=10"], 2: ["raise:step=30"]},
                          end_on=["caught_up:1", "caught_up:2"])
    faulty.assert_finished_together(3)
    assert faulty.summary["failures_injected"] == 2
    steps = faulty.end_step()
    clean = threaded_job(3, gpt.steps(steps), gpt.build)
    clean.assert_finished_together(3)
    used = samples_seen(faulty.records(0))[-1]  # replica 0 never failed: it saw every step
    assert used < 3 * steps, "the failed replicas must have missed some steps"
    clean_records = [r for r in clean.records(0) if r["committed"]]
    matched = next(i for i, n in enumerate(samples_seen(clean_records)) if n >= used)
    window = clean_records[max(0, matched - 9):matched + 1]  # ten steps, like `final_loss`
    reference = sum(r["loss"] for r in window) / len(window)
    hurt, start = faulty.summary["final_loss"], clean_records[0]["loss"]
    assert hurt <= reference * 1.05, (hurt, reference, used)
    # ... and the job trained: far below where it started.
    assert hurt <= start * 0.8, (hurt, reference, start, used)


def closes_in_finally(steps: int):
    """The example's loop: the trainer is closed in a `finally:`, whatever ends the loop."""
    tg = TinyGPT()

    def body(replica, trainer, model):
        try:
            return tg.steps(steps)(replica, trainer, model)
        finally:
            trainer.close()  # completes the job after the last step; before it, reports a failure

    return tg, body


def test_an_exception_restarts_the_replica_even_when_the_script_closes_in_finally(threaded_job):
    # A replica that raises must count as failed and be restarted; closing must not end the
    # whole job as if it were complete. The trainer's and the coordinator's logic: threads.
    gpt, body = closes_in_finally(500)
    result = threaded_job(2, body, gpt.build, faults={1: ["raise:step=5"]}, end_on=["caught_up:1"])
    result.assert_finished_together(2)
    assert result.incarnations(1) == 2 and result.incarnations(0) == 1
    assert "injected fault at step 5" in result.output
    assert "replica 1 closed at step 5, before the target 500" in result.output
    assert commit_gap(result.records(0)) <= 2.0
