"""The coordinator's membership with a replica that steps aside (`trainer.aside()`, POST
/v1/aside): the rounds go on without it, it is not taken for hung, and it comes back behind
to catch up; unless it alone holds the state, which the rounds then wait for."""

from __future__ import annotations

from membership_world import heartbeat_all, ident, qreq, started
from transom.coordinator.models import AsideRequest


def test_a_member_aside_is_not_waited_for_nor_taken_for_hung_and_returns_behind():
    m, d0 = started(3, round_timeout_s=30.0)
    m.step_aside(AsideRequest(identity=ident(2), step=0), 0.5)  # an evaluation between steps
    m.request_quorum(qreq(0, 1, 0, 0), 1.0)
    d1 = m.request_quorum(qreq(1, 1, 0, 0), 1.0)
    assert d1 is not None and d1.member_ids() == [0, 1]  # decided at once, without replica 2
    for t in range(2, 100):  # long past round_timeout_s: still a member, still healthy
        heartbeat_all(m, [0, 1, 2], float(t))
    assert m.replicas[2].state == "healthy"
    assert m.request_quorum(qreq(2, 1, 0, 0), 100.0) is None  # back, one step behind: it catches up
    m.request_quorum(qreq(0, 2, d1.quorum_id, d1.round), 100.0)
    d3 = m.request_quorum(qreq(1, 2, d1.quorum_id, d1.round), 100.0)
    assert d3 is not None and d3.member_ids() == [0, 1, 2] and d3.recovering == (2,)
    assert not m.replicas[2].aside


def test_a_round_waits_for_the_only_holders_of_the_state_even_aside():
    m, d0 = started(2, round_timeout_s=30.0)
    m.request_quorum(qreq(0, 1, 0, 0), 1.0)
    d1 = m.request_quorum(qreq(1, 0, -1, 0), 1.0)  # replica 1 is behind: it catches up from 0
    assert d1 is not None and d1.recovering == (1,)
    m.step_aside(AsideRequest(identity=ident(0), step=2), 2.0)
    m.request_quorum(qreq(1, 2, d1.quorum_id, d1.round), 2.0)
    heartbeat_all(m, [0, 1], 60.0)
    assert m.try_decide(60.0) is None  # training on without replica 0 would lose the job's state
    assert m.replicas[0].state == "healthy"


def test_a_member_back_from_aside_gets_a_new_quorum_even_with_the_same_members():
    # Aside, a replica leaves its group (its peers under a lease fail their collective at
    # once); built again on the same store prefix, the group would meet stale keys and hang.
    m, d0 = started(2, min_replicas=2, round_timeout_s=30.0)
    m.step_aside(AsideRequest(identity=ident(0), step=0), 0.5)
    assert m.request_quorum(qreq(1, 0, d0.quorum_id, d0.round), 1.0) is None  # paused: below minReplicas
    m.request_quorum(qreq(0, 0, d0.quorum_id, d0.round), 2.0)  # back, at the same step
    d1 = m.answer_for(qreq(1, 0, d0.quorum_id, d0.round))
    assert d1 is not None and d1.member_ids() == [0, 1] and d1.recovering == ()
    assert d1.quorum_id > d0.quorum_id and d1.store_prefix != d0.store_prefix
    # The next round of the same members keeps it.
    m.request_quorum(qreq(0, 1, d1.quorum_id, d1.round), 3.0)
    d2 = m.request_quorum(qreq(1, 1, d1.quorum_id, d1.round), 3.0)
    assert d2 is not None and d2.quorum_id == d1.quorum_id
