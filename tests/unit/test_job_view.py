"""What `transom run` reads of a job's GET /v1/status (launch/job_view.py)."""

from __future__ import annotations

from transom.coordinator.models import Event, JobStatus, ReplicaStatus
from transom.launch.job_view import EventFeed, caught_up, failed_incarnations


def _replica(rid: int, state: str, step: int, generation: int = 0, failure: str | None = None) -> ReplicaStatus:
    return ReplicaStatus(replica_id=rid, generation=generation, attempt=0, state=state, step=step, last_report=None,
                         heartbeat_age_s=None, failures=0, last_failure=failure)


def _status(replicas: list[ReplicaStatus], members: list[int]) -> JobStatus:
    return JobStatus(round=3, quorum_id=2, members=members, max_step=max(r.step for r in replicas),
                     num_replicas=len(replicas), min_replicas=1, healthy_replicas=2, paused=False,
                     replicas=replicas, events=[])


def test_caught_up_and_failed():
    status = _status([_replica(0, "healthy", 40), _replica(1, "healthy", 3, generation=1),
                      _replica(2, "failed", 39, failure="gone")], members=[0, 1])
    assert caught_up(status) == {0}  # replica 1 is a member still catching up
    assert failed_incarnations(status) == [(2, 0, "gone")]
    status = _status([_replica(0, "healthy", 40), _replica(1, "healthy", 40, generation=1)], members=[0, 1])
    assert caught_up(status) == {0, 1}


def test_event_feed_passes_each_event_once():
    feed = EventFeed()
    a, b, c = (Event(time=1.0, kind="registered", message=m) for m in "abc")
    d = Event(time=2.0, kind="quorum", message="d")
    assert feed.new([a, b]) == [a, b]
    assert feed.new([a, b]) == []
    assert feed.new([a, b, c]) == [c]  # another event at the same time
    assert feed.new([b, c, d]) == [d]  # the oldest fell out of the window
    assert feed.new([]) == []
