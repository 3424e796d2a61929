"""Quorum leases (coordinator/lease.py) with a real coordinator and real Gloo groups, the
replicas as threads (threaded_job.py): a quiet job trains most steps without asking, and
what it trains is bit for bit what asking at every step trains; a replica that fails
under a lease is restarted and rejoins, and the replicas end identical; a member that
leaves its group under a lease frees the peers waiting in its collective at once.
Leases are on by default (1 s); these jobs name the lease they want.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from test_trainer_api import _batch, run_replicas
from threaded_job import TinyGPT
from transom import contract

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


def test_a_member_that_leaves_under_a_lease_frees_the_peers_in_its_collective_at_once(monkeypatch, caplog):
    # Replica 0 steps aside (an evaluation) while replica 1 trains under the lease: replica 1
    # is in the collective of a step replica 0 never enters. Replica 0 closes its group as it
    # steps aside, so replica 1's collective fails on the closed connection at once, not at
    # the collective timeout (60 s here), and replica 1 trains on without it (the round does
    # not wait for a member aside). Closing the group is also what frees a member whose
    # collective completed while a peer's failed: it would otherwise be declared hung by the
    # round its peers asked for.
    monkeypatch.setenv(contract.ENV_DETECTION, json.dumps({"enabled": False}))
    caplog.set_level(logging.WARNING, logger="transom.ft")
    leased_before_aside = []

    def body(r, trainer, model):
        for step in trainer.steps(40):
            if r == 0 and step == 20:
                leased_before_aside.append(trainer._exchange.lease is not None)
                with trainer.aside():
                    time.sleep(1.0)
            x, y = _batch(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            time.sleep(0.02)
        return trainer.step

    step0, step1 = run_replicas(2, body, min_replicas=1, collective_timeout_s=60, quorum_lease_s=1.0)
    assert leased_before_aside == [True]
    failed = [r.getMessage() for r in caplog.records if "cross-replica step failed" in r.getMessage()]
    # "Connection closed by peer" or "reset by peer", as the closing found the connection;
    # a timeout would say "Timed out" after 60 s.
    assert failed and all("by peer" in m for m in failed), failed
    # Replica 1 finished the job; replica 0, never evicted (that would have raised), stopped
    # where it found the job complete, or finished with it if it came back in time.
    assert step1 == 40 and step0 <= 40
