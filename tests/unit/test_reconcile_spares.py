"""Hot spares in the replica policy: created, kept Ready, promoted at once, refilled, cleaned up."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from reconcile_world import World, make_job
from transom import contract
from transom_operator import api, reasons, resources
from transom_operator.reconcile.replicas import plan


def spare_world(**spec) -> World:
    spec.setdefault("spareReplicas", 1)
    return World(make_job(**spec), num_nodes=12).running()


def spare_pods(w: World, spare: int = 0) -> list:
    return sorted((p for p in w.pods.values() if p.spare == spare and not p.deleting), key=lambda p: p.node_rank)


def test_spares_are_created_with_the_job_and_become_ready():
    w = World(make_job(spareReplicas=1))
    p = w.step()
    assert sorted(m["metadata"]["name"] for m in p.create if "-s" in m["metadata"]["name"]) == [
        "demo-s0-n0-g0", "demo-s0-n1-g0"]
    assert [s.state for s in p.status.spares] == ["Pending"] and p.status.ready_spare_replicas == 0
    w.settle()
    w.step()
    s = w.job.status
    assert s.ready_spare_replicas == 1 and s.spares[0].state == "Ready" and len(s.spares[0].nodes) == 2
    assert s.state == "Running" and s.healthy == "3/3"
    w.assert_quiet()


def test_failed_replica_is_taken_over_by_the_ready_spare_at_once():
    w = spare_world(ft={"backoffSeconds": 30, "maxBackoffSeconds": 60})
    spare_uids = {p.node_rank: p.uid for p in spare_pods(w)}
    others = {p.name: p.uid for p in w.pods.values() if p.replica in (0, 2)}
    w.set_pod("demo-r1-n0-g0", phase="Failed", exit_code=1)
    p = w.step()

    assert sorted(p.relabel) == [
        ("demo-s0-n0-g0", {contract.LABEL_SPARE: None, contract.LABEL_REPLICA: "1", contract.LABEL_GENERATION: "1"}),
        ("demo-s0-n1-g0", {contract.LABEL_SPARE: None, contract.LABEL_REPLICA: "1", contract.LABEL_GENERATION: "1"}),
    ]
    assert sorted(p.delete) == ["demo-r1-n0-g0", "demo-r1-n1-g0"]
    # Nothing is created for the replica; the spare is refilled as its next generation.
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-s0-n0-g1", "demo-s0-n1-g1"]
    assert (reasons.NORMAL, reasons.EVENT_SPARE_PROMOTED, "Spare 0 took over replica 1 as generation 1") in p.events
    r1 = p.status.replicas[1]
    # Replacing until a pass sees the relabelled pods (then Running, without anything starting).
    assert (r1.generation, r1.state, r1.restarts, r1.last_failure.reason) == (1, "Replacing", 1, reasons.POD_FAILED)
    assert p.status.total_restarts == 1
    assert p.status.spares[0].generation == 1 and p.status.ready_spare_replicas == 0

    # The replica's pods are the spare's pods (same uids); the other replicas are untouched.
    assert {p.node_rank: p.uid for p in w.pods.values() if p.replica == 1 and not p.deleting} == spare_uids
    assert {n: w.pods[n].uid for n in others} == others
    p = w.step()
    assert p.create == [] and p.status.replicas[1].state == "Running" and p.status.state == "Running"
    w.settle()
    w.step()
    assert w.job.status.ready_spare_replicas == 1
    assert [p.name for p in spare_pods(w)] == ["demo-s0-n0-g1", "demo-s0-n1-g1"]
    w.assert_quiet()


def test_without_a_ready_spare_the_replica_is_replaced_normally():
    w = World(make_job(spareReplicas=1), num_nodes=12)
    w.step()
    for name in [n for n, pod in w.pods.items() if pod.replica is not None]:  # the spare stays Pending
        w.set_pod(name, phase="Running", node_name=f"n{name[6]}{name[9]}")
    w.step()
    w.set_pod("demo-r2-n1-g0", phase="Failed", exit_code=1)
    p = w.step()
    assert p.relabel == []
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-r2-n0-g1", "demo-r2-n1-g1"]
    assert p.status.replicas[2].state == "Replacing" and p.status.state == "Recovering"


def test_two_failures_use_two_spares_then_fall_back():
    w = spare_world(spareReplicas=2)
    w.set_pod("demo-r0-n0-g0", phase="Failed", exit_code=1)
    w.set_pod("demo-r2-n0-g0", phase="Failed", exit_code=1)
    p = w.step()
    promoted = {labels[contract.LABEL_REPLICA] for _, labels in p.relabel}
    assert promoted == {"0", "2"} and len(p.relabel) == 4
    assert all(m["metadata"]["name"].startswith("demo-s") for m in p.create)
    w.settle()
    w.step()
    # Both spares are back; a failure right now takes one of them again.
    assert w.job.status.ready_spare_replicas == 2
    w.assert_quiet()


def test_spare_on_a_node_excluded_by_the_failure_is_not_promoted_and_is_replaced():
    w = spare_world(ft={"backoffSeconds": 0, "nodeNotReadyGraceSeconds": 10})
    spare_node = spare_pods(w)[0].node_name
    # The replica's pod and the spare share the node that dies.
    w.set_pod("demo-r1-n0-g0", node_name=spare_node)
    w.nodes[spare_node] = replace(w.nodes[spare_node], ready=False, not_ready_since=w.now - timedelta(seconds=60))
    p = w.step()
    assert p.relabel == []
    created = {m["metadata"]["name"] for m in p.create}
    assert {"demo-r1-n0-g1", "demo-r1-n1-g1", "demo-s0-n0-g1", "demo-s0-n1-g1"} <= created
    assert spare_node in {e.name for e in p.status.excluded_nodes}
    assert p.status.spares[0].last_failure.reason == reasons.NODE_EXCLUDED
    spare_manifest = next(m for m in p.create if m["metadata"]["name"] == "demo-s0-n0-g1")
    terms = spare_manifest["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert spare_node in terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]


def test_failed_spare_is_replaced_after_backoff_without_counting_a_restart():
    w = spare_world(ft={"backoffSeconds": 20, "maxBackoffSeconds": 60})
    w.set_pod("demo-s0-n1-g0", phase="Failed", exit_code=2)
    p = w.step()
    assert sorted(p.delete) == ["demo-s0-n0-g0", "demo-s0-n1-g0"] and p.create == []
    assert p.requeue_after == 20
    assert p.status.total_restarts == 0 and p.status.spares[0].generation == 1
    assert p.status.spares[0].last_failure.reason == reasons.POD_FAILED
    w.settle()
    w.now += timedelta(seconds=21)
    p = w.step()
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-s0-n0-g1", "demo-s0-n1-g1"]


def test_suspend_and_scale_down_delete_spares():
    w = spare_world(spareReplicas=2)
    w.job = w.job.model_copy(update={"spec": w.job.spec.model_copy(update={"spare_replicas": 1})})
    p = w.step()
    assert sorted(p.delete) == ["demo-s1-n0-g0", "demo-s1-n1-g0"]
    w.settle()
    w.job = w.job.model_copy(update={"spec": w.job.spec.model_copy(update={"suspend": True})})
    p = w.step()
    assert {"demo-s0-n0-g0", "demo-s0-n1-g0"} <= set(p.delete)
    assert not any(m["metadata"]["name"].startswith("demo-s") for m in p.create)
    assert p.status.ready_spare_replicas == 0


def test_job_that_fails_deletes_its_spares():
    w = spare_world(ft={"maxReplicaRestarts": 0})
    w.job = w.job.model_copy(update={"status": w.job.status.model_copy(update={"spares": []})})
    w.set_pod("demo-r0-n0-g0", phase="Failed", exit_code=1)
    # maxReplicaRestarts 0: the first failure fails the job; no spare is promoted.
    p = w.step()
    assert p.status.state == "Failed" and p.relabel == []
    assert {"demo-s0-n0-g0", "demo-s0-n1-g0"} <= set(p.delete)


def test_operator_killed_between_status_and_relabel_converges():
    w = spare_world()
    w.set_pod("demo-r1-n0-g0", phase="Failed", exit_code=1)
    p = plan(w.job, list(w.pods.values()), w.nodes, w.now)
    # Only the status write reached the API server before the crash.
    w.job = w.job.model_copy(update={"status": api.TrainingJobStatus.model_validate(p.status_patch())})
    p = w.step()
    # The spare's old generation is now stale: deleted; the replica's pods are created anew.
    assert {"demo-s0-n0-g0", "demo-s0-n1-g0", "demo-r1-n0-g0", "demo-r1-n1-g0"} <= set(p.delete)
    created = {m["metadata"]["name"] for m in p.create}
    assert {"demo-r1-n0-g1", "demo-r1-n1-g1", "demo-s0-n0-g1", "demo-s0-n1-g1"} <= created
    w.settle()
    w.step()
    assert w.job.status.state == "Running" and w.job.status.ready_spare_replicas == 1
    assert w.job.status.total_restarts == 1
    w.assert_quiet()


def test_spare_pod_manifest():
    job = make_job(spareReplicas=1, checkpoint={"uri": "s3://b/ckpt"})
    pod = resources.spare_pod(job, 0, 1, 4)
    meta = pod["metadata"]
    assert meta["name"] == "demo-s0-n1-g4"
    assert {k: v for k, v in meta["labels"].items() if k.startswith("transom.io/")} == {
        contract.LABEL_JOB: "demo", contract.LABEL_SPARE: "0", contract.LABEL_NODE_RANK: "1",
        contract.LABEL_GENERATION: "4"}
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert contract.ENV_REPLICA_ID not in env and contract.ENV_REPLICA_GENERATION not in env
    assert env[contract.ENV_SPARE_ID] == "0" and env[contract.ENV_NODE_RANK] == "1"
    assert env[contract.ENV_PODINFO_DIR] == contract.PODINFO_DIR
    assert env[contract.ENV_CHECKPOINT_URI] == "s3://b/ckpt"
    assert container["volumeMounts"] == [
        {"name": resources.IDENTITY_VOLUME, "mountPath": contract.IDENTITY_TOKEN_DIR, "readOnly": True},
        {"name": resources.PODINFO_VOLUME, "mountPath": contract.PODINFO_DIR, "readOnly": True}]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert set(volumes) == {resources.IDENTITY_VOLUME, resources.PODINFO_VOLUME}  # its identity follows its labels
    assert volumes[resources.PODINFO_VOLUME]["downwardAPI"]["items"] == [
        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
    assert pod["spec"]["restartPolicy"] == "Never"
