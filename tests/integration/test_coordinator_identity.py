"""A replica's credential speaks for its own replica only (coordinator/identity.py), over real HTTP.

Each replica (launcher) holds a replica key naming its replica, generation and node; the
job's token stays with the runner. With its own key, a replica's code can no longer read
the other replicas' incarnations from /v1/status, nor post a failure, signals, a leave or a
checkpoint in another replica's name (issue 28, finding 3), and a flood of signal posts
delays detection, never a heartbeat (finding 4).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from transom.coordinator.client import CoordinatorClient
from transom.coordinator.identity import ReplicaKeys
from transom.coordinator.membership import Settings
from transom.coordinator.models import (
    CheckpointReport,
    FailureReport,
    HeartbeatRequest,
    Identity,
    LeaveRequest,
    QuorumRequest,
    RegisterRequest,
    RendezvousInfo,
    SignalBatch,
    SignalRow,
)
from transom.coordinator.thread import CoordinatorThread
from transom.errors import Forbidden

TOKEN = "job-token-5c1d"
JOB = "identity-test"
TIMEOUT = 5.0


@pytest.fixture
def keys() -> ReplicaKeys:
    return ReplicaKeys(JOB)


@pytest.fixture
def coord(keys) -> Iterator[CoordinatorThread]:
    ct = CoordinatorThread(Settings(job=JOB, num_replicas=3, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5,
                                    startup_wait_s=0.0), TOKEN, replica_keys=keys)
    ct.start()
    yield ct
    ct.stop()


def ident(rid: int, gen: int = 0) -> Identity:
    return Identity(replica_id=rid, generation=gen, attempt=0)


def as_replica(ct: CoordinatorThread, keys: ReplicaKeys, rid: int, gen: int = 0, node: int = 0) -> CoordinatorClient:
    return CoordinatorClient(ct.url, keys.mint(rid, gen, node), timeout_s=TIMEOUT)


def register(c: CoordinatorClient, rid: int, gen: int = 0, ranks: int = 1, step: int = 0) -> None:
    c.register(RegisterRequest(identity=ident(rid, gen), store_addr=f"127.0.0.1:{29500 + rid}",
                               state_endpoints=[f"http://127.0.0.1/{rid}/{k}" for k in range(ranks)], step=step))


def test_a_replica_key_speaks_for_its_own_replica_only(coord, keys):
    mine, other = as_replica(coord, keys, 1), as_replica(coord, keys, 0)
    register(other, 0)
    register(mine, 1)
    for call in (
        lambda: mine.register(RegisterRequest(identity=ident(0, 5), store_addr="h:1", state_endpoints=["x"])),
        lambda: mine.heartbeat(HeartbeatRequest(identity=ident(0), step=0)),
        lambda: mine.report_failure(FailureReport(identity=ident(0), reason="framed")),
        lambda: mine.leave(LeaveRequest(identity=ident(0), step=0, reason="framed")),
        lambda: mine.report_checkpoint(CheckpointReport(identity=ident(0), step=0, uri="x")),
        lambda: mine.report_signals(SignalBatch(identity=ident(0), rows=[SignalRow(step=0, rank=0, step_seconds=1e6)])),
        lambda: mine.quorum(QuorumRequest(identity=ident(0), step=0, commit_quorum_id=-1, last_round=-1), 2.0),
        lambda: mine.replica_state(ident(0)),
        lambda: mine.put_rendezvous(RendezvousInfo(identity=ident(0), master_addr="h", master_port=1)),
        lambda: mine.status(),  # names every replica's incarnation: the job token's only
        # Its own replica, but a generation the operator did not give it, or a node it is not.
        lambda: mine.heartbeat(HeartbeatRequest(identity=ident(1, 7), step=0)),
        lambda: mine.report_signals(SignalBatch(identity=ident(1), node_rank=3, rows=[])),
    ):
        with pytest.raises(Forbidden):
            call()
    admin = CoordinatorClient(coord.url, TOKEN, timeout_s=TIMEOUT)
    assert {r.replica_id: r.state for r in admin.status().replicas} == {0: "healthy", 1: "healthy"}
    # What it may do: speak for itself, and read what a starting replica needs.
    mine.heartbeat(HeartbeatRequest(identity=ident(1), step=0))
    assert mine.replica_state(ident(1)).state == "healthy"
    assert mine.progress().peer_step == 0 and set(mine.progress().model_dump()) == {
        "peer_step", "last_checkpoint", "completed_step", "peer_endpoint"}
    # A peer's state server (not its own) for its pre-flight's link check: no identity in it.
    assert mine.progress().peer_endpoint == "http://127.0.0.1/0/0"
    assert other.progress().peer_endpoint == "http://127.0.0.1/1/0"


@pytest.mark.parametrize("credential", [
    lambda keys: ReplicaKeys("another-job").mint(0, 0),  # another job's key
    lambda keys: keys.mint(0, 0)[:-1] + ("0" if keys.mint(0, 0)[-1] != "0" else "1"),  # tampered
    lambda keys: keys.mint(0, 0).replace(".0.0.0.", ".1.0.0.", 1),  # another replica's name, same mac
    lambda keys: "transom-replica.v1.0.0.0",  # no mac
], ids=["other-job", "tampered", "renamed", "unsigned"])
def test_a_key_that_is_not_this_jobs_is_no_credential(coord, keys, credential):
    r = requests.get(coord.url + "/v1/progress", headers={"Authorization": f"Bearer {credential(keys)}"},
                     timeout=TIMEOUT)
    assert r.status_code == 401


def test_a_script_cannot_restart_a_healthy_replica_in_its_name(coord, keys):
    # The probe's attack: read replica 0's generation and attempt from /v1/status, then post
    # non-finite rows as replica 0. Now neither works, and replica 0 stays healthy.
    victim, attacker = as_replica(coord, keys, 0), as_replica(coord, keys, 2)
    register(victim, 0, step=5)
    register(attacker, 2, step=5)
    r = requests.get(coord.url + "/v1/status", headers={"Authorization": f"Bearer {keys.mint(2, 0)}"},
                     timeout=TIMEOUT)
    assert r.status_code == 403 and "job's token" in r.json()["error"]
    bad = [SignalRow(step=s, rank=0, step_seconds=0.5, loss=float("nan"), finite=False) for s in range(5)]
    with pytest.raises(Forbidden):
        attacker.report_signals(SignalBatch(identity=ident(0), rows=bad))
    assert victim.replica_state(ident(0)).state == "healthy"


def test_a_flood_of_signal_posts_does_not_starve_heartbeats(coord, keys):
    # Four processes of one replica post batches of 4,096 rows as fast as they can; the other
    # replicas' heartbeats (timeout 1.5 s) must keep landing and nobody may be declared failed.
    clients = {r: as_replica(coord, keys, r) for r in range(3)}
    for r, c in clients.items():
        register(c, r, ranks=8, step=1000)
    stop = threading.Event()
    answers: dict[int, int] = {}

    def flood(k: int) -> None:
        s = requests.Session()
        n = 0
        while not stop.is_set():
            # The probe's batches: new rank ids every time (they grew the detectors' state).
            rows = [{"step": 999, "rank": (k * 10**5 + n * 4096 + i) % (1 << 20), "step_seconds": 0.5, "tokens": 1.0}
                    for i in range(4096)]
            body: dict[str, Any] = {"identity": ident(2).model_dump(), "node_rank": 0, "rows": rows}
            n += 1
            code = s.post(coord.url + "/v1/signals", json=body, timeout=TIMEOUT,
                          headers={"Authorization": f"Bearer {keys.mint(2, 0)}"}).status_code
            answers[code] = answers.get(code, 0) + 1

    threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    latencies = []
    try:
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            for r in (0, 1, 2):  # the flooding replica's own launcher beats too
                t0 = time.monotonic()
                clients[r].heartbeat(HeartbeatRequest(identity=ident(r), step=1000))
                latencies.append(time.monotonic() - t0)
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
    admin = CoordinatorClient(coord.url, TOKEN, timeout_s=TIMEOUT)
    states = {r.replica_id: r.state for r in admin.status().replicas}
    assert states == {0: "healthy", 1: "healthy", 2: "healthy"}, (states, answers)
    assert answers.get(429, 0) > answers.get(200, 0), answers  # most of the flood waits outside
    assert max(latencies) < 1.0 and statistics.median(latencies) < 0.2, (max(latencies), answers)


def test_a_key_with_a_non_ascii_digit_is_a_401_counted_as_unauthenticated(coord, keys):
    # A superscript two: str.isdigit() took it, int() did not (a 400 that named int()).
    forged = keys.mint(0, 0).replace(".0.0.0.", ".\u00b2.0.0.", 1)
    body = HeartbeatRequest(identity=ident(0), step=0).model_dump_json().encode()
    r = requests.post(coord.url + "/v1/heartbeat", data=body,
                      headers={"Authorization": f"Bearer {forged}".encode()}, timeout=TIMEOUT)
    assert r.status_code == 401, r.text
    text = requests.get(coord.url + "/metrics", timeout=TIMEOUT).text
    assert 'transom_coordinator_unauthenticated_requests_total{endpoint="/v1/heartbeat"} 1.0' in text
