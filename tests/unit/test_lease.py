"""Quorum leases (coordinator/lease.py): a quiet round answers for the steps after it.

Table tests over `Membership` with explicit timestamps: which rounds grant a lease and how
long it is, what ends one (a failed step, a joiner, values set aside, a catching-up member,
the owner's finish), what a replica may claim under one, and `holds_until` itself.
"""

from __future__ import annotations

import pytest

from membership_world import make, next_round, qreq, register, round_all, started
from transom.coordinator import job_end, lease
from transom.coordinator.models import FailureReport, HeartbeatRequest, QuorumRequest

STEP_S = 0.125  # the job's time a step in these tables: a 1 s lease is 8 steps


def quiet_rounds(num: int = 2, **kw):
    """A job of `num` replicas through its first rounds, one step every STEP_S: the second
    round after the first is the first that knows the job's time a step."""
    m, d = started(num, **{"quorum_lease_s": 1.0, **kw})
    d = next_round(m, d, range(num), STEP_S, 1)
    return m, next_round(m, d, range(num), 2 * STEP_S, 2)


# --- holds_until -----------------------------------------------------------------------------
@pytest.mark.parametrize("lease_s, step_s, quiet, end_step, expected", [
    (1.0, 0.125, True, None, 18),  # 8 steps past 10
    (1.0, 0.125, False, None, None),  # a round with news
    (0.0, 0.125, True, None, None),  # leases off
    (1.0, None, True, None, None),  # the job's time a step is not known yet
    (1.0, 0.6, True, None, None),  # one step: not worth the wait it adds
    (1.0, 0.0, True, None, 10 + lease.MAX_LEASE_STEPS),  # steps too fast to time
    (1.0, 0.125, True, 15, 14),  # the round at the owner's end step must be asked for
    (1.0, 0.125, True, 12, None),  # ... which leaves one step: no lease
])
def test_holds_until(lease_s, step_s, quiet, end_step, expected):
    assert lease.holds_until(lease_s, step_s, 10, quiet, end_step) == expected


# --- which rounds grant one ------------------------------------------------------------------
def test_a_quiet_round_grants_a_lease_of_about_a_second_of_steps():
    m, d = quiet_rounds()
    assert d.holds_until == 2 + 8
    assert m.response(d, 0).holds_until == m.response(d, 1).holds_until == 10
    # The members ask again for step 11: the round knows the leased steps took STEP_S each.
    d2 = next_round(m, d, [0, 1], 2 * STEP_S + 9 * STEP_S, 11)
    assert d2.quorum_id == d.quorum_id and d2.holds_until == 11 + 8
    assert m.round_seconds[-1] == pytest.approx(STEP_S)


def test_the_first_rounds_and_a_changed_membership_grant_none():
    m, d0 = started(3, quorum_lease_s=1.0)
    assert d0.holds_until is None  # the first round: no last round to compare with
    d1 = next_round(m, d0, [0, 1, 2], STEP_S, 1)
    assert d1.holds_until is None  # the job's time a step is not known yet
    m.report_failure(FailureReport(identity=m.replicas[2].identity, reason="killed"), 2 * STEP_S)
    d2 = next_round(m, d1, [0, 1], 2 * STEP_S, 2)
    assert d2.quorum_id != d1.quorum_id and d2.holds_until is None
    assert next_round(m, d2, [0, 1], 3 * STEP_S, 3).holds_until == 3 + 8


def test_no_lease_after_a_failed_step_until_a_quiet_round():
    m, d = quiet_rounds()
    failed = next_round(m, d, [0, 1], 3 * STEP_S, 3, failed={0, 1})
    assert failed.quorum_id != d.quorum_id and failed.holds_until is None
    again = next_round(m, failed, [0, 1], 4 * STEP_S, 4)
    assert again.holds_until is not None


def test_values_set_aside_or_a_member_catching_up_grant_none():
    m, d = quiet_rounds()
    asks = [qreq(0, step=3, commit=d.quorum_id, last_round=d.round),
            qreq(1, step=3, commit=d.quorum_id, last_round=d.round).model_copy(update={"shared": {"/best": 1.5}})]
    with_values = round_all(m, asks, 3 * STEP_S)
    assert with_values.shared == {"/best": 1.5} and with_values.holds_until is None
    asks = [qreq(0, step=4, commit=d.quorum_id, last_round=with_values.round),
            qreq(1, step=4, commit=d.quorum_id, last_round=with_values.round).model_copy(
                update={"catching_up_from": 2})]
    catching_up = round_all(m, asks, 4 * STEP_S)
    assert catching_up.recovering == (1,) and catching_up.holds_until is None


def test_a_healthy_replica_outside_the_quorum_ends_leases_until_it_is_in():
    m = make(3, min_replicas=2, startup_wait_s=0.0, quorum_lease_s=1.0)
    for rid in (0, 1):
        register(m, rid)
    d = round_all(m, [qreq(0), qreq(1)], 0.0)
    d = next_round(m, d, [0, 1], STEP_S, 1)
    d = next_round(m, d, [0, 1], 2 * STEP_S, 2)
    assert d.holds_until == 10
    register(m, 2, now=3 * STEP_S)  # a replacement starts during the lease
    assert m.request_quorum(qreq(2), 3 * STEP_S) is None  # it waits for the members' next round
    d = next_round(m, d, [0, 1], 11 * STEP_S, 11)
    assert d.member_ids() == [0, 1, 2] and d.recovering == (2,) and d.holds_until is None


def test_the_owners_finish_is_the_end_of_a_lease():
    m, d = quiet_rounds()
    assert job_end.finish(m, 5, 3 * STEP_S) == 11  # the members may be training leased steps up to 10
    d2 = next_round(m, d, [0, 1], 11 * STEP_S, 11)
    assert d2.ends_job and d2.holds_until is None


def test_leases_on_by_default_and_off_at_zero():
    m, d = quiet_rounds(quorum_lease_s=0.0)
    assert d.holds_until is None
    m, d = started(2)
    for step in range(1, 4):
        d = next_round(m, d, [0, 1], step * STEP_S, step)
    assert d.holds_until is not None  # QUORUM_LEASE_S, 1 s: many steps
    with pytest.raises(ValueError):
        make(2, quorum_lease_s=lease.MAX_LEASE_S + 1)


# --- what a replica may claim under one -------------------------------------------------------
def test_a_member_may_claim_one_step_past_its_lease_and_no_more():
    m, d = quiet_rounds()
    rep = m.replicas[0]
    m.heartbeat(HeartbeatRequest(identity=rep.identity, step=11), 3 * STEP_S)
    assert rep.step == 11 and m.status(3 * STEP_S).max_step == 11
    with pytest.raises(ValueError, match="lease of round"):
        m.heartbeat(HeartbeatRequest(identity=rep.identity, step=12), 3 * STEP_S)
    with pytest.raises(ValueError):
        m.request_quorum(QuorumRequest(identity=rep.identity, step=12, commit_quorum_id=d.quorum_id,
                                       last_round=d.round), 3 * STEP_S)
