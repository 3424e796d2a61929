"""Disruptions someone asked for, and pods that cannot start (`reconcile.replicas.plan`):

- a pod evicted on request (a drain through the eviction API, a preemption, a NoExecute taint
  on a Ready node: its DisruptionTarget condition says so) is `PodEvicted`: the replica is
  replaced, but the node is not blamed and the replacement uses up neither the restart budget
  nor the backoff;
- a pod deleted and gone before any pass saw it deleting (the leader was on the drained node)
  is judged by the last state its DELETED event carried;
- a new leader that takes over in the middle of a replacement finishes it without doing
  anything twice;
- a pod whose image the kubelet cannot pull is left alone (the kubelet retries): the replica's
  status says why and one Warning Event tells the user, while the other replicas train on.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from reconcile_world import T0, World, cond, make_job
from transom_operator import reasons
from transom_operator.cache import DEPARTED_S
from transom_operator.reconcile import observe
from transom_operator.reconcile.observe import ImagePull, ObservedNode
from transom_operator.reconcile.replicas import plan

DRAINED = dict(deleting=True, disruption="EvictionByEvictionAPI")
EVICTIONS = [
    ("drain, still running", DRAINED, "EvictionByEvictionAPI"),
    # the launcher exited 143 on the SIGTERM before the pass saw the pod
    ("drain, exited on the SIGTERM", dict(DRAINED, phase="Failed", exit_code=143, reason="Error"),
     "EvictionByEvictionAPI"),
    ("preempted", dict(deleting=True, disruption="PreemptionByScheduler"), "PreemptionByScheduler"),
    ("NoExecute taint on a Ready node", dict(deleting=True, disruption="DeletionByTaintManager"),
     "DeletionByTaintManager"),
]


@pytest.mark.parametrize("what, change, why", EVICTIONS, ids=[e[0] for e in EVICTIONS])
def test_an_evicted_pod_replaces_its_replica_without_blaming_the_node_or_using_the_budget(what, change, why):
    w = World(make_job()).running()
    bad = w.pod_of(1)
    others = {n: p.uid for n, p in w.pods.items() if p.replica != 1}
    w.set_pod(bad.name, **change)
    p = w.step()
    assert p.delete == ["demo-r1-n1-g0"]  # the evicted pod is on its way already
    r1 = p.status.replicas[1]
    assert (r1.generation, r1.restarts, r1.state, r1.last_failure.reason) == (1, 1, "Replacing", reasons.POD_EVICTED)
    assert why in r1.last_failure.message and bad.node_name in r1.last_failure.message
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-r1-n0-g1", "demo-r1-n1-g1"]
    assert p.excluded_nodes_added == [] and p.status.excluded_nodes == []
    assert p.status.restart_history == [] and p.status.total_restarts == 1  # a restart, not one the budget counts
    failed = [m for t, r, m in p.events if (t, r) == (reasons.WARNING, reasons.EVENT_REPLICA_FAILED)]
    assert len(failed) == 1 and why in failed[0] and "voluntary" in failed[0]
    w.assert_quiet()
    w.settle()
    w.step()
    assert {n: p.uid for n, p in w.pods.items() if p.replica != 1} == others
    assert w.job.status.state == "Running" and w.job.status.replicas[1].state == "Running"
    w.assert_quiet()


GONE: list[tuple] = [
    ("drained", dict(DRAINED, phase="Failed", exit_code=143, reason="Error"), reasons.POD_EVICTED, []),
    ("deleted by a user", dict(deleting=True), reasons.POD_DELETED, None),
]


@pytest.mark.parametrize("what, last, reason, history", GONE, ids=[g[0] for g in GONE])
def test_a_pod_gone_before_any_pass_saw_it_deleting_is_judged_by_its_last_state(what, last, reason, history):
    """The operator that led was on the drained node: the pod was evicted and gone from the
    API before its successor's first pass, whose watch still saw the DELETED event."""
    w = World(make_job()).running()
    bad = w.pod_of(1)
    w.set_pod(bad.name, **last)
    w.vanish(bad.name)
    p = w.step()
    r1 = p.status.replicas[1]
    assert (r1.generation, r1.state, r1.last_failure.reason) == (1, "Replacing", reason)
    assert bad.name in r1.last_failure.message
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-r1-n0-g1", "demo-r1-n1-g1"]
    if history is not None:
        assert p.status.restart_history == history
    assert p.excluded_nodes_added == []
    w.assert_quiet()


