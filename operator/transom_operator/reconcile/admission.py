"""Kueue admission of a TrainingJob: the Workload that stands for the job in its queue, and
what the Workload's status lets the job run. Pure: queueing.py does the reads and writes.

A job labelled `kueue.x-k8s.io/queue-name` is admitted the way Kueue admits any job of a
kind it has no controller for (Kueue's "external framework" contract, which its own
jobframework reconciler implements for batch Jobs): the operator creates one Workload per job,
owned by it, whose pod sets are the job's worker pods (`worker`: replicas x nodesPerReplica)
and its hot spares' (`spare`), with the pod template Kueue sums the requests of. Kueue admits
the Workload whole or not at all (gang admission); until it does, the job is Queued: no worker
or spare pod exists. Once admitted, the pods are created with the node labels and tolerations
of the flavors Kueue assigned to their pod set. A replica replaced after a failure keeps the
admission: its new pods fit the same pod set, so nothing goes back to the queue. When Kueue
evicts the Workload (preemption, a stopped queue), the job's pods are deleted and, once none
runs, the operator gives the quota back (the Workload's admission cleared, QuotaReserved False,
as jobframework does); the job waits in the queue again. When the job ends, the Workload is
marked Finished, which frees the quota. The Workload carries no finalizer (Kueue's webhooks
add none to Workloads): a deleted job's Workload goes with it by garbage collection, whether
or not an operator runs then, and Kueue frees its quota when it is gone.

The coordinator is not in the Workload: a small control pod (resources.COORDINATOR_RESOURCES)
that keeps the job's record and serves its status while it waits, as it does for spec.suspend.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from transom import contract
from transom_operator import api, resources

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PODSET_LABEL = "kueue.x-k8s.io/podset"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
FINALIZER = "kueue.x-k8s.io/resource-in-use"  # taken off a Workload the operator deletes, should one have it
API_VERSION = "kueue.x-k8s.io/v1beta2"
WORKER, SPARE = "worker", "spare"
# Kueue's own limit on a Workload's name, so that it fits in a label value (workload_names.go).
MAX_NAME = 63
# Evictions after which Kueue puts the Workload back in the queue at once (jobframework sets
# Requeued True for these; for the others Kueue's own backoff or policy decides).
REQUEUED_AFTER = ("Preempted", "NodeFailures")
# Fields of a container that Kueue reads (requests, and what places a pod); the rest (command,
# environment) would only make the Workload larger and show it to whoever may read Workloads.
_CONTAINER_KEYS = ("name", "image", "resources")
_SPEC_KEYS = ("nodeSelector", "affinity", "tolerations", "priorityClassName", "runtimeClassName", "overhead",
              "schedulerName", "topologySpreadConstraints", "resourceClaims")


@dataclass(frozen=True)
class Placement:
    """Where the pods of one pod set go: the assigned flavors' node labels and tolerations."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Admission:
    """What Kueue allows the job now (read from its Workload)."""

    queue: str
    admitted: bool
    reason: str  # the Admitted condition's reason on the TrainingJob
    message: str
    placements: Mapping[str, Placement] = field(default_factory=dict)
    evicted: bool = False  # Kueue evicted the Workload: stop the pods, then give the quota back
    reserved: bool = False  # status.admission is set: the quota is held
    finished: bool = False


def queue_name(job: api.TrainingJob) -> str | None:
    """The LocalQueue the job asks for, or None: the job is not queued through Kueue."""
    labels = job.metadata.get("labels") or {}
    value = labels.get(QUEUE_LABEL)
    return value if isinstance(value, str) and value else None


def workload_name(job: api.TrainingJob) -> str:
    """Kueue's name for the Workload of an owner (jobframework's GetWorkloadNameForOwnerWithGVK,
    short form): "trainingjob-<name>" cut to fit, a dash and 5 hex digits of a hash of the
    owner's kind, group, name and uid."""
    meta = job.metadata
    prefix = f"trainingjob-{meta['name']}"[: MAX_NAME - 6]
    digest = hashlib.sha1(f"TrainingJob\n{api.GROUP}\n{meta['name']}\n{meta.get('uid', '')}".encode())
    return f"{prefix}-{digest.hexdigest()[:5]}"


