"""The PodDisruptionBudget of a job's replicas: a drain takes one replica at a time.

A voluntary disruption (`kubectl drain`, a cluster autoscaler's scale-down, anything else
that goes through the eviction API) evicts a pod only where the budget allows it. The
operator gives every job one budget, `<job>-workers`, owned by the job:

- It selects the pods of the job's replicas (`transom.io/job=<job>` and a
  `transom.io/replica` label), not the hot spares' pods (`transom.io/spare`, no replica
  label): a spare holds no part of the training, so evicting one costs the job nothing but
  its refill, and counting spares as healthy would let a drain take a second replica while
  one is down. A promoted spare's pods get the replica label and count from then on.
- `minAvailable` is every replica pod but one. The operator replaces a replica whole
  (replicas.py): once one of its pods is evicted, it deletes the rest itself and starts
  the next generation, whose pods are not Ready until they run. So a budget of one pod is a
  budget of one replica: the next eviction waits until the replacement runs. A budget of
  `nodesPerReplica` pods would let a drain (which evicts a node's pods all at once) take
  pods of two replicas, since a budget counts pods, not replicas.
- It is an integer `minAvailable`, not `maxUnavailable`: Kubernetes can compute a
  `maxUnavailable` (or a percentage) only for pods whose controller has a scale
  subresource, which a TrainingJob does not; such a budget fails to sync and blocks every
  eviction.
- `unhealthyPodEvictionPolicy: AlwaysAllow`: a pod that is not Ready (a replacement that
  waits for its image or for room) can always be evicted, so it never blocks a drain.

What a budget cannot do: while a replica is down for any reason (a crash being replaced,
an image the kubelet cannot pull, no room for the replacement), no pod of another replica
can be evicted. That is the promise, and a drain waits (kubectl retries) until the job is
whole again; `kubectl delete pod` is not an eviction and is never held back. The budget
follows `spec.replicas` and `nodesPerReplica` (controller.py patches it when they change).
"""

from __future__ import annotations

from typing import Any

from transom import contract
from transom_operator import api, naming, resources

ALWAYS_ALLOW = "AlwaysAllow"


def worker_budget(job: api.TrainingJob) -> dict[str, Any]:
    """The job's PodDisruptionBudget (see the module docstring)."""
    name = resources.job_name(job)
    pods = job.spec.replicas * job.spec.nodes_per_replica
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": resources.owned_metadata(job, naming.disruption_budget(name), resources.COMPONENT_WORKER),
        "spec": {
            "minAvailable": max(pods - 1, 0),  # a one-replica job of one pod may always be drained
            "selector": {
                "matchLabels": {contract.LABEL_JOB: name},
                "matchExpressions": [{"key": contract.LABEL_REPLICA, "operator": "Exists"}],
            },
            "unhealthyPodEvictionPolicy": ALWAYS_ALLOW,
        },
    }


def spec_patch(current: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that gives the budget `current` (as read) the spec of `wanted`; None when
    they agree. Only the members the operator sets are compared: the API server adds none."""
    have, want = current.get("spec") or {}, wanted["spec"]
    changed = {key: value for key, value in want.items() if have.get(key) != value}
    if "minAvailable" in changed and have.get("maxUnavailable") is not None:
        changed["maxUnavailable"] = None  # one of the two (someone edited it by hand)
    return {"spec": changed} if changed else None