def test_a_pod_gone_longer_than_its_departed_record_is_simply_gone():
    w = World(make_job()).running()
    bad = w.pod_of(1)
    w.set_pod(bad.name, **DRAINED)
    w.vanish(bad.name)
    w.now += timedelta(seconds=DEPARTED_S)  # e.g. no operator ran meanwhile
    r1 = w.step().status.replicas[1]
    assert (r1.generation, r1.last_failure.reason) == (1, reasons.POD_DELETED)
    assert r1.last_failure.message == f"pod of node rank {bad.node_rank} is gone"


@pytest.mark.parametrize("cordoned", [True, False])
def test_a_pod_gone_without_a_trace_from_a_cordoned_node_was_drained(cordoned):
    """The operator that leads started after the pod went (both were on the drained node, or
    the evicted leader's own replacement took the Lease): no DELETED event to read. A node
    that is cordoned says a drain took it; otherwise it is simply gone."""
    w = World(make_job()).running()
    bad = w.pod_of(1)
    w.set_pod(bad.name, **DRAINED)
    w.vanish(bad.name)
    w.now += timedelta(seconds=DEPARTED_S)  # the departed record is of no help
    w.nodes[bad.node_name] = replace(w.nodes[bad.node_name], cordoned=cordoned)
    p = w.step()
    r1 = p.status.replicas[1]
    assert (r1.generation, r1.state) == (1, "Replacing")
    if cordoned:
        assert r1.last_failure.reason == reasons.POD_EVICTED
        assert bad.node_name in r1.last_failure.message and "cordoned" in r1.last_failure.message
        assert p.status.restart_history == []  # voluntary: the restart budget is not used
    else:
        assert r1.last_failure.reason == reasons.POD_DELETED and len(p.status.restart_history) == 1
    assert p.excluded_nodes_added == []


def test_observe_node_reads_a_cordon():
    assert observe.observe_node({"metadata": {"name": "a"}, "spec": {"unschedulable": True}}).cordoned
    assert not observe.observe_node({"metadata": {"name": "a"}, "spec": {}}).cordoned


def test_draining_every_node_neither_fails_the_job_nor_waits_and_crashes_still_count():
    """A cluster upgrade drains every node in turn: with a budget of one restart and a 10 s
    backoff, three drains replace at once and the job runs on; two crashes then fail it."""
    w = World(make_job(ft={"maxReplicaRestarts": 1, "backoffSeconds": 10, "maxBackoffSeconds": 60})).running()
    for replica in (0, 1, 2, 0):
        w.set_pod(w.pod_of(replica).name, **DRAINED)
        p = w.step()
        assert len(p.create) == 2 and p.status.state == "Recovering"  # no backoff
        w.settle()
        w.now += timedelta(seconds=1)
        assert w.step().status.state == "Running"
    assert w.job.status.total_restarts == 4 and w.job.status.restart_history == []
    w.set_pod(w.pod_of(1).name, phase="Failed", exit_code=1)
    assert w.step().status.state == "Recovering"
    w.settle()
    w.step()
    w.set_pod(w.pod_of(2).name, phase="Failed", exit_code=1)
    p = w.step()
    assert p.status.state == "Failed" and cond(p.status, "Failed").reason == reasons.TOO_MANY_RESTARTS


def test_a_crash_after_a_drain_on_the_same_node_is_not_a_repeated_failure():
    w = World(make_job()).running()
    drained = w.pod_of(0)
    w.set_pod(drained.name, **DRAINED)
    w.step()
    w.settle()
    w.step()
    # The node is back in service and replica 2's pod crashes there: a first failure on it.
    victim = w.pod_of(2)
    w.pods[victim.name] = replace(victim, node_name=drained.node_name, phase="Failed", exit_code=1)
    p = w.step()
    assert p.status.replicas[2].last_failure.reason == reasons.POD_FAILED
    assert p.excluded_nodes_added == [] and "second failure" not in p.status.replicas[2].last_failure.message


