"""Table tests of the coordinator's quorum logic (`transom.coordinator.membership`).

`Membership` does no I/O and takes the time as an argument, so every scenario here drives
it with explicit timestamps, never sleeps, and asserts on the decisions it hands out:

* the first quorum waits for every replica (or `startup_wait_s`), later rounds keep the
  quorum id while membership is unchanged and nothing failed, and change it otherwise;
* who is waited for: dead members (reported, heartbeat expired) never, absent healthy ones
  forever unless a step failed, then only `failed_grace_s`;
* recovery: members behind the newest committed state (lower step, or same step under an
  older quorum) recover from a canonical member and do not count as participants;
* `min_replicas` pausing and resuming, incarnation conflicts, unknown replicas,
  unique store prefixes, per-replica responses and `Settings` validation (retries,
  completion and bounded progress claims: test_membership_progress.py).
"""

from __future__ import annotations

import pytest

from membership_world import heartbeat_all, ident, make, next_round, qreq, register, round_all, started
from transom.coordinator import rounds
from transom.coordinator.membership import Membership, Settings
from transom.coordinator.models import FailureReport, HeartbeatRequest, LeaveRequest, QuorumRequest
from transom.errors import Evicted, NotRegistered


def failed_grace(m: Membership, ready, missing: list[int]) -> float:
    """How long the open round waits for the absent `missing` after a failed step (rounds.py)."""
    assert m.current is not None
    return rounds.failed_grace_s(m.settings, m.current, m.replicas, m.round_seconds, ready, missing)


# --- Settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_replicas=0),
        dict(num_replicas=-1),
        dict(num_replicas=2, min_replicas=0),
        dict(num_replicas=2, min_replicas=3),
        dict(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.0),
        dict(heartbeat_interval_s=2.0, heartbeat_timeout_s=1.0),
        dict(heartbeat_interval_s=0.0, heartbeat_timeout_s=1.0),
        dict(heartbeat_interval_s=-1.0, heartbeat_timeout_s=1.0),
        dict(failed_grace_s=-0.1),
        dict(startup_wait_s=-1.0),
    ],
)
def test_settings_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        Settings(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(num_replicas=4, min_replicas=4), dict(failed_grace_s=0.0, startup_wait_s=0.0),
     dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)],
)
def test_settings_accept_good_values(kwargs):
    s = Settings(**kwargs)
    for k, v in kwargs.items():
        assert getattr(s, k) == v


# --- first quorum ------------------------------------------------------------------------------
def test_first_quorum_waits_for_all_replicas():
    m = make(3, startup_wait_s=60.0)
    for rid in range(3):
        register(m, rid)
    assert m.request_quorum(qreq(0), 0.0) is None
    assert m.request_quorum(qreq(1), 1.0) is None
    assert m.try_decide(2.0) is None
    d = m.request_quorum(qreq(2), 2.0)
    assert d is not None
    assert (d.round, d.quorum_id, d.member_ids(), d.max_step) == (0, 0, [0, 1, 2], 0)
    assert d.participants == 3 and d.recovering == () and d.snapshot_from is None
    # The earlier askers see the same decision when they look (long-poll wake-up).
    assert m.answer_for(qreq(0)) is d and m.answer_for(qreq(1)) is d


@pytest.mark.parametrize(
    "num,min_replicas,ready,now,expected",
    [
        (3, 1, [0, 1], 59.9, None),  # still inside startup_wait_s
        (3, 1, [0, 1], 60.0, [0, 1]),  # startup wait over: start with who is there
        (3, 2, [0, 1], 60.0, [0, 1]),
        (3, 2, [0], 61.0, None),  # startup over, but fewer than min_replicas
        (3, 3, [0, 1], 500.0, None),
        (2, 1, [1], 60.0, [1]),
    ],
)
def test_first_quorum_after_startup_wait(num, min_replicas, ready, now, expected):
    m = make(num, min_replicas, startup_wait_s=60.0, heartbeat_timeout_s=3600.0)
    for rid in range(num):
        register(m, rid)
    for rid in ready:
        assert m.request_quorum(qreq(rid), 0.0) is None
    d = m.try_decide(now)
    if expected is None:
        assert d is None and m.current is None
        assert m.paused == (len(ready) < min_replicas and now >= 60.0)
    else:
        assert d is not None and d.member_ids() == expected and d.quorum_id == 0
        assert not m.paused


