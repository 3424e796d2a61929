"""The operator's watch cache (cache.py): events keep it current, lists are rare, nothing
rolls back."""

from __future__ import annotations

from transom import contract
from transom_operator.cache import WatchCache


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
