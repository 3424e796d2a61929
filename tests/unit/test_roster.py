"""The roster's queries (coordinator/roster.py): which record is the live incarnation, whose
heartbeats expired, how many are healthy, how far the furthest got."""

from __future__ import annotations

import pytest

from membership_world import ident
from transom.coordinator.records import Replica
from transom.coordinator.roster import Roster
from transom.errors import Evicted, NotRegistered
from transom.words import IncarnationState


def _roster(*reps: Replica) -> Roster:
    r = Roster()
    for rep in reps:
        r.put(rep)
    return r


def _rep(rid: int, generation: int = 0, **kw) -> Replica:
    return Replica(identity=ident(rid, generation), store_addr="h:1", state_endpoints=[], **kw)


def test_put_replaces_the_older_incarnation_and_the_roster_reads_as_a_mapping():
    r = _roster(_rep(0), _rep(1))
    r.put(_rep(1, generation=1))
    assert sorted(r) == [0, 1] and len(r) == 2 and r[1].identity.generation == 1 and r.get(5) is None


def test_only_the_healthy_record_of_exactly_that_incarnation_is_current_or_live():
    r = _roster(_rep(0, generation=1), _rep(1, state=IncarnationState.FAILED, last_failure="boom"))
    assert r.current(ident(0, 1)) is r[0] and r.live(ident(0, 1)) is r[0]
    assert r.current(ident(0, 0)) is None and r.current(ident(1, 0)) is None and r.current(ident(2, 0)) is None
    with pytest.raises(Evicted, match="superseded"):
        r.live(ident(0, 0))
    with pytest.raises(Evicted, match="declared failed: boom"):
        r.live(ident(1, 0))
    with pytest.raises(NotRegistered):
        r.live(ident(2, 0))


def test_expired_names_the_healthy_records_past_the_timeout_with_their_age():
    r = _roster(_rep(0, last_heartbeat=0.0), _rep(1, last_heartbeat=8.0),
                _rep(2, last_heartbeat=0.0, state=IncarnationState.LEFT))
    assert [(rep.identity.replica_id, age) for rep, age in r.expired(10.0, 5.0)] == [(0, 10.0)]
    assert r.expired(10.0, 10.0) == []  # exactly the timeout is not past it


def test_counts_healthy_records_and_the_furthest_step_of_any():
    r = _roster(_rep(0, step=3), _rep(1, step=7, state=IncarnationState.FAILED))
    assert r.healthy_count() == 1 and r.max_step() == 7 and Roster().max_step() == 0
