"""The operator's leader election (`transom_operator.leader`) on a real kube-apiserver's Lease:
one holder at a time, and a holder that stops hands over at once instead of after the
Lease's duration (its pod evicted by a drain: the standby, which watched all along, leads
before the evicted pod's own replacement has started).
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from kube_helpers import wait_for
from transom_operator.leader import LeaderElector

DURATION_S = 15


@pytest.fixture
def electors(kube_api, namespace):
    made: list[LeaderElector] = []

    def make(identity: str) -> LeaderElector:
        e = LeaderElector(kube_api, namespace, "transom-operator", identity, duration_s=DURATION_S, renew_s=0.5)
        made.append(e)
        e.start()
        return e

    yield make
    for e in made:
        e.stop()


def _holder(kube_api, namespace) -> str | None:
    lease = client.CoordinationV1Api(kube_api).read_namespaced_lease("transom-operator", namespace)
    return lease.spec.holder_identity


def test_a_stopping_leader_releases_the_lease_and_the_standby_leads_within_a_renewal(kube_api, namespace, electors):
    first = electors("first")
    wait_for(first.is_leader, 10, "the first instance leading")
    standby = electors("standby")
    time.sleep(2)  # several of the standby's tries: the Lease is held
    assert first.is_leader() and not standby.is_leader()
    assert _holder(kube_api, namespace) == "first"

    stopped = time.monotonic()
    first.stop()
    assert not first.is_leader()
    wait_for(standby.is_leader, DURATION_S, "the standby leading")
    took = time.monotonic() - stopped
    assert took < DURATION_S / 3, f"the standby took {took:.1f} s: the Lease was not released"
    assert _holder(kube_api, namespace) == "standby"


def test_an_instance_that_does_not_hold_the_lease_leaves_it_alone_when_it_stops(kube_api, namespace, electors):
    first = electors("first")
    wait_for(first.is_leader, 10, "the first instance leading")
    standby = electors("standby")
    time.sleep(1)
    standby.stop()
    time.sleep(1)
    assert first.is_leader() and _holder(kube_api, namespace) == "first"