def test_a_taint_eviction_from_a_not_ready_node_is_the_node_lost_even_within_the_grace():
    """nodeNotReadyGraceSeconds above the pods' NotReady toleration (300 s by default): the
    taint manager evicts first, and the node is blamed all the same."""
    w = World(make_job(ft={"nodeNotReadyGraceSeconds": 600})).running()
    bad = w.pod_of(0, rank=1)
    w.nodes[bad.node_name] = ObservedNode(bad.node_name, False, T0)
    w.now = T0 + timedelta(seconds=300)
    w.set_pod(bad.name, deleting=True, disruption="DeletionByTaintManager")
    p = w.step()
    assert p.status.replicas[0].last_failure.reason == reasons.NODE_NOT_READY
    assert p.excluded_nodes_added == [(bad.node_name, reasons.NODE_NOT_READY)]
    assert [h.replica for h in p.status.restart_history] == [0]


def test_the_kubelets_own_termination_counts_like_a_failure():
    w = World(make_job()).running()
    bad = w.pod_of(2)
    w.set_pod(bad.name, deleting=True, disruption="TerminationByKubelet")
    p = w.step()
    assert p.status.replicas[2].last_failure.reason == reasons.POD_EVICTED
    assert [(h.replica, h.node) for h in p.status.restart_history] == [(2, bad.node_name)]
    assert p.excluded_nodes_added == []


def test_a_deletion_without_a_disruption_target_is_still_pod_deleted():
    w = World(make_job()).running()
    w.set_pod(w.pod_of(1).name, deleting=True)
    p = w.step()
    assert p.status.replicas[1].last_failure.reason == reasons.POD_DELETED
    assert [h.replica for h in p.status.restart_history] == [1]


def test_observe_pod_reads_the_disruption_target():
    raw = {
        "metadata": {"name": "demo-r1-n0-g2", "deletionTimestamp": "2025-01-01T00:01:00Z"},
        "status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]},
    }
    pod = observe.observe_pod(raw)
    assert (pod.deleting, pod.disruption) == (True, "EvictionByEvictionAPI")
    raw["status"]["conditions"][1]["status"] = "False"  # the pod GC clears a stale one this way
    assert observe.observe_pod(raw).disruption is None


# --- a new leader in the middle of a replacement ------------------------------------------------

CUT = [
    ("pod failed", dict(phase="Failed", exit_code=1), 1, False),
    ("drained", DRAINED, 0, False),
    ("node lost", dict(phase="Failed", reason="NodeLost"), 1, True),
]


@pytest.mark.parametrize("what, change, counted, excluded", CUT, ids=[c[0] for c in CUT])
def test_a_new_leader_after_the_status_write_and_the_creates_only_deletes_what_is_left(what, change, counted,
                                                                                      excluded):
    """The leader was killed in its deletes: the status (restarts, history, exclusion), the new
    generation's pods and the Events reached the API server (controller.py posts the Events
    before the deletes), the failed incarnation's pods were not deleted. The new leader, which
    has nothing but the API server's view, deletes them, and records, creates and tells nothing
    again."""
    w = World(make_job()).running()
    bad = w.pod_of(1)
    w.set_pod(bad.name, **change)
    cut = plan(w.job, list(w.pods.values()), w.nodes, w.now)
    for manifest in cut.create:
        meta = manifest["metadata"]
        pod = observe.observe_pod({**manifest, "metadata": {**meta, "uid": meta["name"]}})
        w.pods[pod.name] = pod
    w.job = w.job.model_copy(update={"status": cut.status})
    left = sorted(n for n in ("demo-r1-n0-g0", "demo-r1-n1-g0") if not w.pods[n].deleting)
    w.now += timedelta(seconds=3)  # the standby took the Lease over
    p = w.step()
    assert sorted(p.delete) == left
    assert (p.create, p.events, p.excluded_nodes_added) == ([], [], [])
    s = p.status
    assert (s.total_restarts, s.replicas[1].restarts, s.replicas[1].generation,
            len(s.restart_history)) == (1, 1, 1, counted)
    assert [e.name for e in s.excluded_nodes] == ([bad.node_name] if excluded else [])
    w.assert_quiet()
    w.settle()
    w.step()
    assert w.job.status.state == "Running" and w.job.status.total_restarts == 1
    w.assert_quiet()


# --- an image the kubelet cannot pull ---------------------------------------------------------

def _cannot_pull(w: World, name: str, reason: str = "ErrImagePull") -> None:
    w.set_pod(name, image_pull=ImagePull("t", "t:nope", reason, 'failed to pull image "t:nope": not found'))


