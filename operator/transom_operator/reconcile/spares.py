"""Hot spares: which spare pods exist, which spare can take over now, what to create or delete.

A spare (id 0 .. spec.spareReplicas - 1) is a full set of `nodesPerReplica` pods labelled
`transom.io/spare=<id>` whose launchers wait for a replica identity. When a replica fails
and a spare is Ready (every pod Running on a Ready, non-excluded node), `replicas.plan`
promotes it: the spare's pods are relabelled as the replica's next generation, so the
replacement costs no scheduling, image pull or container start. The spare's own generation
then goes up by one and its pods are created again in the background (the refill).

Like replicas, spares keep their memory in the API (`status.spares[].generation`, the pods'
labels), so the plan is level-based: pods of an older spare generation are deleted, missing
ranks of the current one are created. A spare whose pod failed, was deleted, or sits on a
NotReady or excluded node is replaced whole (generation + 1) after `backoffSeconds`, so a
spare that cannot start (a bad image) does not loop hot. A spare whose pod failed its
pre-flight checks (when it started, or a periodic one while it waits: its launcher exits
contract.EXIT_PREFLIGHT_FAILED) is never promoted, and its node is excluded as a replica's
would be (`preflight_failures`). Spare failures are not replica
restarts: they count towards neither totalRestarts nor maxReplicaRestarts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from transom_operator import api, reasons, resources
from transom_operator.reconcile import failures
from transom_operator.reconcile.observe import ObservedNode, ObservedPod, PodPhase, group_pods

S = api.SpareState


@dataclass
class Spare:
    """One spare while planning."""

    id: int
    generation: int
    current: dict[int, ObservedPod]  # node rank -> pod of the current generation
    stale: list[ObservedPod]
    recorded: api.SpareStatus | None
    promoted_to: int | None = None  # replica id, once promoted in this pass

    def ready(self, nodes_per_replica: int, nodes: Mapping[str, ObservedNode], excluded: Iterable[str]) -> bool:
        """Every pod Running, not being deleted, on a Ready node that the job does not exclude."""
        excluded = set(excluded)
        for rank in range(nodes_per_replica):
            pod = self.current.get(rank)
            if pod is None or pod.deleting or pod.phase != PodPhase.RUNNING or not pod.node_name:
                return False
            node = nodes.get(pod.node_name)
            if node is None or not node.ready or pod.node_name in excluded:
                return False
        return True

    def broken(self, nodes: Mapping[str, ObservedNode], excluded: Iterable[str]) -> tuple[str, str] | None:
        """(reason, message) if a current pod can never serve; None if the spare is fine or coming up."""
        excluded = set(excluded)
        for rank in sorted(self.current):
            pod = self.current[rank]
            if failures.is_preflight_failure(pod):
                return reasons.PREFLIGHT_FAILED, failures.preflight_message(pod, f" on node {pod.node_name}")
            if pod.phase in (PodPhase.FAILED, PodPhase.SUCCEEDED):
                return reasons.POD_FAILED, f"spare pod {pod.name} ended ({pod.phase}, {pod.reason or 'no reason'})"
            if pod.deleting:
                return reasons.POD_DELETED, f"spare pod {pod.name} is being deleted"
            if pod.node_name and pod.node_name in excluded:
                return reasons.NODE_EXCLUDED, f"spare pod {pod.name} is on excluded node {pod.node_name}"
            node = nodes.get(pod.node_name) if pod.node_name else None
            if pod.node_name and (node is None or not node.ready):
                return reasons.NODE_NOT_READY, f"spare pod {pod.name}'s node {pod.node_name} is not Ready"
        return None


def group(pods: Iterable[ObservedPod], spec: api.TrainingJobSpec,
          recorded: Mapping[int, api.SpareStatus]) -> tuple[list[Spare], list[ObservedPod]]:
    """Spare pods by spare id; pods of spare ids beyond spec.spareReplicas come back apart."""
    sets, extra = group_pods(pods, lambda p: p.spare if p.replica is None else None, spec.spare_replicas,
                             spec.nodes_per_replica, {i: s.generation for i, s in recorded.items()})
    return [Spare(id=i, generation=s.generation, current=s.current, stale=s.stale, recorded=recorded.get(i))
            for i, s in enumerate(sets)], extra


def take_ready(spares: list[Spare], nodes_per_replica: int, nodes: Mapping[str, ObservedNode],
               excluded: Iterable[str]) -> Spare | None:
    """The lowest-id Ready spare not yet promoted in this pass, or None."""
    for s in spares:
        if s.promoted_to is None and s.ready(nodes_per_replica, nodes, excluded):
            return s
    return None


def promote(spare: Spare, replica: int, generation: int) -> tuple[dict[int, ObservedPod], list[tuple[str, dict]]]:
    """The replica's pods after promotion (by node rank) and the label patches that do it."""
    spare.promoted_to = replica
    pods = {rank: replace(p, replica=replica, spare=None, generation=generation) for rank, p in spare.current.items()}
    patches = [(p.name, resources.promotion_labels(replica, generation)) for p in spare.current.values()]
    return pods, patches


