"""The launcher's view of its replica (launch/state_watch.py) against a real coordinator on
loopback: the long-poll is held while nothing changes, answered within the coordinator's tick
when the replica registers or fails, and stop() ends a poll in flight at once."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from transom.coordinator.client import CoordinatorClient, replica_state_path
from transom.coordinator.membership import Settings
from transom.coordinator.models import FailureReport, Identity, LeaveRequest, QuorumRequest, RegisterRequest
from transom.coordinator.thread import CoordinatorThread
from transom.launch.state_watch import StateWatch

TOKEN = "state-watch-token"
ME = Identity(replica_id=1, generation=0, attempt=0)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def coord():
    ct = CoordinatorThread(Settings(job="watch", num_replicas=2, heartbeat_timeout_s=30.0), TOKEN)
    ct.start()
    yield ct
    ct.stop()


def register(ct: CoordinatorThread, identity: Identity) -> None:
    CoordinatorClient(ct.url, TOKEN).register(RegisterRequest(
        identity=identity, store_addr="127.0.0.1:29500", state_endpoints=["http://127.0.0.1/0"]))


def until(cond, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"timed out: {what}"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_the_long_poll_is_held_until_the_state_changes(coord):
    register(coord, ME)
    url = coord.url + replica_state_path(ME, known="healthy", wait_s=0.6)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.monotonic()
    held = requests.get(url, headers=headers, timeout=5)
    assert held.json()["state"] == "healthy" and time.monotonic() - t0 >= 0.55  # nothing changed: held
    answer: dict = {}
    poll = threading.Thread(target=lambda: answer.update(r=requests.get(
        coord.url + replica_state_path(ME, known="healthy", wait_s=20), headers=headers, timeout=25)))
    poll.start()
    time.sleep(0.3)
    assert poll.is_alive()
    t_fail = time.monotonic()
    CoordinatorClient(coord.url, TOKEN).report_failure(FailureReport(identity=ME, reason="gone"))
    poll.join(5)
    assert answer["r"].json()["state"] == "failed" and time.monotonic() - t_fail < 1.0


def test_the_watch_follows_registration_failure_and_a_newer_incarnation(coord):
    watch = StateWatch(coord.url, TOKEN, ME, wait_s=20)
    try:
        until(lambda: watch.latest is not None and watch.latest.state == "unknown", 5, "first answer")
        register(coord, ME)
        until(lambda: watch.latest.state == "healthy", 2, "registration seen")
        quiet = watch.polls
        time.sleep(1.5)
        assert watch.polls == quiet  # one held poll, not one request a second
        CoordinatorClient(coord.url, TOKEN).report_failure(FailureReport(identity=ME, reason="CUDA error"))
        seen_s = until(lambda: watch.latest.state == "failed", 2, "failure seen")
        assert seen_s < 1.0 and "CUDA error" in watch.latest.reason
        register(coord, Identity(replica_id=1, generation=1, attempt=0))
        until(lambda: watch.latest.state == "superseded", 2, "newer incarnation seen")
    finally:
        t0 = time.monotonic()
        watch.stop()
        assert time.monotonic() - t0 < 1.0 and not watch.running  # the held poll ended with stop()


def test_an_unreachable_coordinator_leaves_the_view_as_it_was_and_stop_is_prompt(coord):
    register(coord, ME)
    watch = StateWatch(coord.url, TOKEN, ME, wait_s=20)
    until(lambda: watch.latest is not None and watch.latest.state == "healthy", 5, "first answer")
    coord.stop()
    time.sleep(1.5)  # the held poll fails, the retries fail
    assert watch.latest.state == "healthy" and watch.running
    t0 = time.monotonic()
    watch.stop()
    assert time.monotonic() - t0 < 1.5 and not watch.running


def test_the_watch_stops_once_the_job_completed(coord):
    other = Identity(replica_id=0, generation=0, attempt=0)
    for identity in (other, ME):
        register(coord, identity)
    watch = StateWatch(coord.url, TOKEN, ME, wait_s=20)
    until(lambda: watch.latest is not None and watch.latest.state == "healthy", 5, "first answer")
    asks = [threading.Thread(target=CoordinatorClient(coord.url, TOKEN).quorum, args=(
        QuorumRequest(identity=i, step=0, commit_quorum_id=-1, last_round=-1), 10)) for i in (other, ME)]
    for t in asks:
        t.start()
    for t in asks:
        t.join(10)
    CoordinatorClient(coord.url, TOKEN).leave(LeaveRequest(identity=other, step=1, completed=True, reason="done"))
    until(lambda: not watch.running, 2, "the watch ended")
    assert watch.latest.job_completed and watch.polls <= 3