def _template(pod: dict[str, Any]) -> dict[str, Any]:
    """A worker pod reduced to the PodTemplateSpec Kueue reads."""
    spec = pod["spec"]
    out: dict[str, Any] = {k: copy.deepcopy(spec[k]) for k in _SPEC_KEYS if k in spec}
    for key in ("initContainers", "containers"):
        if spec.get(key):
            out[key] = [{k: copy.deepcopy(c[k]) for k in _CONTAINER_KEYS if k in c} for c in spec[key]]
    return {"metadata": {"labels": dict(pod["metadata"].get("labels") or {})}, "spec": out}


def pod_sets(job: api.TrainingJob) -> list[dict[str, Any]]:
    """The job's pod sets: every worker pod, and every spare pod if it has spares."""
    spec = job.spec
    sets = [{"name": WORKER, "count": spec.replicas * spec.nodes_per_replica,
             "template": _template(resources.worker_pod(job, 0, 0, 0))}]
    if spec.spare_replicas:
        sets.append({"name": SPARE, "count": spec.spare_replicas * spec.nodes_per_replica,
                     "template": _template(resources.spare_pod(job, 0, 0, 0))})
    return sets


def workload(job: api.TrainingJob, queue: str) -> dict[str, Any]:
    """The Workload the operator creates for a queued job (owned by it: deleted with it)."""
    meta = job.metadata
    return {
        "apiVersion": API_VERSION, "kind": "Workload",
        "metadata": {
            "name": workload_name(job), "namespace": meta["namespace"],
            "labels": {contract.LABEL_JOB: meta["name"], JOB_UID_LABEL: str(meta.get("uid", ""))},
            "ownerReferences": [resources.owner_reference(job)],
        },
        "spec": {"queueName": queue, "podSets": pod_sets(job)},
    }


def _shape(sets: list[dict[str, Any]]) -> list[tuple[str, int, list[Any]]]:
    return [(s.get("name", ""), s.get("count", 0),
             [c.get("resources") for c in ((s.get("template") or {}).get("spec") or {}).get("containers") or []])
            for s in sets]


def same_shape(current: Mapping[str, Any], job: api.TrainingJob, queue: str) -> bool:
    """Whether the Workload still stands for the job: same queue, pod sets, counts and requests.
    Otherwise it is replaced by a new one (and the job queued again), as jobframework does."""
    spec = current.get("spec") or {}
    return spec.get("queueName") == queue and _shape(spec.get("podSets") or []) == _shape(pod_sets(job))


def _conditions(wl: Mapping[str, Any]) -> dict[str, dict]:
    return {str(c.get("type")): c for c in (wl.get("status") or {}).get("conditions") or [] if isinstance(c, dict)}


def _true(conditions: Mapping[str, dict], type_: str) -> dict | None:
    c = conditions.get(type_)
    return c if c is not None and c.get("status") == "True" else None


def flavor_names(wl: Mapping[str, Any]) -> set[str]:
    """The ResourceFlavors the Workload's admission assigned (their node labels place the pods)."""
    admission = (wl.get("status") or {}).get("admission") or {}
    return {f for a in admission.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()}


def _placement(assignment: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any] | None]) -> Placement:
    selector: dict[str, str] = {}
    tolerations: list[dict] = []
    for name in sorted(set((assignment.get("flavors") or {}).values())):
        spec = (flavors.get(name) or {}).get("spec") or {}
        selector.update(spec.get("nodeLabels") or {})
        tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
    return Placement(selector, tuple(tolerations))


