"""The coordinator's membership gauges (`transom.coordinator.metrics.MembershipCollector`)
read from a real `Membership` driven through a replica's failure and its return: who is in
the round, and who contributes gradients rather than catching up."""

from __future__ import annotations

import asyncio

from membership_world import make, qreq, register, started
from transom.coordinator.access import Access
from transom.coordinator.detection import Detection, SignalGate
from transom.coordinator.fencing import Refusals
from transom.coordinator.metrics import MembershipCollector
from transom.coordinator.shared import Shared
from transom.detect.step_rows import DetectionSettings


def _gauges(m) -> dict[str, float]:
    shared = Shared(membership=m, detection=Detection(DetectionSettings(), m), access=Access("t", Refusals()),
                    refusals=Refusals(), signal_gate=SignalGate(), lock=asyncio.Lock(), clock=lambda: 2.0,
                    ticking=lambda: True)
    return {s.name: s.value for family in MembershipCollector(shared).collect() for s in family.samples
            if not s.labels}


def test_members_and_contributors_follow_a_replica_out_and_back():
    m, d0 = started(3, failed_grace_s=0.5)
    g = _gauges(m)
    assert g["transom_coordinator_quorum_members"] == 3 and g["transom_coordinator_contributing_replicas"] == 3
    # Replica 2 is left behind by a failed step: the round goes on with two.
    m.request_quorum(qreq(0, 0, 0, 0, failed=True), 1.0)
    m.request_quorum(qreq(1, 0, 0, 0, failed=True), 1.0)
    d1 = m.try_decide(1.5)
    assert d1 is not None and d1.member_ids() == [0, 1]
    g = _gauges(m)
    assert g["transom_coordinator_quorum_members"] == 2 and g["transom_coordinator_contributing_replicas"] == 2
    # Its next attempt joins at step 0: a member, but catching up, not contributing yet.
    register(m, 2, 2.0, att=1)
    m.request_quorum(qreq(2, 0, -1, -1, att=1), 2.0)
    m.request_quorum(qreq(0, 1, d1.quorum_id, d1.round), 2.0)
    d2 = m.request_quorum(qreq(1, 1, d1.quorum_id, d1.round), 2.0)
    assert d2 is not None and d2.recovering == (2,)
    g = _gauges(m)
    assert g["transom_coordinator_quorum_members"] == 3 and g["transom_coordinator_contributing_replicas"] == 2


def test_no_round_yet_reads_zero():
    g = _gauges(make(2))
    assert g["transom_coordinator_quorum_members"] == 0 and g["transom_coordinator_contributing_replicas"] == 0