# --- quorum id -----------------------------------------------------------------------------------
def test_same_membership_keeps_quorum_id_while_round_advances():
    m, d0 = started(3)
    decisions = [d0]
    for step in range(1, 6):
        decisions.append(next_round(m, decisions[-1], [0, 1, 2], float(step), step))
    assert [d.round for d in decisions] == [0, 1, 2, 3, 4, 5]
    assert {d.quorum_id for d in decisions} == {0}
    assert {d.store_prefix for d in decisions} == {d0.store_prefix}
    assert {d.store_addr for d in decisions} == {d0.store_addr}
    assert decisions[-1].max_step == 5 and decisions[-1].participants == 3
    assert m.quorum_changes_total == 1


def test_failed_request_forces_new_quorum_id():
    m, d0 = started(3)
    d1 = next_round(m, d0, [0, 1, 2], 1.0, 1, failed={1})
    assert d1.member_ids() == [0, 1, 2]
    assert d1.quorum_id == d0.quorum_id + 1
    assert d1.store_prefix != d0.store_prefix
    # The next clean round keeps the new id.
    d2 = next_round(m, d1, [0, 1, 2], 2.0, 2)
    assert d2.quorum_id == d1.quorum_id and d2.round == d1.round + 1


def test_quorum_ids_strictly_increase_and_prefixes_are_never_reused():
    m, d = started(3, heartbeat_timeout_s=3600.0)
    decisions = [d]
    t = 0.0

    def go(ids, failed=()):
        nonlocal t
        t += 1.0
        decisions.append(next_round(m, decisions[-1], ids, t, len(decisions), failed))

    go([0, 1, 2])
    go([0, 1, 2], failed={0})  # failed step: rebuild
    m.report_failure(FailureReport(identity=ident(2), reason="oom"), t)
    go([0, 1])  # membership shrinks
    go([0, 1])
    register(m, 2, t, gen=1)
    prev = decisions[-1]
    t += 1
    decisions.append(round_all(
        m, [qreq(2, gen=1), qreq(0, 5, prev.quorum_id, prev.round), qreq(1, 5, prev.quorum_id, prev.round)], t
    ))  # membership grows: the replacement asked first, so it is in this round
    go([0, 1, 2], failed={2})
    go([0, 1, 2])
    for _ in range(2):  # a step that keeps failing is retried at the same step, each time regrouped
        t += 1
        decisions.append(next_round(m, decisions[-1], [0, 1, 2], t, decisions[-1].max_step, failed={0, 1, 2}))
    assert decisions[-1].max_step == decisions[-2].max_step
    changes = [b.quorum_id for a, b in zip(decisions, decisions[1:]) if b.quorum_id != a.quorum_id]
    ids = [d.quorum_id for d in decisions]
    assert ids == sorted(ids)
    assert changes == sorted(set(changes)) and len(changes) == 6
    by_prefix = {}
    for dec in decisions:
        assert by_prefix.setdefault(dec.store_prefix, dec.quorum_id) == dec.quorum_id
    assert len(by_prefix) == len(set(ids)) == m.quorum_changes_total
    assert all(p.startswith(f"transom/t/{m.epoch}/q") for p in by_prefix)
    # A restarted coordinator counts quorum ids from 0 again; its prefixes still differ.
    assert make(3).epoch != m.epoch


