"""The replicas' PodDisruptionBudget (transom_operator.disruption): whom it covers, how many
pods it lets a drain take, and the patch that makes it follow the job's size."""

from __future__ import annotations

import pytest

from reconcile_world import make_job
from transom_operator import api, disruption, resources


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes' label selector semantics, for the operators the budget uses."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        assert e["operator"] == "Exists", e
        if e["key"] not in labels:
            return False
    return True


def test_the_budget_covers_the_replicas_pods_not_the_spares_nor_the_coordinator_nor_other_jobs():
    job = make_job(spareReplicas=1)
    budget = disruption.worker_budget(job)
    assert (budget["apiVersion"], budget["kind"], budget["metadata"]["name"]) == (
        "policy/v1", "PodDisruptionBudget", "demo-workers")
    assert budget["metadata"]["namespace"] == "ml"
    assert budget["metadata"]["ownerReferences"] == [resources.owner_reference(job)]  # it goes with the job
    selector = budget["spec"]["selector"]
    assert selects(selector, resources.worker_pod(job, 2, 1, 7)["metadata"]["labels"])
    spare = resources.spare_pod(job, 0, 0, 0)["metadata"]["labels"]
    assert not selects(selector, spare)
    promoted = {k: v for k, v in {**spare, **resources.promotion_labels(1, 3)}.items() if v is not None}
    assert selects(selector, promoted)  # a promoted spare is the replica's from then on
    deployment = resources.coordinator_deployment(job, "transom:1")
    assert not selects(selector, deployment["spec"]["template"]["metadata"]["labels"])
    other = make_job().model_copy(update={"metadata": {**job.metadata, "name": "other"}})
    assert not selects(selector, resources.worker_pod(other, 0, 0, 0)["metadata"]["labels"])


@pytest.mark.parametrize("replicas, nodes_per_replica, min_available", [(3, 2, 5), (8, 1, 7), (1, 4, 3), (1, 1, 0)])
def test_a_drain_may_take_one_pod_and_so_one_replica_at_a_time(replicas, nodes_per_replica, min_available):
    """Once one pod of a replica is evicted the operator takes the rest of it down itself and
    starts the next generation, whose pods are not Ready yet: the next eviction waits for them."""
    job = make_job(replicas=replicas, minReplicas=1, nodesPerReplica=nodes_per_replica)
    spec = disruption.worker_budget(job)["spec"]
    assert spec["minAvailable"] == min_available and "maxUnavailable" not in spec
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a pod that is not Ready never blocks a drain


def test_the_patch_follows_the_jobs_size_and_is_none_when_nothing_changed():
    small = disruption.worker_budget(make_job())
    as_read = {**small, "spec": {**small["spec"]}, "status": {"disruptionsAllowed": 1}}
    assert disruption.spec_patch(as_read, small) is None
    bigger = disruption.worker_budget(make_job(replicas=4))
    assert disruption.spec_patch(as_read, bigger) == {"spec": {"minAvailable": 7}}
    by_hand = {"spec": {**small["spec"], "maxUnavailable": 2}}
    del by_hand["spec"]["minAvailable"]
    assert disruption.spec_patch(by_hand, small) == {"spec": {"minAvailable": 5, "maxUnavailable": None}}


def test_the_budget_name_fits_every_job_name():
    job = make_job().model_copy(update={"metadata": {"name": "j" * api.MAX_JOB_NAME, "namespace": "ml", "uid": "u"}})
    assert len(disruption.worker_budget(job)["metadata"]["name"]) <= 63
