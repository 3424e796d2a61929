"""What the operator sees of the world: pods and nodes reduced to the facts it decides on.

`observe_pod` and `observe_node` parse raw API objects (camelCase dicts, as the API server's
JSON or `kubernetes`' `sanitize_for_serialization` gives them); the decision functions
never touch raw dicts, so their tests build `ObservedPod`s directly. `group_pods` sorts
them into replicas (or spares) and generations, the same way for both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from transom import contract


# What the kubelet says while it cannot get a container's image: it retries on its own, with a
# backoff of up to 5 minutes, so the pod is left alone (replicas.py shows it in status).
class PodPhase(StrEnum):
    """A pod's status.phase (Kubernetes' words; equal to the strings the API server sends)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


IMAGE_PULL_WAITING_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
MAX_KUBELET_MESSAGE = 512  # of the kubelet's own message, in ours


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp ("2025-01-31T12:00:00Z") as an aware datetime; None if absent."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _int_label(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


@dataclass(frozen=True)
class ImagePull:
    """A container of a pod that waits for an image the kubelet cannot pull."""

    container: str
    image: str
    reason: str  # one of IMAGE_PULL_WAITING_REASONS
    message: str  # the kubelet's, shortened


@dataclass(frozen=True)
class ObservedPod:
    """One of the job's worker (or spare) pods."""

    name: str
    uid: str
    replica: int | None  # None for a spare pod, or a pod whose labels are not ours
    spare: int | None
    node_rank: int | None
    generation: int | None
    phase: str  # a PodPhase (kept as the API server's string: an unknown future phase is not an error)
    node_name: str | None
    deleting: bool  # has a deletionTimestamp
    exit_code: int | None  # of the first terminated container
    reason: str | None  # status.reason (Evicted, NodeLost, ...) or the terminated container's
    created: datetime | None
    finished: datetime | None = None  # when the first terminated container ended
    message: str | None = None  # the first terminated container's termination message
    # The reason of a True DisruptionTarget condition (Kubernetes >= 1.26 sets it before it
    # deletes a pod on someone's request: EvictionByEvictionAPI, PreemptionByScheduler,
    # DeletionByTaintManager, TerminationByKubelet, ...).
    disruption: str | None = None
    image_pull: ImagePull | None = None  # a container waits for an image the kubelet cannot pull
    memory_limit: str | None = None  # that container's resources.limits.memory ("3Gi")


@dataclass(frozen=True)
class ObservedNode:
    """A node, as far as the replicas on it are concerned."""

    name: str
    ready: bool
    not_ready_since: datetime | None  # lastTransitionTime of a Ready condition that is not True
    # spec.unschedulable: cordoned (by an admin, `kubectl drain`, an upgrade): failures.detect
    # takes a pod gone from a cordoned node without a trace for a drain's eviction.
    cordoned: bool = False