# --- who is waited for -------------------------------------------------------------------------------
def test_reported_failed_member_is_not_waited_for():
    m, d0 = started(3)
    assert m.report_failure(FailureReport(identity=ident(2), reason="segfault", exit_code=-11), 0.5)
    assert not m.report_failure(FailureReport(identity=ident(2), reason="again"), 0.6)  # idempotent
    assert m.request_quorum(qreq(0, 1, 0, 0), 1.0) is None
    d1 = m.request_quorum(qreq(1, 1, 0, 0), 1.0)
    assert d1 is not None and d1.member_ids() == [0, 1]
    assert d1.quorum_id == d0.quorum_id + 1
    assert m.failures_total["reported"] == 1
    assert m.replicas[2].state == "failed" and "exit code -11" in m.replicas[2].last_failure
    with pytest.raises(Evicted):
        m.request_quorum(qreq(2, 1, 0, 0), 1.0)


def test_absent_member_is_declared_hung_after_round_timeout():
    m, d0 = started(3, round_timeout_s=30.0)
    m.request_quorum(qreq(0, 1, 0, 0), 1.0)
    m.request_quorum(qreq(1, 1, 0, 0), 1.0)
    heartbeat_all(m, [0, 1, 2], 30.9)
    assert m.try_decide(30.9) is None  # 29.9 s: still a slow step
    heartbeat_all(m, [0, 1, 2], 31.0)
    d1 = m.try_decide(31.0)
    assert d1 is not None and d1.member_ids() == [0, 1]
    assert m.replicas[2].state == "failed" and "30s" in m.replicas[2].last_failure


def test_absent_member_without_failure_is_waited_for_a_long_time():
    m, d0 = started(3)
    m.request_quorum(qreq(0, 1, 0, 0), 1.0)
    m.request_quorum(qreq(1, 1, 0, 0), 1.0)
    for t in range(2, 101):  # everyone heartbeats; replica 2 just never asks
        heartbeat_all(m, [0, 1, 2], float(t))
        assert m.try_decide(float(t)) is None
    assert m.current is d0 and sorted(m.pending) == [0, 1]
    assert m.answer_for(qreq(0, 1, 0, 0)) is None
    d1 = m.request_quorum(qreq(2, 1, 0, 0), 100.5)
    assert d1 is not None and d1.member_ids() == [0, 1, 2] and d1.quorum_id == d0.quorum_id


@pytest.mark.parametrize(
    "grace,decide_at,expected",
    [
        (0.5, 10.0, None),
        (0.5, 10.49, None),
        (0.5, 10.5, [0, 1]),
        (0.5, 12.0, [0, 1]),
        (2.0, 11.9, None),
        (2.0, 12.0, [0, 1]),
    ],
)
def test_failed_step_leaves_absent_member_behind_after_grace(grace, decide_at, expected):
    m, d0 = started(3, failed_grace_s=grace)
    heartbeat_all(m, [0, 1, 2], 10.0)  # replica 2 is alive (heartbeats) but hung
    first = m.request_quorum(qreq(0, 0, 0, 0, failed=True), 10.0)
    second = m.request_quorum(qreq(1, 0, 0, 0, failed=True), 10.0)
    d = first or second or m.try_decide(decide_at)
    if expected is None:
        assert d is None and m.current is d0
    else:
        assert d is not None and d.member_ids() == expected
        assert d.quorum_id == d0.quorum_id + 1
        # Left behind while heartbeating means hung: declared failed so it gets restarted.
        assert m.replicas[2].state == "failed" and "failed step" in m.replicas[2].last_failure
        assert m.failures_total["hung"] == 1


def test_member_left_behind_is_restarted_and_rejoins_and_recovers():
    m, d0 = started(3, failed_grace_s=0.5)
    assert m.request_quorum(qreq(0, 0, 0, 0, failed=True), 1.0) is None
    assert m.request_quorum(qreq(1, 0, 0, 0, failed=True), 1.0) is None
    d1 = m.try_decide(1.5)
    assert d1 is not None and d1.member_ids() == [0, 1]
    # The straggler was declared hung: the old incarnation is refused ...
    with pytest.raises(Evicted):
        m.request_quorum(qreq(2, 0, d0.quorum_id, d0.round), 2.0)
    # ... its launcher restarts it as a new attempt, which joins the next round at step 0
    # while 0 and 1 committed step 1 under quorum 1.
    register(m, 2, 2.0, att=1)
    assert m.request_quorum(qreq(2, 0, -1, -1, att=1), 2.0) is None
    m.request_quorum(qreq(0, 1, d1.quorum_id, d1.round), 2.0)
    d2 = m.request_quorum(qreq(1, 1, d1.quorum_id, d1.round), 2.0)
    assert d2 is not None and d2.member_ids() == [0, 1, 2]
    assert d2.quorum_id == d1.quorum_id + 1
    assert d2.recovering == (2,) and d2.participants == 2 and d2.max_step == 1


