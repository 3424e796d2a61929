"""What the coordinator accepts from a replica about its progress (`Membership`): retried
requests get the same answer, only a `completed` leave ends the job, and no call can claim
a step that the replica cannot have committed in the rounds it took part in.
"""

from __future__ import annotations

import pytest

from membership_world import ident, make, next_round, qreq, register, round_all, started
from transom.coordinator import job_end
from transom.coordinator.models import CheckpointReport, HeartbeatRequest, LeaveRequest
from transom.errors import Evicted, JobCompleted


# --- retries, completion ---------------------------------------------------------------------------------------
def test_answer_for_is_idempotent_for_retries():
    m, d0 = started(3)
    for rid in range(3):
        retry = qreq(rid)  # the response was lost; the replica asks again with last_round -1
        assert m.answer_for(retry) is d0
        assert m.request_quorum(retry, 1.0) is d0
        assert m.request_quorum(retry, 2.0) is d0
    assert not m.pending and m.next_round == 1
    assert m.request_quorum(qreq(0, 1, 0, last_round=d0.round), 3.0) is None  # a new round
    assert m.answer_for(qreq(0, 1, 0, last_round=d0.round)) is None and list(m.pending) == [0]


@pytest.mark.parametrize("completed", [True, False])
def test_leave_completed_ends_the_job_for_others(completed):
    m, d0 = started(2)
    m.leave(LeaveRequest(identity=ident(0), step=1, completed=completed, reason="done"), 1.0)
    assert m.replicas[0].state == "left" and m.replicas.healthy_count() == 1
    assert m.answer_for(qreq(1)) is d0  # a retry of an answered round still gets its answer
    nxt = qreq(1, 1, 0, d0.round)
    assert m.replica_state(ident(1)).job_completed is completed
    assert m.replica_state(ident(0, att=5)).job_completed is completed  # for any incarnation
    if completed:
        assert m.completed_step == 1 and m.training(2.0)["completedStep"] == 1
        with pytest.raises(JobCompleted, match="1"):
            m.request_quorum(nxt, 2.0)
        assert not m.pending
    else:
        assert m.completed_step is None and "completedStep" not in m.training(2.0)
        d1 = m.request_quorum(nxt, 2.0)
        assert d1 is not None and d1.member_ids() == [1]
    with pytest.raises(Evicted):
        m.heartbeat(HeartbeatRequest(identity=ident(0), step=1), 2.0)


def test_a_reason_is_not_a_completion():
    # Only the `completed` flag ends the job: a replica that leaves "completed" in words does not.
    m, _ = started(2)
    m.leave(LeaveRequest(identity=ident(0), step=1, reason="completed"), 1.0)
    assert m.completed_step is None and not m.replica_state(ident(1)).job_completed


def test_the_owner_ends_the_job_at_a_step_and_the_round_that_reaches_it_says_so():
    m, d0 = started(2)
    assert not d0.ends_job
    assert job_end.finish(m, 2, 1.0) == 2
    assert m.events[-1].kind == "finishing" and "step 2" in m.events[-1].message
    d1 = round_all(m, [qreq(rid, 1, d0.quorum_id, d0.round) for rid in range(2)], 2.0)
    assert d1.max_step == 1 and not d1.ends_job
    d2 = round_all(m, [qreq(rid, 2, d1.quorum_id, d1.round) for rid in range(2)], 3.0)
    assert d2.max_step == 2 and d2.ends_job and m.response(d2, 1).ends_job
    # Each member completes the job where it is; nothing more is decided.
    m.leave(LeaveRequest(identity=ident(0), step=2, completed=True), 4.0)
    assert m.completed_step == 2
    with pytest.raises(JobCompleted):
        job_end.finish(m, 5, 5.0)


def test_a_job_past_the_step_asked_for_ends_at_the_earliest_step_it_still_can():
    # Round d1 answered step 1: its members may already have committed step 2, so no round
    # before the one at step 2 can end the job.
    m, d0 = started(2)
    d1 = round_all(m, [qreq(rid, 1, d0.quorum_id, d0.round) for rid in range(2)], 1.0)
    assert job_end.finish(m, 0, 2.0) == 2 == d1.max_step + 1
    d2 = round_all(m, [qreq(rid, 2, d1.quorum_id, d1.round) for rid in range(2)], 3.0)
    assert d2.ends_job