def _first_terminated(status: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """(container name, its state.terminated) of the first container that ended. Worker pods
    have restartPolicy Never: a container's end is its state, never its lastState."""
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in status.get(key) or []:
            state = cs.get("state") or {}
            if state.get("terminated"):
                return cs.get("name"), state["terminated"]
    return None, None


def _memory_limit(spec: dict[str, Any], container: str | None) -> str | None:
    for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        if c.get("name") == container:
            limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
            return str(limit) if limit is not None else None
    return None


def _disruption(status: dict[str, Any]) -> str | None:
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            return condition.get("reason") or "DisruptionTarget"
    return None


def _image_pull(status: dict[str, Any]) -> ImagePull | None:
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in IMAGE_PULL_WAITING_REASONS:
                return ImagePull(container=cs.get("name") or "", image=cs.get("image") or "",
                                 reason=waiting["reason"],
                                 message=(waiting.get("message") or "")[:MAX_KUBELET_MESSAGE])
    return None


def observe_pod(pod: dict[str, Any]) -> ObservedPod:
    # Nothing here comes from the pod's annotations or its template: a job's user writes those,
    # so they never count as a verdict. Labels are the operator's own (reserved in templates).
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    status = pod.get("status") or {}
    container, terminated = _first_terminated(status)
    exit_code = terminated.get("exitCode") if terminated else None
    reason = status.get("reason") or (terminated.get("reason") if terminated else None)
    return ObservedPod(
        name=metadata.get("name", ""),
        uid=metadata.get("uid", ""),
        replica=_int_label(labels, contract.LABEL_REPLICA),
        spare=_int_label(labels, contract.LABEL_SPARE),
        node_rank=_int_label(labels, contract.LABEL_NODE_RANK),
        generation=_int_label(labels, contract.LABEL_GENERATION),
        phase=status.get("phase") or PodPhase.PENDING,
        node_name=(pod.get("spec") or {}).get("nodeName") or None,
        deleting=metadata.get("deletionTimestamp") is not None,
        exit_code=exit_code,
        reason=reason,
        created=parse_time(metadata.get("creationTimestamp")),
        finished=parse_time(terminated.get("finishedAt")) if terminated else None,
        message=(terminated.get("message") or None) if terminated else None,
        disruption=_disruption(status),
        image_pull=_image_pull(status) if status.get("phase") in (None, PodPhase.PENDING) else None,
        memory_limit=_memory_limit(pod.get("spec") or {}, container) if terminated else None,
    )


def observe_node(node: dict[str, Any]) -> ObservedNode:
    metadata = node.get("metadata") or {}
    conditions = (node.get("status") or {}).get("conditions") or []
    ready_condition = next((c for c in conditions if c.get("type") == "Ready"), None)
    # No Ready condition yet is a node still joining: NotReady, but with no time to count from.
    ready = ready_condition is not None and ready_condition.get("status") == "True"
    since = None if ready or ready_condition is None else parse_time(ready_condition.get("lastTransitionTime"))
    return ObservedNode(name=metadata.get("name", ""), ready=ready, not_ready_since=since,
                        cordoned=bool((node.get("spec") or {}).get("unschedulable")))


@dataclass(frozen=True)
class PodSet:
    """The pods of one replica (or spare) id, split by generation."""

    generation: int  # the highest of the pods' generations and the recorded one
    current: dict[int, ObservedPod]  # node rank -> pod of that generation
    stale: list[ObservedPod]  # pods of older generations


def group_pods(pods: Iterable[ObservedPod], id_of: Callable[[ObservedPod], int | None], count: int,
               nodes_per_replica: int, recorded: Mapping[int, int]) -> tuple[list[PodSet], list[ObservedPod]]:
    """Pods by `id_of` (ids 0 .. count - 1, `recorded` generation per id), and the pods whose id
    or node rank is out of range. Pods that `id_of` gives None, or without generation or node
    rank labels, are not ours to group and are left out."""
    by_id: dict[int, list[tuple[int, int, ObservedPod]]] = {}  # id -> (generation, node rank, pod)
    extra: list[ObservedPod] = []
    for pod in pods:
        pid = id_of(pod)
        if pid is None or pod.generation is None or pod.node_rank is None:
            continue
        if pid >= count or pod.node_rank >= nodes_per_replica:
            extra.append(pod)
        else:
            by_id.setdefault(pid, []).append((pod.generation, pod.node_rank, pod))
    out = []
    for i in range(count):  # one loop per id over its own pods: a pass of a 2,000-pod job runs this
        own = by_id.get(i, [])
        generation = max([recorded.get(i, 0), *(g for g, _, _ in own)])
        current: dict[int, ObservedPod] = {}
        stale: list[ObservedPod] = []
        for g, rank, p in own:
            if g == generation:
                current[rank] = p
            else:
                stale.append(p)
        out.append(PodSet(generation=generation, current=current, stale=stale))
    return out, extra