@pytest.mark.parametrize("decide_at,expected", [(11.0, None), (15.9, None), (16.0, [0, 1])])
def test_the_failed_grace_stretches_to_three_of_the_jobs_rounds(decide_at, expected):
    """Rounds of 2 s: a member still computing meets the failed exchange up to a step later,
    so the 0.5 s grace becomes 3 rounds (6 s) before it is declared hung."""
    m, d = started(3, failed_grace_s=0.5, heartbeat_timeout_s=3600.0)
    for step in range(1, 5):
        d = next_round(m, d, [0, 1, 2], 2.0 * step, step)
    assert m.request_quorum(qreq(0, 4, d.quorum_id, d.round, failed=True), 10.0) is None
    assert m.request_quorum(qreq(1, 4, d.quorum_id, d.round, failed=True), 10.0) is None
    assert failed_grace(m, m.pending, [2]) == 6.0
    decided = m.try_decide(decide_at)
    if expected is None:
        assert decided is None and m.replicas[2].state == "healthy"
    else:
        assert decided is not None and decided.member_ids() == expected
        assert "did not return within 6s of a failed step" in m.replicas[2].last_failure


def test_the_only_holder_of_the_state_is_not_cut_by_the_failed_grace():
    """0 died serving the joiner 2, and 1 (the other holder) is slow to return: 2 alone cannot
    train, so 1 is waited for up to round_timeout_s, not failed_grace_s (cutting it would
    restart the job from nothing)."""
    m, d = started(3, failed_grace_s=0.5, round_timeout_s=30.0, heartbeat_timeout_s=3600.0)
    d = next_round(m, d, [0, 1, 2], 1.0, 1)
    reqs = [qreq(rid, 1, d.quorum_id, d.round).model_copy(update={"catching_up_from": 1 if rid == 2 else None})
            for rid in (0, 1, 2)]
    d = round_all(m, reqs, 2.0)
    assert d.recovering == (2,) and d.sources == (0, 1)
    m.report_failure(FailureReport(identity=ident(0), reason="killed"), 2.5)
    joiner = qreq(2, 1, d.quorum_id, d.round, failed=True).model_copy(update={"catching_up_from": 1})
    assert m.request_quorum(joiner, 3.0) is None
    assert failed_grace(m, {2: joiner}, [1]) == 30.0
    # 0 restarts at once and asks at step 0: its new incarnation holds nothing either (CI saw it).
    register(m, 0, 3.2, att=1)
    assert m.request_quorum(qreq(0, 0, att=1), 3.2) is None
    assert failed_grace(m, m.pending, [1]) == 30.0
    assert m.try_decide(20.0) is None and m.replicas[1].state == "healthy"
    late = m.request_quorum(qreq(1, 1, d.quorum_id, d.round, failed=True), 20.0)
    assert late is not None and late.member_ids() == [0, 1, 2] and late.sources == (1,)
    assert late.recovering == (0, 2) and late.max_step == 1