# --- impossible progress -------------------------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda m, d: m.heartbeat(HeartbeatRequest(identity=ident(1), step=10**6), 1.0),
    lambda m, d: m.request_quorum(qreq(1, 10**6, d.quorum_id, d.round), 1.0),
    lambda m, d: m.leave(LeaveRequest(identity=ident(1), step=3, completed=True), 1.0),
    lambda m, d: m.record_checkpoint(CheckpointReport(identity=ident(1), step=2, uri="s3://b/x"), 0.0, 1.0),
], ids=["heartbeat", "quorum", "leave", "checkpoint"])
def test_steps_that_cannot_have_been_committed_are_refused(call):
    m, d0 = started(3)  # round 0 at step 0: nobody can hold more than one committed step
    with pytest.raises(ValueError, match="can hold at most 1 committed steps"):
        call(m, d0)
    assert m.replicas.max_step() == 0 and m.completed_step is None and m.last_checkpoint is None
    assert m.replicas[1].state == "healthy"  # refused, not punished


def test_progress_is_bounded_by_the_rounds_a_replica_was_in():
    m, d0 = started(2)
    d1 = next_round(m, d0, [0, 1], 1.0, 1)
    m.heartbeat(HeartbeatRequest(identity=ident(0), step=2), 1.5)  # committed under d1: fine
    assert m.replicas.max_step() == 2
    # A newer incarnation was in no round: it holds at most what some replica committed (2),
    # and then only what it registered with.
    with pytest.raises(ValueError, match="registration"):
        register(m, 1, 2.0, att=1, step=3)
    register(m, 1, 2.0, att=1, step=2)  # e.g. restored from a checkpoint
    with pytest.raises(ValueError):
        m.request_quorum(qreq(1, 3, att=1), 2.0)
    assert m.request_quorum(qreq(1, 2, att=1), 2.0) is None
    d2 = m.request_quorum(qreq(0, 2, d1.quorum_id, d1.round), 2.0)
    assert d2 is not None and d2.max_step == 2


def test_before_the_first_round_a_replica_claims_only_what_it_registered_with():
    # A restarted coordinator knows nothing yet: the first round gathers replicas where they
    # are, and what each registered with is all it can hold until a round answers it.
    m = make(2)
    register(m, 0, step=500)
    m.heartbeat(HeartbeatRequest(identity=ident(0), step=500), 0.5)
    assert m.request_quorum(qreq(0, 500, 17), 1.0) is None


@pytest.mark.parametrize("call", [
    lambda m: m.heartbeat(HeartbeatRequest(identity=ident(0), step=10**6), 1.0),
    lambda m: m.record_checkpoint(CheckpointReport(identity=ident(0), step=10**6, uri="s3://b/x"), 0.0, 1.0),
    lambda m: m.leave(LeaveRequest(identity=ident(0), step=10**6, completed=True), 1.0),
    lambda m: m.request_quorum(qreq(0, 10**6), 1.0),
], ids=["heartbeat", "checkpoint", "leave", "quorum"])
def test_before_the_first_round_claims_past_the_registration_are_refused(call):
    m = make(2)
    register(m, 0, step=10)
    with pytest.raises(ValueError, match="registered with"):
        call(m)
    assert m.replicas.max_step() == 10 and m.completed_step is None and m.last_checkpoint is None


def test_only_a_replica_a_round_answered_can_complete_the_job():
    m = make(2)
    register(m, 0, step=10)
    with pytest.raises(ValueError, match="no round has answered it"):
        m.leave(LeaveRequest(identity=ident(0), step=10, completed=True), 1.0)
    assert m.completed_step is None and m.replicas[0].state == "healthy"
    register(m, 1, step=10)
    d = m.request_quorum(qreq(0, 10), 2.0) or m.request_quorum(qreq(1, 10), 2.0)
    assert d is not None and d.max_step == 10  # a job restored at its target takes one round ...
    m.leave(LeaveRequest(identity=ident(0), step=10, completed=True), 3.0)  # ... and then completes
    assert m.completed_step == 10


def test_a_restarted_coordinator_writes_no_step_until_it_decided_a_round():
    """A new coordinator knows no replica until they register again: status.training.step
    must not fall to 0 (or to the first registrant's step) over the job's committed step."""
    m = make(2)
    assert "step" not in m.training(0.0)
    register(m, 0, 0.0, step=47)
    assert "step" not in m.training(0.1)
    register(m, 1, 0.2, step=47)
    m.request_quorum(qreq(0, 47), 0.3)
    d = m.request_quorum(qreq(1, 47), 0.3)
    assert d is not None and m.training(0.4)["step"] == 47
