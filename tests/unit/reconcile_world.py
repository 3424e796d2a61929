"""A small simulated world for the reconcile tests: the job, its pods and its nodes.

`World.step()` plans, applies the plan the way kube.py would (deleted pods get a
deletionTimestamp, created pods appear Pending, relabelled pods change identity, the status
is written) and returns the plan. `settle()` lets deleted pods go (their last state stays
`departed` for `cache.DEPARTED_S`, as the operator's watch cache keeps it) and schedules the
pending ones; `coordinator()` writes status.training as the job's coordinator would;
`assert_quiet()` checks that planning again without a change asks for nothing new.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from transom import contract
from transom_operator import api
from transom_operator.cache import DEPARTED_S
from transom_operator.reconcile import observe
from transom_operator.reconcile.observe import ObservedNode, ObservedPod
from transom_operator.reconcile.replicas import plan

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def make_job(**spec) -> api.TrainingJob:
    full = {"replicas": 3, "minReplicas": 2, "nodesPerReplica": 2,
            "template": {"spec": {"containers": [{"name": "t", "image": "t:1"}]}}}
    ft = spec.pop("ft", {})
    full["faultTolerance"] = {"backoffSeconds": 0, "maxBackoffSeconds": 0, **ft}
    full.update(spec)
    return api.TrainingJob.model_validate({
        "apiVersion": api.API_VERSION, "kind": api.KIND,
        "metadata": {"name": "demo", "namespace": "ml", "uid": "u1", "generation": 1},
        "spec": full,
    })


class World:
    def __init__(self, job: api.TrainingJob, num_nodes: int = 10):
        self.job = job
        self.pods: dict[str, ObservedPod] = {}
        self.nodes = {f"n{i}": ObservedNode(f"n{i}", True, None) for i in range(num_nodes)}
        self.now = T0
        self.gone: dict[str, tuple[ObservedPod, datetime]] = {}  # name -> (last state, when deleted)
        self._next_node = 0
        self._uid = 0
        self.admission = None  # what Kueue allows, for a job queued through it (reconcile/admission.py)

    def departed(self) -> list[ObservedPod]:
        return [pod for pod, at in self.gone.values() if (self.now - at).total_seconds() < DEPARTED_S]

    def vanish(self, name: str) -> None:
        """The pod is deleted from the API, its DELETED event seen (settle's, for one pod)."""
        self.gone[name] = (self.pods.pop(name), self.now)

    def step(self):
        p = plan(self.job, list(self.pods.values()), self.nodes, self.now, self.departed(), self.admission)
        for name in p.delete:
            self.pods[name] = replace(self.pods[name], deleting=True)
        for name, labels in p.relabel:
            self.pods[name] = relabelled(self.pods[name], labels)
        for manifest in p.create:
            self._uid += 1
            pod = observe.observe_pod({**manifest, "metadata": {**manifest["metadata"], "uid": f"uid{self._uid}"}})
            assert pod.name not in self.pods, f"{pod.name} created twice"
            self.pods[pod.name] = pod
        # Through JSON, as the status comes back from the API server on the next pass; the
        # operator's patch leaves status.training (the coordinator's) as it was.
        status = api.TrainingJobStatus.model_validate(p.status_patch())
        training = self.job.status.training if self.job.status else None
        self.job = self.job.model_copy(update={"status": status.model_copy(update={"training": training})})
        return p

    def coordinator(self, **training):
        """status.training as the job's coordinator writes it (camelCase keys, as on the wire)."""
        status = self.job.status or api.TrainingJobStatus()
        value = api.TrainingProgress.model_validate(training)
        self.job = self.job.model_copy(update={"status": status.model_copy(update={"training": value})})

    def settle(self):
        """Deleted pods go away; the others are scheduled and run."""
        excluded = {e.name for e in (self.job.status.excluded_nodes if self.job.status else [])}
        for name, pod in list(self.pods.items()):
            if pod.deleting:
                self.vanish(name)
            elif pod.phase == "Pending":
                node = self._free_node(excluded)
                self.pods[name] = replace(pod, phase="Running", node_name=node)

    def _free_node(self, excluded):
        used = {p.node_name for p in self.pods.values()}
        for name, node in self.nodes.items():
            if name not in used and name not in excluded and node.ready:
                return name
        raise AssertionError("no free node")

    def set_pod(self, name, **changes):
        self.pods[name] = replace(self.pods[name], **changes)

    def pod_of(self, replica, rank=0):
        (pod,) = [p for p in self.pods.values() if p.replica == replica and p.node_rank == rank]
        return pod

    def running(self):
        self.step()
        self.settle()
        self.step()
        return self

    def assert_quiet(self):
        again = plan(self.job, list(self.pods.values()), self.nodes, self.now, self.departed(), self.admission)
        assert (again.create, again.delete, again.relabel, again.events,
                again.excluded_nodes_added) == ([], [], [], [], [])
        assert again.status == self.job.status


def cond(status, type_):
    return next(c for c in status.conditions if c.type == type_)


def relabelled(pod: ObservedPod, labels: dict[str, str | None]) -> ObservedPod:
    """`pod` after a merge patch of its labels (None removes one)."""
    def value(key, old):
        if key not in labels:
            return old
        return None if labels[key] is None else int(labels[key])
    return replace(pod, replica=value(contract.LABEL_REPLICA, pod.replica),
                   spare=value(contract.LABEL_SPARE, pod.spare),
                   generation=value(contract.LABEL_GENERATION, pod.generation))