def test_a_joiner_that_committed_a_step_no_holder_did_restarts_alone():
    """0 died inside step 2's exchange, which completed on the joiner 2 only: 2 recorded an
    update of step 2 that the holder 1 never applied. 2 restarts and catches up again; 1 goes
    on (before, neither could be a source and both were told to restart)."""
    m, d = started(3, heartbeat_timeout_s=3600.0)
    d = next_round(m, d, [0, 1, 2], 1.0, 1)
    reqs = [qreq(rid, 1, d.quorum_id, d.round).model_copy(update={"catching_up_from": 1 if rid == 2 else None})
            for rid in (0, 1, 2)]
    d = round_all(m, reqs, 2.0)
    m.report_failure(FailureReport(identity=ident(0), reason="killed"), 2.5)
    joiner = qreq(2, 2, d.quorum_id, d.round).model_copy(update={"catching_up_from": 1})
    assert m.request_quorum(joiner, 3.0) is None
    d = m.request_quorum(qreq(1, 1, d.quorum_id, d.round, failed=True), 3.1)
    assert d is not None and d.member_ids() == [1] and d.recovering == () and d.max_step == 1
    assert m.replicas[2].state == "failed" and m.failures_total["diverged"] == 1
    assert "no replica holding the state did (at step 1)" in m.replicas[2].last_failure
    register(m, 2, 4.0, att=1)
    assert m.request_quorum(qreq(2, 0, att=1), 4.0) is None
    d = m.request_quorum(qreq(1, 2, d.quorum_id, d.round), 4.1)
    assert d is not None and d.recovering == (2,) and d.sources == (1,) and d.max_step == 2


@pytest.mark.parametrize("age,expired", [(0.0, False), (2.9, False), (3.0, False), (3.01, True), (50.0, True)])
def test_heartbeat_expiry_marks_replica_failed(age, expired):
    m = make(2, heartbeat_interval_s=1.0, heartbeat_timeout_s=3.0)
    register(m, 0, 0.0, step=8)
    register(m, 1, 0.0, step=7)
    m.heartbeat(HeartbeatRequest(identity=ident(0), step=7), 10.0)
    m.heartbeat(HeartbeatRequest(identity=ident(1), step=7), 10.0 + age)  # 1 keeps beating
    assert m.expire(10.0 + age) is expired
    assert m.expire(10.0 + age) is False  # already declared
    assert m.replicas[0].state == ("failed" if expired else "healthy")
    assert m.replicas[1].state == "healthy" and m.replicas.healthy_count() == (1 if expired else 2)
    assert m.failures_total["heartbeat"] == int(expired)
    assert m.replica_state(ident(0)).state == ("failed" if expired else "healthy")
    if expired:
        assert "no heartbeat" in m.replica_state(ident(0)).reason
        with pytest.raises(Evicted):
            m.heartbeat(HeartbeatRequest(identity=ident(0), step=8), 10.0 + age)
        with pytest.raises(Evicted):
            m.request_quorum(qreq(0), 10.0 + age)


def test_heartbeat_expired_member_is_not_waited_for():
    m, d0 = started(3, heartbeat_timeout_s=3.0)
    heartbeat_all(m, [0, 1], 4.0)
    m.request_quorum(qreq(0, 1, 0, 0), 4.0)
    d1 = m.request_quorum(qreq(1, 1, 0, 0), 4.0)  # 2's last sign of life was t=0
    assert d1 is not None and d1.member_ids() == [0, 1]
    assert m.replicas[2].state == "failed"


# --- recovery ------------------------------------------------------------------------------------------
def test_joiner_recovers_from_canonical_member():
    m, d = started(3, heartbeat_timeout_s=3600.0)
    for step in range(1, 21):
        d = next_round(m, d, [0, 1, 2], float(step), step)
    m.report_failure(FailureReport(identity=ident(2), reason="node lost"), 21.0)
    register(m, 2, 22.0, gen=1)
    assert m.request_quorum(qreq(2, 0, -1, -1, gen=1), 22.0) is None  # waits for the members
    assert m.request_quorum(qreq(0, 20, d.quorum_id, d.round), 22.0) is None
    j = m.request_quorum(qreq(1, 20, d.quorum_id, d.round), 22.0)
    assert j is not None
    assert j.member_ids() == [0, 1, 2] and j.members[2] == ident(2, gen=1)
    assert j.max_step == 20 and j.participants == 2
    assert j.recovering == (2,) and j.sources == (0, 1) and j.snapshot_from == 20
    r2 = m.response(j, 2)
    assert [(s.replica_id, s.endpoints) for s in r2.sources] == [(i, m.replicas[i].state_endpoints) for i in (0, 1)]
    assert not r2.serve_recovery and r2.recovering == [2] and r2.snapshot_from == 20
    for source in (0, 1):  # every holder of the newest state serves; only the joiner is told where
        assert m.response(j, source).serve_recovery and m.response(j, source).sources == []


