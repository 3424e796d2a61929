"""The replica policy (`reconcile.replicas.plan`), run against a small simulated world.
Each test asserts the state of the world, and that planning again without a change asks
for nothing new.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from reconcile_world import T0, World, cond, make_job
from transom import contract
from transom_operator import reasons
from transom_operator.reconcile import failures, observe
from transom_operator.reconcile.observe import ObservedNode, ObservedPod
from transom_operator.reconcile.replicas import plan


def test_first_pass_creates_every_pod_with_generation_zero():
    w = World(make_job())
    p = w.step()
    assert sorted(m["metadata"]["name"] for m in p.create) == [
        f"demo-r{r}-n{n}-g0" for r in range(3) for n in range(2)]
    assert p.delete == [] and p.status.state == "Pending" and p.status.healthy == "0/3"
    assert [r.state for r in p.status.replicas] == ["Pending"] * 3
    w.assert_quiet()


def test_running_job_is_ready_and_quiet():
    w = World(make_job()).running()
    s = w.job.status
    assert s.state == "Running" and s.healthy_replicas == 3 and s.healthy == "3/3" and s.total_restarts == 0
    assert cond(s, "Ready").status == "True" and cond(s, "Ready").reason == reasons.ALL_REPLICAS_HEALTHY
    assert cond(s, "Degraded").status == "False" and cond(s, "Failed").status == "False"
    assert [len(r.nodes) for r in s.replicas] == [2, 2, 2]
    w.assert_quiet()


def test_partial_creation_is_completed_not_counted_as_failure():
    w = World(make_job())
    w.step()
    del w.pods["demo-r1-n1-g0"]  # that create never reached the API server
    p = w.step()
    assert [m["metadata"]["name"] for m in p.create] == ["demo-r1-n1-g0"]
    assert p.status.total_restarts == 0 and p.events == []


FAILURES = [
    # what happens to replica 1's pod of rank 0, the failure reason, whether its node is excluded
    ("exit code", dict(phase="Failed", exit_code=1, reason="Error"), reasons.POD_FAILED, None),
    ("deleted", dict(deleting=True), reasons.POD_DELETED, None),
    # deleted, and the operator's pass sees it only after its container exited on the SIGTERM
    ("deleted, then exited", dict(deleting=True, phase="Failed", exit_code=143, reason="Error"),
     reasons.POD_DELETED, None),
    ("kubelet eviction", dict(phase="Failed", reason="Evicted"), reasons.POD_EVICTED, None),
    ("node lost", dict(phase="Failed", reason="NodeLost"), reasons.NODE_LOST, reasons.NODE_LOST),
    # verdicts come from the coordinator's part of status, about generation 0 of replica 1
    ("software verdict", dict(verdict={"reason": "Hang", "message": "no step for 600s"}),
     reasons.FLAGGED_BY_COORDINATOR, None),
    ("hardware verdict", dict(verdict={"reason": "GpuXid", "message": "Xid 79", "blame": "Node", "nodeRank": 0}),
     reasons.FLAGGED_BY_COORDINATOR, reasons.FLAGGED_BY_COORDINATOR),
    ("exited 0 early", dict(phase="Succeeded", exit_code=0, finished=T0 - timedelta(seconds=31)),
     reasons.EXITED_EARLY, None),
]


@pytest.mark.parametrize("what, change, reason, exclusion", FAILURES, ids=[f[0] for f in FAILURES])
def test_failed_replica_is_replaced_alone(what, change, reason, exclusion):
    w = World(make_job()).running()
    others = {n: p.uid for n, p in w.pods.items() if p.replica != 1}
    bad = w.pod_of(1)
    incarnation_nodes = sorted(p.node_name for p in w.pods.values() if p.replica == 1)
    if "verdict" in change:
        w.coordinator(step=10, verdicts=[{"replica": 1, "generation": 0, **change["verdict"]}])
    else:
        w.set_pod(bad.name, **change)
    expected_delete = [n for n in ["demo-r1-n0-g0", "demo-r1-n1-g0"] if not w.pods[n].deleting]
    p = w.step()
    assert sorted(p.delete) == expected_delete
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-r1-n0-g1", "demo-r1-n1-g1"]
    r1 = p.status.replicas[1]
    assert (r1.generation, r1.restarts, r1.state, r1.last_failure.reason) == (1, 1, "Replacing", reason)
    assert p.status.total_restarts == 1 and p.status.state == "Recovering"
    assert cond(p.status, "Recovering").status == "True"
    assert (reasons.WARNING, reasons.EVENT_REPLICA_FAILED) in [(t, r) for t, r, _ in p.events]
    if exclusion:
        assert p.excluded_nodes_added == [(bad.node_name, exclusion)]
        assert [(e.name, e.reason) for e in p.status.excluded_nodes] == [(bad.node_name, exclusion)]
        for m in p.create:
            terms = m["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [bad.node_name]
    else:
        assert p.excluded_nodes_added == [] and p.status.excluded_nodes == []
    for m in p.create:  # whatever the reason, the replacement prefers other nodes than the failed one's
        preferred = m["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert preferred == [{"weight": 100, "preference": {"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": incarnation_nodes}]}}]
    w.assert_quiet()
    w.settle()
    w.step()
    assert {n: p.uid for n, p in w.pods.items() if p.replica != 1} == others  # untouched
    assert w.job.status.state == "Running" and w.job.status.total_restarts == 1
    assert w.job.status.replicas[1].state == "Running"
    w.assert_quiet()


def test_pod_gone_without_trace_fails_a_running_replica():
    w = World(make_job()).running()
    del w.pods["demo-r2-n1-g0"]  # force-deleted between two passes
    p = w.step()
    assert p.status.replicas[2].last_failure.reason == reasons.POD_DELETED
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-r2-n0-g1", "demo-r2-n1-g1"]
    assert p.delete == ["demo-r2-n0-g0"]


def test_node_not_ready_waits_for_the_grace_period_then_excludes_the_node():
    w = World(make_job(ft={"nodeNotReadyGraceSeconds": 30})).running()
    bad = w.pod_of(0, rank=1)
    w.nodes[bad.node_name] = ObservedNode(bad.node_name, False, T0)
    w.now = T0 + timedelta(seconds=10)
    p = w.step()
    assert (p.create, p.delete) == ([], []) and p.requeue_after == pytest.approx(20)
    w.now = T0 + timedelta(seconds=31)
    p = w.step()
    assert p.status.replicas[0].last_failure.reason == reasons.NODE_NOT_READY
    assert p.excluded_nodes_added == [(bad.node_name, reasons.NODE_NOT_READY)]
    assert sorted(p.delete) == ["demo-r0-n0-g0", "demo-r0-n1-g0"]
    assert (reasons.WARNING, reasons.EVENT_NODE_EXCLUDED) in [(t, r) for t, r, _ in p.events]
    w.assert_quiet()
    w.settle()
    w.step()
    assert bad.node_name not in {q.node_name for q in w.pods.values()}
    assert w.job.status.state == "Running"


def test_exclusion_policy_none_excludes_nothing():
    w = World(make_job(ft={"nodeExclusionPolicy": "None"})).running()
    w.set_pod(w.pod_of(0).name, phase="Failed", reason="NodeLost")
    p = w.step()
    assert p.excluded_nodes_added == [] and len(p.create) == 2


def test_second_failure_on_the_same_node_excludes_it():
    w = World(make_job()).running()
    first = w.pod_of(0)
    w.set_pod(first.name, phase="Failed", exit_code=1)
    assert w.step().excluded_nodes_added == []
    w.settle()
    w.step()
    # replica 2 now fails on the node replica 0 failed on
    victim = w.pod_of(2)
    w.pods[victim.name] = replace(victim, node_name=first.node_name, phase="Failed", exit_code=1)
    p = w.step()
    assert p.excluded_nodes_added == [(first.node_name, reasons.REPEATED_FAILURES)]


def test_backoff_doubles_after_the_first_replacement():
    w = World(make_job(ft={"backoffSeconds": 10, "maxBackoffSeconds": 15})).running()
    expected_waits = [0, 10, 15]
    for i, wait in enumerate(expected_waits):
        w.set_pod(f"demo-r1-n0-g{i}", phase="Failed", exit_code=1)
        p = w.step()
        assert len(p.delete) == 2
        if wait == 0:
            assert len(p.create) == 2
        else:
            assert p.create == [] and p.requeue_after == pytest.approx(wait)
            assert p.status.replicas[1].state == "Replacing"
            w.assert_quiet()
            w.now += timedelta(seconds=wait)
            p = w.step()
            assert sorted(m["metadata"]["name"] for m in p.create) == [f"demo-r1-n0-g{i+1}", f"demo-r1-n1-g{i+1}"]
            assert (reasons.NORMAL, reasons.EVENT_REPLICA_REPLACED) in [(t, r) for t, r, _ in p.events]
        w.settle()
        w.step()
        w.now += timedelta(seconds=1)


def test_too_many_restarts_fails_the_job_and_stops_acting():
    w = World(make_job(ft={"maxReplicaRestarts": 1})).running()
    w.set_pod("demo-r0-n0-g0", phase="Failed", exit_code=1)
    assert len(w.step().create) == 2
    w.settle()
    w.step()
    w.set_pod("demo-r1-n0-g0", phase="Failed", exit_code=1)
    live = sorted(n for n, pod in w.pods.items() if not pod.deleting)
    p = w.step()
    # The failed job stops: every worker pod is deleted, nothing is created.
    assert p.create == [] and sorted(p.delete) == live
    assert p.status.state == "Failed" and p.status.total_restarts == 1
    failed = cond(p.status, "Failed")
    assert failed.status == "True" and failed.reason == reasons.TOO_MANY_RESTARTS
    assert p.status.replicas[1].state == "Failed"
    assert [r for _, r, _ in p.events] == [reasons.EVENT_JOB_FAILED]
    w.settle()
    assert w.pods == {}
    p = w.step()
    assert (p.create, p.delete) == ([], []) and p.status.state == "Failed"
    w.assert_quiet()  # final: nothing more happens


def test_restarts_outside_the_window_do_not_count():
    w = World(make_job(ft={"maxReplicaRestarts": 1, "restartWindowSeconds": 60})).running()
    w.set_pod("demo-r0-n0-g0", phase="Failed", exit_code=1)
    w.step()
    w.settle()
    w.step()
    w.now += timedelta(seconds=61)
    w.set_pod("demo-r1-n0-g0", phase="Failed", exit_code=1)
    p = w.step()
    assert p.status.state == "Recovering" and len(p.create) == 2 and p.status.total_restarts == 2
    assert len(p.status.restart_history) == 1  # the old record was pruned


def test_fewer_than_min_replicas_is_degraded():
    w = World(make_job(replicas=3, minReplicas=3, ft={"backoffSeconds": 0})).running()
    w.set_pod("demo-r0-n0-g0", phase="Failed", exit_code=1)
    p = w.step()
    assert p.status.state == "Degraded" and p.status.healthy == "2/3"
    d = cond(p.status, "Degraded")
    assert d.status == "True" and d.reason == reasons.BELOW_MIN_REPLICAS
    assert (reasons.WARNING, reasons.EVENT_JOB_DEGRADED) in [(t, r) for t, r, _ in p.events]
    w.assert_quiet()
    w.settle()
    w.step()
    assert w.job.status.state == "Running" and cond(w.job.status, "Degraded").status == "False"


def test_starting_job_below_min_replicas_is_pending_not_degraded():
    w = World(make_job())
    w.step()
    assert w.job.status.state == "Pending" and cond(w.job.status, "Degraded").status == "False"


def test_all_pods_succeeded_is_succeeded_once_the_coordinator_recorded_completion():
    w = World(make_job()).running()
    w.coordinator(step=100, completedStep=100)
    for name in list(w.pods):
        w.set_pod(name, phase="Succeeded", exit_code=0, finished=T0)
    p = w.step()
    assert p.status.state == "Succeeded" and cond(p.status, "Succeeded").status == "True"
    assert (reasons.NORMAL, reasons.EVENT_JOB_SUCCEEDED, "training finished") in p.events
    assert (p.create, p.delete) == ([], [])
    w.assert_quiet()


def test_pods_that_exit_0_before_completion_wait_for_the_record_then_are_replaced():
    w = World(make_job()).running()
    for name in list(w.pods):
        w.set_pod(name, phase="Succeeded", exit_code=0, finished=T0)
    w.now = T0 + timedelta(seconds=10)
    p = w.step()  # the coordinator's record may still be on its way
    assert (p.create, p.delete) == ([], []) and p.status.state != "Succeeded"
    assert p.requeue_after == pytest.approx(20)
    w.now = T0 + timedelta(seconds=31)
    p = w.step()
    assert p.status.state != "Succeeded" and len(p.create) == 6 and p.status.total_restarts == 3
    assert {r.last_failure.reason for r in p.status.replicas} == {reasons.EXITED_EARLY}


def test_a_replica_that_exited_0_does_not_stop_the_others_from_being_replaced():
    # The job is done only when the coordinator says so, not when one replica's pods exit 0.
    w = World(make_job()).running()
    for rank in (0, 1):
        w.set_pod(f"demo-r0-n{rank}-g0", phase="Succeeded", exit_code=0, finished=T0)
    w.set_pod("demo-r2-n1-g0", phase="Failed", exit_code=1)
    p = w.step()
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-r2-n0-g1", "demo-r2-n1-g1"]
    assert p.status.state == "Recovering" and p.status.replicas[2].last_failure.reason == reasons.POD_FAILED


def test_failure_after_training_finished_is_not_replaced():
    w = World(make_job()).running()
    w.coordinator(step=100, completedStep=100)
    for name in list(w.pods):
        w.set_pod(name, phase="Succeeded", exit_code=0, finished=T0)
    w.set_pod("demo-r2-n1-g0", phase="Failed", exit_code=1)
    p = w.step()
    assert p.create == [] and p.status.state == "Succeeded"
    assert [r.state for r in p.status.replicas] == ["Succeeded", "Succeeded", "Failed"]


def test_completed_job_deletes_pods_not_yet_running_and_waits_for_the_running_ones():
    w = World(make_job()).running()
    w.set_pod("demo-r1-n0-g0", phase="Failed", exit_code=1)
    w.step()  # replica 1 is being replaced: its new pods are Pending
    w.coordinator(step=100, completedStep=100)
    for name in ("demo-r0-n0-g0", "demo-r0-n1-g0"):
        w.set_pod(name, phase="Succeeded", exit_code=0, finished=T0)
    p = w.step()
    assert p.create == [] and sorted(p.delete) == ["demo-r1-n0-g1", "demo-r1-n1-g1"]
    assert p.status.state == "Running"  # replica 2 still runs; it is told "job completed"
    w.settle()
    for name in ("demo-r2-n0-g0", "demo-r2-n1-g0"):
        w.set_pod(name, phase="Succeeded", exit_code=0, finished=T0)
    p = w.step()
    assert p.status.state == "Succeeded" and p.create == []
    w.assert_quiet()


def test_pod_annotations_are_not_verdicts():
    # Whoever can patch pods (or write the template) must not be able to replace replicas or
    # exclude nodes: the operator reads no annotation as a verdict.
    w = World(make_job(ft={"nodeExclusionPolicy": "Cordon"})).running()
    raw = {
        "metadata": {"name": "demo-r1-n0-g0", "uid": "u", "annotations": {
            "transom.io/evict-reason": "hardware: GPU Xid 79", "transom.io/restart-history": "[[1,0,0,\"n1\"]]"},
            "labels": {contract.LABEL_REPLICA: "1", contract.LABEL_NODE_RANK: "0", contract.LABEL_GENERATION: "0"}},
        "spec": {"nodeName": w.pod_of(1).node_name}, "status": {"phase": "Running"},
    }
    w.pods["demo-r1-n0-g0"] = replace(observe.observe_pod(raw), uid=w.pod_of(1).uid)
    p = w.step()
    assert (p.create, p.delete, p.excluded_nodes_added) == ([], [], [])
    assert p.status.total_restarts == 0
    w.assert_quiet()


def test_a_verdict_about_an_older_generation_is_ignored():
    w = World(make_job()).running()
    w.coordinator(step=5, verdicts=[{"replica": 1, "generation": 0, "reason": "Hang"}])
    assert len(w.step().create) == 2  # generation 0 replaced
    w.settle()
    w.step()
    p = w.step()  # the verdict still names generation 0: generation 1 stays
    assert (p.create, p.delete) == ([], []) and p.status.replicas[1].generation == 1
    w.assert_quiet()


def test_suspend_deletes_every_pod_and_resumes_with_the_next_generation():
    w = World(make_job()).running()
    w.job = w.job.model_copy(update={"spec": w.job.spec.model_copy(update={"suspend": True})})
    p = w.step()
    assert len(p.delete) == 6 and p.create == [] and p.status.state == "Suspended"
    assert [r.generation for r in p.status.replicas] == [1, 1, 1]
    w.assert_quiet()
    w.settle()
    w.step()
    w.assert_quiet()
    w.job = w.job.model_copy(update={"spec": w.job.spec.model_copy(update={"suspend": False})})
    p = w.step()
    assert sorted(m["metadata"]["name"] for m in p.create) == [
        f"demo-r{r}-n{n}-g1" for r in range(3) for n in range(2)]
    assert p.status.total_restarts == 0


def test_scale_down_deletes_the_extra_replicas_pods():
    w = World(make_job()).running()
    w.job = w.job.model_copy(update={"spec": w.job.spec.model_copy(update={"replicas": 2})})
    p = w.step()
    assert sorted(p.delete) == ["demo-r2-n0-g0", "demo-r2-n1-g0"]
    assert len(p.status.replicas) == 2 and p.status.healthy == "2/2"


def test_operator_restart_mid_recovery_converges():
    """Status written, pods not yet deleted nor created (the operator died between): the next
    operator finishes the replacement without counting it twice."""
    w = World(make_job()).running()
    w.set_pod("demo-r1-n0-g0", phase="Failed", exit_code=1)
    p = plan(w.job, list(w.pods.values()), w.nodes, w.now)
    w.job = w.job.model_copy(update={"status": p.status})  # only the status made it
    again = w.step()
    assert sorted(again.delete) == ["demo-r1-n0-g0", "demo-r1-n1-g0"]
    assert sorted(m["metadata"]["name"] for m in again.create) == ["demo-r1-n0-g1", "demo-r1-n1-g1"]
    assert again.status.total_restarts == 1 and again.events == [(
        reasons.NORMAL, reasons.EVENT_REPLICA_REPLACED, "Creating replica 1 generation 1")]
    w.assert_quiet()


def test_stale_pods_of_an_older_generation_are_deleted():
    w = World(make_job()).running()
    w.pods["demo-r0-n0-g7"] = replace(w.pod_of(0), name="demo-r0-n0-g7", generation=7, uid="x")
    p = w.step()
    # the replica's current generation is now 7: its generation-0 pods go, rank 1 is created
    assert sorted(p.delete) == ["demo-r0-n0-g0", "demo-r0-n1-g0"]
    assert [m["metadata"]["name"] for m in p.create] == ["demo-r0-n1-g7"]


# --- observe --------------------------------------------------------------------------

def test_observe_pod_parses_the_api_object():
    raw = {
        "metadata": {
            "name": "demo-r1-n0-g2", "uid": "u", "creationTimestamp": "2025-01-01T00:00:00Z",
            "deletionTimestamp": "2025-01-01T00:01:00Z",
            "labels": {contract.LABEL_REPLICA: "1", contract.LABEL_NODE_RANK: "0", contract.LABEL_GENERATION: "2"},
        },
        "spec": {"nodeName": "n3"},
        "status": {"phase": "Failed", "containerStatuses": [
            {"name": "a", "state": {"running": {}}},
            {"name": "b", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                                   "finishedAt": "2025-01-01T00:00:00Z"}}},
        ]},
    }
    assert observe.observe_pod(raw) == ObservedPod(
        name="demo-r1-n0-g2", uid="u", replica=1, spare=None, node_rank=0, generation=2, phase="Failed",
        node_name="n3", deleting=True, exit_code=137, reason="OOMKilled", created=T0, finished=T0,
    )


def test_observe_pod_tolerates_a_bare_object():
    pod = observe.observe_pod({"metadata": {"name": "x", "labels": {contract.LABEL_REPLICA: "a"}}})
    assert (pod.replica, pod.phase, pod.node_name, pod.deleting, pod.exit_code) == (None, "Pending", None, False, None)


@pytest.mark.parametrize("conditions, expected", [
    ([{"type": "Ready", "status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z"}], (True, None)),
    ([{"type": "Ready", "status": "Unknown", "lastTransitionTime": "2025-01-01T00:00:00Z"}], (False, T0)),
    ([{"type": "MemoryPressure", "status": "False"},
      {"type": "Ready", "status": "False", "lastTransitionTime": "2025-01-01T00:00:00Z"}], (False, T0)),
    ([], (False, None)),
])
def test_observe_node(conditions, expected):
    node = observe.observe_node({"metadata": {"name": "n1"}, "status": {"conditions": conditions}})
    assert (node.name, node.ready, node.not_ready_since) == ("n1", *expected)


@pytest.mark.parametrize("n, expected", [(0, 0), (1, 0), (2, 10), (3, 20), (4, 40), (5, 60), (60, 60)])
def test_backoff_seconds(n, expected):
    assert failures.backoff_seconds(n, backoff=10, max_backoff=60) == expected


def test_replicas_the_coordinator_found_diverged_are_a_condition():
    w = World(make_job()).running()
    c = cond(w.step().status, "Diverged")
    assert (c.status, c.reason) == ("False", "ReplicasAgree")
    said = "replicas 0, 1 hold different parameters or optimizer state at step 44 (rank 0) and no majority says " \
           "which is right"
    w.coordinator(step=50, diverged=said)
    c = cond(w.step().status, "Diverged")
    assert (c.status, c.reason, c.message) == ("True", "ReplicasDiverged", said)


def test_checkpoint_trouble_is_a_condition_and_an_event_when_it_starts_and_ends():
    w = World(make_job()).running()
    assert cond(w.step().status, "CheckpointTrouble").status == "False"
    said = "replica 0: rank 1: writing part 1 of step 40: ClientConnectorError"
    w.coordinator(step=40, checkpointTrouble=said)
    p = w.step()
    c = cond(p.status, "CheckpointTrouble")
    assert (c.status, c.reason, c.message) == ("True", "StorageFailing", said)
    assert [(e[0], e[1]) for e in p.events] == [("Warning", "CheckpointTrouble")] and said in p.events[0][2]
    assert w.step().events == []  # still failing: no new Event
    w.coordinator(step=45)  # written again: status.training without it
    p = w.step()
    assert cond(p.status, "CheckpointTrouble").reason == "CheckpointsOK"
    assert [(e[0], e[1]) for e in p.events] == [("Normal", "CheckpointsWritten")]


def test_rebalanced_shares_are_a_condition_and_an_event_when_they_change():
    w = World(make_job()).running()
    assert cond(w.step().status, "Rebalanced").status == "False"
    w.coordinator(step=5, batchSharePercent=[112, 75, 113])
    p = w.step()
    c = cond(p.status, "Rebalanced")
    assert (c.status, c.reason) == ("True", "SlowReplicaRebalanced") and "replica 1 75%" in c.message
    assert [e[1] for e in p.events] == ["Rebalanced"] and (p.create, p.delete) == ([], [])
    assert w.step().events == []  # the same shares: no new Event
    w.coordinator(step=9)  # back to nominal: status.training without the shares
    p = w.step()
    assert cond(p.status, "Rebalanced").status == "False" and [e[1] for e in p.events] == ["Rebalanced"]
    w.assert_quiet()


@pytest.mark.parametrize("what, change, reason, exclusion", [FAILURES[0], FAILURES[3]], ids=["pod failed", "node lost"])
def test_operator_killed_between_the_creates_and_the_status_write_loses_no_restart(what, change, reason, exclusion):
    """The creates go out with the status write (controller.py); only they reached the API
    server. The next pass finds the failed incarnation's pods (nothing deleted them) and
    records the replacement as the cut pass would have."""
    w = World(make_job()).running()
    bad = w.pod_of(1)
    w.set_pod(bad.name, **change)
    cut = plan(w.job, list(w.pods.values()), w.nodes, w.now)
    for manifest in cut.create:  # the creates only: no deletes, no status
        pod = observe.observe_pod({**manifest,
                                   "metadata": {**manifest["metadata"], "uid": manifest["metadata"]["name"]}})
        w.pods[pod.name] = pod
    assert w.job.status.replicas[1].generation == 0
    p = w.step()
    r1 = p.status.replicas[1]
    assert (r1.generation, r1.restarts, r1.state, r1.last_failure.reason) == (1, 1, "Replacing", reason)
    assert p.status.total_restarts == 1 and [(h.replica, h.generation) for h in p.status.restart_history] == [(1, 0)]
    assert sorted(p.delete) == ["demo-r1-n0-g0", "demo-r1-n1-g0"] and p.create == []
    assert (reasons.WARNING, reasons.EVENT_REPLICA_FAILED) in [(t, r) for t, r, _ in p.events]
    if exclusion:
        assert [(e.name, e.reason) for e in p.status.excluded_nodes] == [(bad.node_name, exclusion)]
    w.settle()
    w.step()
    assert w.job.status.state == "Running" and w.job.status.total_restarts == 1
    assert w.job.status.replicas[1].restarts == 1 and w.job.status.replicas[1].last_failure.reason == reason
    w.assert_quiet()


def test_a_deleted_pod_whose_replacement_was_not_recorded_is_still_counted():
    """The failure itself was a deleted pod (gone, as with a force delete): the recorded
    incarnation lacks it, which is the failure the next pass finds."""
    w = World(make_job()).running()
    del w.pods["demo-r1-n0-g0"]
    cut = plan(w.job, list(w.pods.values()), w.nodes, w.now)
    for manifest in cut.create:
        pod = observe.observe_pod({**manifest,
                                   "metadata": {**manifest["metadata"], "uid": manifest["metadata"]["name"]}})
        w.pods[pod.name] = pod
    p = w.step()
    r1 = p.status.replicas[1]
    assert (r1.generation, r1.restarts, r1.last_failure.reason) == (1, 1, reasons.POD_DELETED)
    assert p.delete == ["demo-r1-n1-g0"]
    w.settle()
    w.step()
    assert w.job.status.total_restarts == 1
    w.assert_quiet()