def test_a_replacement_that_cannot_pull_its_image_is_left_alone_shown_and_told_once():
    w = World(make_job()).running()
    w.set_pod(w.pod_of(1).name, phase="Failed", exit_code=1)
    w.step()
    w.pods = {n: p for n, p in w.pods.items() if not p.deleting}  # generation 0 is gone, 1 is Pending
    for rank in (0, 1):
        _cannot_pull(w, f"demo-r1-n{rank}-g1")
    p = w.step()
    assert (p.create, p.delete) == ([], [])
    r1 = p.status.replicas[1]
    assert (r1.generation, r1.state, r1.reason) == (1, "Replacing", reasons.IMAGE_PULL_FAILED)
    assert r1.message == "pod demo-r1-n0-g1: container t cannot pull image 't:nope': ErrImagePull"
    ((type_, reason, message),) = p.events
    assert (type_, reason) == (reasons.WARNING, reasons.IMAGE_PULL_FAILED)
    assert message.startswith("Replica 1 generation 1 cannot start: pod demo-r1-n0-g1: container t cannot pull "
                              "image 't:nope': ErrImagePull (failed to pull image \"t:nope\": not found).")
    assert p.status.state == "Recovering" and p.status.healthy == "2/3"  # the others train on
    # The kubelet retries with its backoff (its reason flips): no pod is touched, nothing is told again.
    for i in range(6):
        w.now += timedelta(seconds=20)
        _cannot_pull(w, "demo-r1-n0-g1", "ImagePullBackOff" if i % 2 == 0 else "ErrImagePull")
        p = w.step()
        assert (p.create, p.delete, p.events) == ([], [], [])
        assert p.status.replicas[1].reason == reasons.IMAGE_PULL_FAILED
    # The image comes: the replica runs, and its status no longer holds the reason.
    for rank in (0, 1):
        w.set_pod(f"demo-r1-n{rank}-g1", image_pull=None)
    w.settle()
    r1 = w.step().status.replicas[1]
    assert (r1.state, r1.reason, r1.message) == ("Running", None, None)
    w.assert_quiet()


def test_a_first_incarnation_that_cannot_pull_keeps_the_job_pending_with_one_event_per_replica():
    w = World(make_job())
    w.step()
    for name in list(w.pods):
        _cannot_pull(w, name, "InvalidImageName")
    p = w.step()
    assert p.status.state == "Pending" and (p.create, p.delete) == ([], [])
    assert [(r.state, r.reason) for r in p.status.replicas] == [("Pending", reasons.IMAGE_PULL_FAILED)] * 3
    assert [r for _, r, _ in p.events] == [reasons.IMAGE_PULL_FAILED] * 3
    w.assert_quiet()


def test_a_deleted_pod_that_could_not_pull_is_replaced_and_its_new_incarnation_told_again():
    """What a user does after fixing spec.template: delete the pod (counted as one replacement)."""
    w = World(make_job()).running()
    w.set_pod(w.pod_of(0).name, phase="Failed", exit_code=1)
    w.step()
    w.pods = {n: p for n, p in w.pods.items() if not p.deleting}
    _cannot_pull(w, "demo-r0-n1-g1")
    assert [r for _, r, _ in w.step().events] == [reasons.IMAGE_PULL_FAILED]
    w.set_pod("demo-r0-n1-g1", deleting=True)
    p = w.step()
    assert p.status.replicas[0].last_failure.reason == reasons.POD_DELETED and len(p.create) == 2
    w.pods = {n: p for n, p in w.pods.items() if not p.deleting}
    _cannot_pull(w, "demo-r0-n0-g2")
    assert [r for _, r, _ in w.step().events] == [reasons.IMAGE_PULL_FAILED]


def test_observe_pod_reads_an_image_the_kubelet_cannot_pull():
    pending = {"metadata": {"name": "p"}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "ok", "image": "a:1", "state": {"running": {}}},
        {"name": "t", "image": "t:nope", "state": {"waiting": {"reason": "ImagePullBackOff",
                                                               "message": "Back-off pulling image \"t:nope\""}}}]}}
    assert observe.observe_pod(pending).image_pull == ImagePull("t", "t:nope", "ImagePullBackOff",
                                                                 "Back-off pulling image \"t:nope\"")
    pending["status"]["containerStatuses"][1]["state"]["waiting"]["reason"] = "ContainerCreating"
    assert observe.observe_pod(pending).image_pull is None