def test_a_replica_catching_up_contributes_nothing_until_it_says_it_caught_up():
    """The joiner's step counter follows the others while it fetches in the background: the
    coordinator must still count it out, keep the sources serving a snapshot it can use, and
    count it in once it stops saying it catches up."""
    m, d = started(3, heartbeat_timeout_s=3600.0)
    d = next_round(m, d, [0, 1, 2], 1.0, 1)

    def round_of(step: int, catching_up: dict[int, int], now: float):
        reqs = [qreq(rid, step, d.quorum_id, d.round).model_copy(update={"catching_up_from": catching_up.get(rid)})
                for rid in (0, 1, 2)]
        return round_all(m, reqs, now)

    first = d.quorum_id
    d = round_of(1, {2: 1}, 2.0)
    assert (d.recovering, d.sources, d.participants, d.snapshot_from) == ((2,), (0, 1), 2, 1)
    assert d.quorum_id == first  # same members: the groups stay
    d = round_of(2, {2: 2, 1: 1}, 3.0)  # two catching up: the snapshot must serve the later need
    assert (d.recovering, d.sources, d.participants, d.snapshot_from) == ((1, 2), (0,), 1, 2)
    d = round_of(3, {}, 4.0)
    assert (d.recovering, d.sources, d.participants, d.snapshot_from) == ((), (), 3, None)
    assert [e.message for e in m.events if e.kind == "caught_up"] == ["replica 1 caught up at step 3",
                                                                      "replica 2 caught up at step 3"]


def test_catching_up_from_a_step_not_reached_is_refused():
    body = qreq(0, 3).model_dump()
    assert QuorumRequest.model_validate({**body, "catching_up_from": 3}).catching_up_from == 3
    with pytest.raises(ValueError, match="past the step"):
        QuorumRequest.model_validate({**body, "catching_up_from": 4})


@pytest.mark.parametrize(
    "state,recovering,participants",
    [
        ([(0, -1), (0, -1)], (), 2),
        ([(20, 4), (20, 4), (0, -1)], (2,), 2),
        ([(20, 3), (20, 4)], (0,), 1),  # same step, older lineage recovers
        ([(20, 4), (20, 3), (20, 4)], (1,), 2),
        ([(21, 3), (20, 4)], (1,), 1),  # a higher step beats a newer lineage
        ([(5, 1), (20, 2), (20, 2), (3, 0)], (0, 3), 2),
        ([(0, -1), (9, 0), (9, 0)], (0,), 2),
    ],
)
def test_canonical_state_and_recovery_sources(state, recovering, participants):
    m = make(len(state))
    for rid, (step, _) in enumerate(state):
        register(m, rid, step=step)
    d = round_all(m, [qreq(rid, step, commit) for rid, (step, commit) in enumerate(state)], 0.0)
    assert d.recovering == recovering
    assert d.participants == participants
    assert d.max_step == max(s for s, _ in state)
    canonical = [rid for rid in d.member_ids() if rid not in recovering]
    assert d.sources == (tuple(canonical) if recovering else ())
    assert len({state[rid] for rid in canonical}) == 1


# --- min_replicas ----------------------------------------------------------------------------------------
def test_below_min_replicas_pauses_then_resumes_with_replacement():
    m, d0 = started(3, min_replicas=2, heartbeat_timeout_s=3600.0)
    for rid in (1, 2):
        m.report_failure(FailureReport(identity=ident(rid), reason="gone"), 1.0)
    assert m.request_quorum(qreq(0, 1, 0, 0), 2.0) is None
    assert m.paused
    for t in (3.0, 50.0, 500.0):
        assert m.try_decide(t) is None and m.paused
    assert [e.kind for e in m.events].count("paused") == 1
    assert m.status(500.0).paused
    register(m, 1, 501.0, gen=1)
    d1 = m.request_quorum(qreq(1, 0, -1, -1, gen=1), 501.0)
    assert d1 is not None and d1.member_ids() == [0, 1]
    assert not m.paused and m.events[-1].kind == "resumed"
    assert d1.recovering == (1,) and d1.max_step == 1
    assert m.answer_for(qreq(0, 1, 0, 0)) is d1


