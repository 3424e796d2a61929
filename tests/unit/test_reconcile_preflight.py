"""Pre-flight failures in the replica policy (`reconcile.replicas.plan`): a pod whose launcher
exited contract.EXIT_PREFLIGHT_FAILED (a check failed on its node before its workers
started) fails its replica with `PreflightFailed`, its node is excluded and the replica is
placed elsewhere; a spare whose check failed (at its start or a periodic one) is never
promoted, its node is excluded and the spare is made again elsewhere.
"""

from __future__ import annotations

from prometheus_client import generate_latest

from reconcile_world import World, make_job
from transom import contract
from transom_operator import metrics, reasons
from transom_operator.reconcile import failures

MESSAGE = "PreflightFailed: compute: max relative error 0.5 (expected <= 1e-04)"
FAILED = dict(phase="Failed", exit_code=contract.EXIT_PREFLIGHT_FAILED, reason="Error", message=MESSAGE)


def _affinity_excludes(manifest: dict, node: str) -> bool:
    terms = manifest["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return node in terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]


def test_a_pod_that_fails_its_preflight_excludes_its_node_and_the_replica_goes_elsewhere():
    w = World(make_job()).running()
    bad = w.pod_of(1)
    w.set_pod(bad.name, **FAILED)
    p = w.step()
    r1 = p.status.replicas[1]
    assert (r1.generation, r1.state, r1.last_failure.reason) == (1, "Replacing", reasons.PREFLIGHT_FAILED)
    assert MESSAGE in r1.last_failure.message and bad.node_name in r1.last_failure.message
    assert p.excluded_nodes_added == [(bad.node_name, reasons.PREFLIGHT_FAILED)]
    created = [m for m in p.create if m["metadata"]["name"].startswith("demo-r1-")]
    assert len(created) == 2 and all(_affinity_excludes(m, bad.node_name) for m in created)
    failed = [m for t, r, m in p.events if (t, r) == (reasons.WARNING, reasons.EVENT_REPLICA_FAILED)]
    assert len(failed) == 1 and "compute: max relative error 0.5" in failed[0]
    w.assert_quiet()


def test_a_spare_that_fails_its_preflight_is_never_promoted_and_its_node_is_excluded():
    w = World(make_job(spareReplicas=1, ft={"backoffSeconds": 0}), num_nodes=12).running()
    spare = next(p for p in w.pods.values() if p.spare == 0 and p.node_rank == 0)
    w.set_pod(spare.name, **FAILED)  # a periodic check while it waited
    w.set_pod("demo-r2-n0-g0", phase="Failed", exit_code=1)  # and then a replica fails
    p = w.step()
    assert p.relabel == []  # not promoted: replaced by new pods instead
    assert {"demo-r2-n0-g1", "demo-r2-n1-g1", "demo-s0-n0-g1", "demo-s0-n1-g1"} <= {
        m["metadata"]["name"] for m in p.create}
    assert (spare.node_name, reasons.PREFLIGHT_FAILED) in p.excluded_nodes_added
    assert p.status.spares[0].last_failure.reason == reasons.PREFLIGHT_FAILED
    assert MESSAGE in p.status.spares[0].last_failure.message
    refill = next(m for m in p.create if m["metadata"]["name"] == "demo-s0-n0-g1")
    assert _affinity_excludes(refill, spare.node_name)
    assert p.status.total_restarts == 1  # the replica's; a spare's failure is no restart


def test_the_metric_counts_the_checks_a_failure_names_and_nothing_else():
    assert failures.preflight_checks(MESSAGE) == ["compute"]
    assert failures.preflight_checks("PreflightFailed: memory: 3 wrong; storage: 403") == ["memory", "storage"]
    assert failures.preflight_checks("PreflightFailed: made-up: x") == []
    text = generate_latest(metrics.REGISTRY).decode()
    for check in contract.PREFLIGHT_CHECKS:
        assert f'transom_operator_preflight_failures_total{{check="{check}"}}' in text
