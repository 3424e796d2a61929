"""Quorum leases (coordinator/lease.py) with a real coordinator and real Gloo groups, the
replicas as threads (threaded_job.py): a quiet job trains most steps without asking, and
what it trains is bit for bit what asking at every step trains; a replica that fails
under a lease is restarted and rejoins, and the replicas end identical. Leases are off by
default (transom/defaults.py says why); these jobs turn them on.
"""

from __future__ import annotations

import pytest

from threaded_job import TinyGPT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 150


def ok(result) -> None:
    assert result.returncode == 0, result.output[-4000:]


def test_a_quiet_job_trains_under_leases_what_asking_at_every_step_trains(threaded_job):
    gpt = TinyGPT()
    asking = threaded_job(2, gpt.steps(STEPS), gpt.build, lease_s=0.0)
    leased = threaded_job(2, gpt.steps(STEPS), gpt.build, lease_s=1.0)
    ok(asking)
    ok(leased)
    assert asking.summary["rounds"] >= STEPS  # one round a step, and the completion's
    # Under leases most steps asked nothing (a lease covers 1 s of steps: many, unless a
    # step takes half a second).
    assert leased.summary["rounds"] < STEPS / 2, leased.summary["rounds"]
    assert leased.digests() == asking.digests() and len(set(leased.digests().values())) == 1


def test_a_replica_that_fails_under_a_lease_rejoins_and_the_replicas_end_identical(threaded_job):
    gpt = TinyGPT()
    result = threaded_job(2, gpt.steps(2000), gpt.build, faults={1: ["raise:step=60"]}, end_on=["caught_up:1"],
                          lease_s=1.0)
    result.assert_finished_together(2)
    assert result.incarnations(1) == 2