# --- incarnations ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gen,att", [(0, 0), (1, 2), (2, 0)])
def test_stale_incarnation_gets_conflict(gen, att):
    m = make(2)
    register(m, 0, gen=2, att=3)
    stale = ident(0, gen, att)
    with pytest.raises(Evicted):
        register(m, 0, 1.0, gen=gen, att=att)
    with pytest.raises(Evicted):
        m.heartbeat(HeartbeatRequest(identity=stale, step=1), 1.0)
    with pytest.raises(Evicted):
        m.request_quorum(qreq(0, gen=gen, att=att), 1.0)
    with pytest.raises(Evicted):
        m.leave(LeaveRequest(identity=stale, step=1), 1.0)
    assert m.report_failure(FailureReport(identity=stale, reason="old news"), 1.0) is False
    assert m.replica_state(stale).state == "superseded"
    assert m.replicas[0].state == "healthy" and m.replicas[0].identity == ident(0, 2, 3)
    assert not m.pending


def test_newer_attempt_supersedes_old_and_drops_its_pending_request():
    m, d0 = started(3, heartbeat_timeout_s=3600.0)
    m.request_quorum(qreq(1, 1, 0, 0), 1.0)
    assert 1 in m.pending
    register(m, 1, 1.5, att=1)  # the launcher restarted replica 1's processes in place
    assert 1 not in m.pending
    assert m.replicas[1].identity == ident(1, 0, 1) and m.replicas[1].failures == 1
    assert m.failures_total["superseded"] == 1
    assert m.replica_state(ident(1, 0, 0)).state == "superseded"
    assert m.replica_state(ident(1, 0, 1)).state == "healthy"
    with pytest.raises(Evicted):
        m.request_quorum(qreq(1, 1, 0, 0), 1.6)
    assert m.request_quorum(qreq(1, 0, -1, -1, att=1), 2.0) is None
    m.request_quorum(qreq(0, 1, 0, 0), 2.0)
    d1 = m.request_quorum(qreq(2, 1, 0, 0), 2.0)
    assert d1 is not None and d1.members == (ident(0), ident(1, 0, 1), ident(2))
    assert d1.quorum_id == d0.quorum_id + 1 and d1.recovering == (1,)


def test_register_again_with_same_incarnation_is_idempotent():
    m, d0 = started(2)
    register(m, 0, 5.0)
    assert m.replicas[0].failures == 0 and m.replicas[0].last_heartbeat == 5.0
    assert m.answer_for(qreq(0)) is d0
    m.report_failure(FailureReport(identity=ident(0), reason="x"), 6.0)
    with pytest.raises(Evicted):
        register(m, 0, 7.0)  # a dead incarnation cannot come back


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.heartbeat(HeartbeatRequest(identity=ident(1), step=0), 0.0),
        lambda m: m.request_quorum(qreq(1), 0.0),
        lambda m: m.leave(LeaveRequest(identity=ident(1), step=0), 0.0),
    ],
)
def test_unknown_replica_is_not_registered(call):
    m = make(3)
    register(m, 0)
    with pytest.raises(NotRegistered):
        call(m)
    assert m.report_failure(FailureReport(identity=ident(1), reason="?"), 0.0) is False
    assert m.replica_state(ident(1)).state == "unknown"
    assert 1 not in m.replicas and not m.pending


@pytest.mark.parametrize("rid", [3, 4, 4095])
def test_register_beyond_num_replicas_is_rejected(rid):
    m = make(3)
    with pytest.raises(ValueError, match="num_replicas"):
        register(m, rid)
    assert not m.replicas


