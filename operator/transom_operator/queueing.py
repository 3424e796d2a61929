"""Kueue's side of a queued TrainingJob: its Workload read, created, replaced, given back and
finished. reconcile/admission.py decides every step; this module makes the requests.

One reconcile pass (controller.py) reads the job's Workload before it plans (`admission`)
and settles it after acting (`settle`): an evicted Workload's quota is given back once none
of the job's pods runs, and a job that ended finishes its Workload. A deleted job's Workload
goes with it (garbage collection: it is owned by the job and has no finalizer). Without Kueue
installed, a queued job waits with a condition that says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kubernetes.client.rest import ApiException

from transom_operator import api
from transom_operator.kube import Kube
from transom_operator.reconcile import admission as kueue
from transom_operator.reconcile.observe import ObservedPod, PodPhase

log = logging.getLogger("transom.operator")
FLAVOR_TTL_S = 30.0  # a ResourceFlavor's node labels are read again after this long
_FINAL = (api.JobState.SUCCEEDED, api.JobState.FAILED)


@dataclass
class Queued:
    """One pass's view of a queued job: what Kueue allows and the Workload it was read from."""

    admission: kueue.Admission
    workload: dict | None = None


@dataclass
class Queueing:
    kube: Kube
    _flavors: dict[str, tuple[float, dict | None]] = field(default_factory=dict)

    def admission(self, namespace: str, job: api.TrainingJob) -> Queued | None:
        """What Kueue allows the job now (None: it does not queue through Kueue). Creates its
        Workload where there is none, and replaces one that no longer matches the job."""
        queue = kueue.queue_name(job)
        if queue is None:
            return None
        name = kueue.workload_name(job)
        wl = self.kube.get(kueue.API_VERSION, "Workload", namespace, name)
        if wl is None:
            return Queued(self._create(namespace, job, queue))
        if wl["metadata"].get("deletionTimestamp") or not kueue.same_shape(wl, job, queue):
            self._drop(namespace, wl)
            return Queued(kueue.waiting(queue, "WorkloadReplaced", f"waiting in queue {queue}: the job's queue, "
                                        "pods or requests changed, so its Workload is replaced"))
        flavors = {f: self._flavor(f) for f in kueue.flavor_names(wl)}
        return Queued(kueue.read(wl, flavors), wl)

    def _create(self, namespace: str, job: api.TrainingJob, queue: str) -> kueue.Admission:
        try:
            self.kube.create(namespace, kueue.workload(job, queue))
        except ApiException as e:
            if e.status == 404:  # the API server does not serve Workloads
                return kueue.waiting(queue, "KueueNotInstalled", f"the job asks for queue {queue} "
                                     f"({kueue.QUEUE_LABEL}) but the API server does not serve "
                                     f"{kueue.API_VERSION} Workloads: is Kueue installed?")
            if e.status == 403:
                return kueue.waiting(queue, "WorkloadForbidden", f"the job asks for queue {queue} but the "
                                     "operator may not create Workloads: install its chart with kueue.enabled=true")
            if e.status in (400, 422):
                return kueue.waiting(queue, "WorkloadRefused",
                                     f"the job's Workload was refused ({e.status}): {(e.body or e.reason)!s:.900}")
            raise
        return kueue.waiting(queue, "WorkloadCreated", f"waiting in queue {queue}: Workload created")

    def _flavor(self, name: str) -> dict | None:
        cached = self._flavors.get(name)
        if cached is not None and time.monotonic() - cached[0] < FLAVOR_TTL_S:
            return cached[1]
        flavor = self.kube.get(kueue.API_VERSION, "ResourceFlavor", None, name)
        self._flavors[name] = (time.monotonic(), flavor)
        return flavor

    def _drop(self, namespace: str, wl: dict) -> None:
        """Delete a Workload, its finalizer first (else it would wait for it forever)."""
        patch = kueue.without_finalizer(wl)
        if patch is not None:
            self._patch(namespace, wl, patch)
        self.kube.delete(kueue.API_VERSION, "Workload", namespace, wl["metadata"]["name"])

    def _patch(self, namespace: str, wl: dict, patch: dict, subresource: str | None = None) -> dict | None:
        """A conditional patch; None if the Workload changed or went meanwhile (the next pass decides again)."""
        try:
            return self.kube.merge_patch(kueue.API_VERSION, "Workload", namespace, wl["metadata"]["name"],
                                         patch, subresource)
        except ApiException as e:
            if e.status in (404, 409):
                return None
            raise

    def settle(self, namespace: str, queued: Queued, state: str | None, pods: list[ObservedPod]) -> None:
        """After a pass acted: an evicted Workload gives its quota back once none of the job's
        pods runs; a job that ended finishes its Workload."""
        wl, adm = queued.workload, queued.admission
        if wl is None:
            return
        now = datetime.now(UTC)
        if state in _FINAL:
            if not adm.finished:
                self._patch(namespace, wl, kueue.finished_patch(wl, state == api.JobState.SUCCEEDED,
                                                                f"the TrainingJob {state}", now), "status")
        elif adm.evicted and adm.reserved and not any(p.phase in (PodPhase.PENDING, PodPhase.RUNNING) for p in pods):
            log.info("%s/%s: evicted by Kueue, no pod runs: giving the quota back", namespace,
                     wl["metadata"]["name"])
            self._patch(namespace, wl, kueue.release_patch(wl, now), "status")