def read(wl: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any] | None]) -> Admission:
    """The job's admission from its Workload and the ResourceFlavors it names."""
    queue = (wl.get("spec") or {}).get("queueName", "")
    conditions = _conditions(wl)
    reserved = (wl.get("status") or {}).get("admission") is not None
    if _true(conditions, "Finished"):
        return Admission(queue, False, "Finished", "the Workload is finished", reserved=reserved, finished=True)
    evicted = _true(conditions, "Evicted")
    if evicted is not None:
        return Admission(queue, False, "Evicted",
                         f"evicted by Kueue ({evicted.get('reason')}): {evicted.get('message', '')}",
                         evicted=True, reserved=reserved)
    if _true(conditions, "Admitted"):
        assignments = (wl["status"]["admission"] or {}).get("podSetAssignments") or []
        placements = {a.get("name", ""): _placement(a, flavors) for a in assignments}
        cq = wl["status"]["admission"].get("clusterQueue", "")
        return Admission(queue, True, "Admitted", f"admitted by ClusterQueue {cq} from queue {queue}",
                         placements, reserved=reserved)
    quota = conditions.get("QuotaReserved") or {}
    why = quota.get("message") or "Kueue has not considered the Workload yet"
    return Admission(queue, False, quota.get("reason") or "Pending", f"waiting in queue {queue}: {why}",
                     reserved=reserved)


def waiting(queue: str, reason: str, message: str) -> Admission:
    """An admission that is not (yet) given, e.g. the Workload was only just created."""
    return Admission(queue, False, reason, message)


def place(pod: dict[str, Any], admission: Admission) -> None:
    """Put a pod of an admitted job where Kueue's flavors say: their node labels (over the
    template's own for the same key) and tolerations, and the pod set's label."""
    labels = pod["metadata"].setdefault("labels", {})
    podset = SPARE if contract.LABEL_SPARE in labels else WORKER
    labels[PODSET_LABEL] = podset
    placement = admission.placements.get(podset)
    if placement is None:
        return
    spec = pod["spec"]
    if placement.node_selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **placement.node_selector}
    if placement.tolerations:
        current = list(spec.get("tolerations") or [])
        spec["tolerations"] = current + [t for t in placement.tolerations if t not in current]


def _set(conditions: list[dict], type_: str, status: str, reason: str, message: str, now: datetime,
         generation: int | None) -> None:
    """apimeta.SetStatusCondition: the transition time changes only with the status."""
    old = next((c for c in conditions if c.get("type") == type_), None)
    new: dict[str, Any] = {"type": type_, "status": status, "reason": reason, "message": message[:32768],
           "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if generation is not None:
        new["observedGeneration"] = generation
    if old is not None and old.get("status") == status:
        new["lastTransitionTime"] = old.get("lastTransitionTime", new["lastTransitionTime"])
    conditions[:] = [c for c in conditions if c is not old] + [new]


def _status_patch(wl: Mapping[str, Any], conditions: list[dict], **status: Any) -> dict[str, Any]:
    # The resourceVersion makes the merge patch conditional: a Workload that Kueue changed
    # meanwhile answers 409 and the next pass decides again from what it then is.
    return {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]},
            "status": {"conditions": conditions, **status}}


def release_patch(wl: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """After an eviction, once none of the job's pods runs: the quota given back (admission
    cleared, QuotaReserved and Admitted False), Requeued as jobframework sets it."""
    conditions = [dict(c) for c in _conditions(wl).values()]
    evicted = _conditions(wl).get("Evicted") or {}
    reason, message = evicted.get("reason") or "Evicted", evicted.get("message") or "evicted"
    gen = wl["metadata"].get("generation")
    _set(conditions, "Requeued", "True" if reason in REQUEUED_AFTER else "False", reason, message, now, gen)
    _set(conditions, "QuotaReserved", "False", "Pending", message, now, gen)
    _set(conditions, "Admitted", "False", "NoReservation", "The workload has no reservation", now, gen)
    return _status_patch(wl, conditions, admission=None)


def finished_patch(wl: Mapping[str, Any], succeeded: bool, message: str, now: datetime) -> dict[str, Any]:
    """The job ended: the Workload is Finished (Kueue frees its quota)."""
    conditions = [dict(c) for c in _conditions(wl).values()]
    _set(conditions, "Finished", "True", "Succeeded" if succeeded else "Failed", message or "the job ended",
         now, wl["metadata"].get("generation"))
    return _status_patch(wl, conditions)


def without_finalizer(wl: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that removes the resource-in-use finalizer, or None if it is not there."""
    finalizers = wl["metadata"].get("finalizers") or []
    if FINALIZER not in finalizers:
        return None
    return {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"],
                         "finalizers": [f for f in finalizers if f != FINALIZER]}}
