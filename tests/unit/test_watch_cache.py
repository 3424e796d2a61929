"""The operator's watch cache (cache.py): events keep it current, lists are rare, nothing
rolls back."""

from __future__ import annotations

from transom import contract
from transom_operator.cache import DEPARTED_S, WatchCache


def pod(name: str, rv: int, job: str = "j", phase: str = "Running") -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": str(rv),
                         "labels": {contract.LABEL_JOB: job}}, "status": {"phase": phase}}


class Lister:
    def __init__(self, items, rv):
        self.items, self.rv, self.calls = items, rv, 0

    def __call__(self):
        self.calls += 1
        return list(self.items), self.rv


def names(pods) -> list[str]:
    return sorted(p["metadata"]["name"] for p in pods)


def test_a_job_is_listed_once_then_kept_current_by_events_until_the_resync():
    now = [0.0]
    cache = WatchCache(resync_s=60, clock=lambda: now[0])
    lister = Lister([pod("a", 5), pod("b", 6)], rv=10)
    assert names(cache.pods("ns", "j", lister)) == ["a", "b"]
    cache.pod_event("ADDED", pod("c", 11))
    cache.pod_event("DELETED", pod("a", 12))
    cache.pod_event("ADDED", pod("other-job", 13, job="k"))
    assert names(cache.pods("ns", "j", lister)) == ["b", "c"] and lister.calls == 1
    now[0] = 61.0  # a ghost left by a missed DELETED event lives at most until the resync
    lister.items = [pod("c", 11)]
    lister.rv = 20
    assert names(cache.pods("ns", "j", lister)) == ["c"] and lister.calls == 2


def test_a_late_event_or_an_older_list_never_rolls_the_view_back():
    cache = WatchCache(resync_s=0, clock=lambda: 0.0)  # every read lists
    cache.pod_event("MODIFIED", pod("a", 9, phase="Failed"))
    cache.pod_event("MODIFIED", pod("a", 7, phase="Running"))  # late
    listed = cache.pods("ns", "j", Lister([pod("a", 8, phase="Running")], rv=8))
    assert [p["status"]["phase"] for p in listed] == ["Failed"]
    cache.pod_event("ADDED", pod("b", 30))  # created after a list taken at rv 25, which no longer has a
    assert names(cache.pods("ns", "j", Lister([], 25))) == ["b"]


def test_nodes_and_forgetting_a_job():
    cache = WatchCache(clock=lambda: 0.0)
    lister = Lister([{"metadata": {"name": "n1", "resourceVersion": "3"}}], rv=3)
    cache.node_event("ADDED", {"metadata": {"name": "n2", "resourceVersion": "4"}})
    assert names(cache.nodes(lister)) == ["n1", "n2"]
    cache.node_event("DELETED", {"metadata": {"name": "n1", "resourceVersion": "5"}})
    assert names(cache.nodes(lister)) == ["n2"] and lister.calls == 1
    cache.pods("ns", "j", Lister([pod("a", 1)], 1))
    cache.forget_job("ns", "j")
    fresh = Lister([], 2)
    assert cache.pods("ns", "j", fresh) == [] and fresh.calls == 1


def test_a_pod_is_observed_again_only_when_it_changed():
    cache = WatchCache(resync_s=60, clock=lambda: 0.0)
    lister = Lister([pod("a", 5), pod("b", 6)], rv=10)
    observed: list[str] = []

    def observe(p: dict) -> str:
        observed.append(p["metadata"]["name"])
        return p["status"]["phase"]

    assert sorted(cache.pods("ns", "j", lister, observe)) == ["Running", "Running"]
    cache.pod_event("MODIFIED", pod("b", 11, phase="Failed"))
    assert sorted(cache.pods("ns", "j", lister, observe)) == ["Failed", "Running"]
    assert observed == ["a", "b", "b"]  # a unchanged: its observation is reused