@dataclass
class SparePlan:
    create: list[dict[str, Any]]
    delete: list[str]
    statuses: list[api.SpareStatus]
    requeue_after: float | None


def preflight_failures(spares: list[Spare]) -> list[failures.ReplicaFailure]:
    """The spares whose pod failed its pre-flight checks (at its start, or a periodic one while
    it waited): each names its node to exclude, as a replica's pod would. Such a spare is never
    promoted (it is not Ready) and is replaced elsewhere."""
    out = []
    for s in spares:
        for pod in s.current.values():
            if failures.is_preflight_failure(pod) and pod.node_name:
                out.append(failures.ReplicaFailure(
                    reasons.PREFLIGHT_FAILED, failures.preflight_message(pod, f" on node {pod.node_name}"),
                    pod.node_name, [(pod.node_name, reasons.PREFLIGHT_FAILED)]))
    return out


def plan(job: api.TrainingJob, spares: list[Spare], extra: list[ObservedPod], active: bool,
         nodes: Mapping[str, ObservedNode], excluded: Iterable[str], now: datetime) -> SparePlan:
    """Keep `spares` filled while the job is `active` (not suspended, final or done); else delete them."""
    spec, ft = job.spec, job.spec.fault_tolerance
    excluded = list(excluded)
    out = SparePlan(create=[], delete=[p.name for p in extra if not p.deleting], statuses=[], requeue_after=None)
    for s in spares:
        last_failure = s.recorded.last_failure if s.recorded else None
        generation, current = s.generation, dict(s.current)
        stale = list(s.stale)
        if s.promoted_to is not None:
            generation, current = generation + 1, {}  # its pods now belong to the replica
        elif not active:
            stale.extend(current.values())
            current = {}
        else:
            broken = s.broken(nodes, excluded)
            if broken is not None:
                stale.extend(current.values())
                current = {}
                generation += 1
                last_failure = api.Failure(reason=broken[0], message=broken[1], time=now)
        out.delete.extend(p.name for p in stale if not p.deleting)
        missing = [rank for rank in range(spec.nodes_per_replica) if rank not in current]
        if active and missing:
            wait = 0.0
            if last_failure is not None and last_failure.time is not None and s.promoted_to is None:
                wait = (last_failure.time - now).total_seconds() + ft.backoff_seconds
            if wait <= 0:
                out.create.extend(resources.spare_pod(job, s.id, rank, generation, excluded_nodes=excluded)
                                  for rank in missing)
            else:
                out.requeue_after = wait if out.requeue_after is None else min(out.requeue_after, wait)
        view = Spare(s.id, generation, current, [], None)
        ready = active and view.ready(spec.nodes_per_replica, nodes, excluded)
        out.statuses.append(api.SpareStatus(
            id=s.id, generation=generation, state=S.READY if ready else S.PENDING, last_failure=last_failure,
            nodes=[current[k].node_name for k in sorted(current) if current[k].node_name],
        ))
    return out