# --- responses ------------------------------------------------------------------------------------------------
def test_response_rank_is_index_in_members_and_only_sources_serve():
    m = make(4, heartbeat_timeout_s=3600.0, startup_wait_s=60.0)
    for rid, step in ((0, 8), (1, 2), (3, 8)):  # replica 2 never shows up
        register(m, rid, step=step)
    for rid, step, commit in [(3, 8, 2), (0, 8, 2), (1, 2, 1)]:
        assert m.request_quorum(qreq(rid, step, commit), 0.0) is None
    d = m.try_decide(60.0)
    assert d is not None and d.member_ids() == [0, 1, 3]
    assert d.recovering == (1,)
    expect = {0: (0, True), 1: (1, False), 3: (2, True)}
    for rid, (rank, serves) in expect.items():
        r = m.response(d, rid)
        assert r.rank == rank and r.serve_recovery is serves
        assert (r.round, r.quorum_id, r.members, r.max_step, r.participants, r.recovering) == (
            d.round, d.quorum_id, [0, 1, 3], 8, 2, [1])
        assert r.store_prefix == d.store_prefix and r.store_addr == "10.0.0.0:29500"
        assert [s.replica_id for s in r.sources] == ([0, 3] if rid == 1 else [])
    with pytest.raises(ValueError):
        m.response(d, 2)


def test_status_reflects_replicas_and_current_quorum():
    m, d0 = started(3)
    m.report_failure(FailureReport(identity=ident(1), reason="boom", exit_code=3), 1.0)
    s = m.status(2.0)
    assert (s.round, s.quorum_id, s.members) == (0, d0.quorum_id, [0, 1, 2])
    assert (s.num_replicas, s.healthy_replicas, s.paused) == (3, 2, False)
    states = {r.replica_id: (r.state, r.failures) for r in s.replicas}
    assert states == {0: ("healthy", 0), 1: ("failed", 1), 2: ("healthy", 0)}
    assert s.replicas[0].heartbeat_age_s == 2.0 and s.replicas[1].heartbeat_age_s is None
    assert {e.kind for e in s.events} >= {"registered", "quorum", "failed"}


def test_round_timeout_runs_from_the_first_member_not_from_a_replacement():
    # Steps take 200 s here; a replacement asking mid-step must not make members "hung".
    m, d0 = started(3, round_timeout_s=120.0)
    m.report_failure(FailureReport(identity=ident(2), reason="crash"), 1.0)
    d1 = round_all(m, [qreq(0, 0, 0, 0, failed=True), qreq(1, 0, 0, 0, failed=True)], 1.0)
    heartbeat_all(m, [0, 1], 10.0)
    register(m, 2, 10.0, att=1)
    assert m.request_quorum(qreq(2, att=1), 10.0) is None  # the replacement waits from t=10
    heartbeat_all(m, [0, 1, 2], 200.0)
    assert m.try_decide(200.0) is None  # 190 s after the replacement asked: members still fine
    assert m.replicas[0].state == m.replicas[1].state == "healthy"
    m.request_quorum(qreq(0, 1, d1.quorum_id, d1.round), 201.0)
    heartbeat_all(m, [0, 1, 2], 321.0)
    d2 = m.try_decide(321.0)  # member 1 has not come 120 s after member 0 did
    assert d2 is not None and d2.member_ids() == [0, 2]
    assert m.replicas[1].state == "failed"


def test_a_round_whose_every_member_still_catches_up_is_decided_without_a_source():
    """The last holder of the state died while the others caught up from it: the round is
    decided (they are told nobody can serve them, and restart), not a coordinator crash."""
    m, d = started(3, heartbeat_timeout_s=3600.0)
    d = next_round(m, d, [0, 1, 2], 1.0, 1)
    m.report_failure(FailureReport(identity=ident(0), reason="killed"), 2.0)
    reqs = [qreq(rid, 1, d.quorum_id, d.round, failed=True).model_copy(update={"catching_up_from": 1})
            for rid in (1, 2)]
    d = round_all(m, reqs, 2.0)
    assert (d.recovering, d.sources, d.participants) == ((1, 2), (), 1)
    assert d.store_addr == "10.0.0.1:29500"