def job(rv: int, generation: int = 1, phase: str = "Running", deleting: bool = False) -> dict:
    meta = {"name": "j", "namespace": "ns", "resourceVersion": str(rv), "generation": generation}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-25T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase}}


class Getter:
    def __init__(self, body):
        self.body, self.calls = body, 0

    def __call__(self):
        self.calls += 1
        return self.body


def test_the_job_is_read_once_then_kept_current_by_events_and_own_writes_until_the_resync():
    now = [0.0]
    cache = WatchCache(resync_s=60, clock=lambda: now[0])
    get = Getter(job(5))
    assert cache.job("ns", "j", get)["metadata"]["resourceVersion"] == "5" and get.calls == 1
    # The operator's own status write: its response is what the next pass works from, even
    # before (or if never) the watch delivers it, and the watch's late events do not undo it.
    cache.wrote_job(job(8, phase="Degraded"))
    assert cache.job_event("MODIFIED", job(7, phase="Running")) is False
    assert cache.job("ns", "j", get)["status"]["phase"] == "Degraded" and get.calls == 1
    # Someone else's status change (the coordinator's figures): kept, no wake-up.
    assert cache.job_event("MODIFIED", job(9, phase="Degraded")) is False
    # A spec change or a deletion wakes the job's daemon.
    assert cache.job_event("MODIFIED", job(10, generation=2)) is True
    assert cache.job("ns", "j", get)["metadata"]["generation"] == 2 and get.calls == 1
    assert cache.job_event("MODIFIED", job(11, generation=2, deleting=True)) is True
    now[0] = 61.0  # a watch that missed events cannot mislead a pass for longer than the resync
    get.body = job(12, generation=3)
    assert cache.job("ns", "j", get)["metadata"]["generation"] == 3 and get.calls == 2


def test_a_failed_write_or_a_deleted_job_is_read_again_and_a_late_write_cannot_revive_it():
    cache = WatchCache(resync_s=60, clock=lambda: 0.0)
    get = Getter(job(5))
    cache.job("ns", "j", get)
    cache.drop_job("ns", "j")  # a patch computed from the cached status failed
    assert cache.job("ns", "j", get) is not None and get.calls == 2
    assert cache.job_event("DELETED", job(20)) is True
    cache.wrote_job(job(19))  # the response of a write that raced the deletion
    get.body = None
    assert cache.job("ns", "j", get) is None and get.calls == 3
    cache.forget_job("ns", "j")
    get.body = job(30)  # a new job of the same name
    assert cache.job("ns", "j", get)["metadata"]["resourceVersion"] == "30" and get.calls == 4


def test_events_before_the_first_pass_do_not_replace_its_read():
    cache = WatchCache(resync_s=60, clock=lambda: 0.0)
    assert cache.job_event(None, job(3)) is True  # kopf's initial listing
    get = Getter(job(4))
    assert cache.job("ns", "j", get)["metadata"]["resourceVersion"] == "4" and get.calls == 1
    assert cache.job("ns", "j", get)["metadata"]["resourceVersion"] == "4" and get.calls == 1


def test_a_deleted_pod_stays_departed_for_a_while_with_its_last_state():
    now = [0.0]
    cache = WatchCache(resync_s=60, clock=lambda: now[0])
    lister = Lister([pod("a", 5), pod("b", 6)], rv=10)
    cache.pods("ns", "j", lister)
    cache.pod_event("DELETED", pod("a", 12, phase="Failed"))
    assert names(cache.pods("ns", "j", lister)) == ["b"]
    phases = cache.departed("ns", "j", lambda p: (p["metadata"]["name"], p["status"]["phase"]))
    assert phases == [("a", "Failed")] and cache.departed("ns", "k", lambda p: p) == []
    now[0] = DEPARTED_S - 1
    assert len(cache.departed("ns", "j", lambda p: p)) == 1
    now[0] = DEPARTED_S
    assert cache.departed("ns", "j", lambda p: p) == []
