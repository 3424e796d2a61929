"""When a replica has failed, why, and which node is to blame: one policy, no I/O.

A replica (one incarnation: the pods of its current generation) fails when one of its pods
- sits on a node that has been NotReady for longer than nodeNotReadyGraceSeconds (NodeNotReady),
- was lost with its node (NodeLost),
- carries the coordinator's evict annotation (FlaggedByCoordinator),
- was evicted by the kubelet (PodEvicted) or exited non-zero (PodFailed),
- is being deleted, or is gone although the replica was recorded Running (PodDeleted).
Hardware-class failures name the node to exclude: NodeNotReady, NodeLost, a verdict of a
hardware detector, and a second failure on the same node within the restart window
(RepeatedFailures).

The restart history (one record per replaced incarnation, kept in a job annotation so that
it survives operator restarts) is what the restart limit, the backoff and the repeated-
failure rule count.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from transom_operator import reasons
from transom_operator.reconcile.observe import ObservedNode, ObservedPod

# Where the restart history lives on the TrainingJob (metadata.annotations), as compact
# JSON: [[replica, generation, unix_seconds, node or null], ...], pruned to the window.
# TODO(lead): move to transom.contract if anything outside the operator reads it.
ANNOTATION_RESTART_HISTORY = "transom.io/restart-history"

# Words in an evict reason that blame the hardware rather than the software.
HARDWARE_WORDS = ("hardware", "detector", "gpu", "xid", "ecc", "nvlink", "slow")
# Pod status reasons that mean the node went away under the pod.
NODE_LOST_POD_REASONS = frozenset({"NodeLost", "NodeShutdown", "Terminated"})  # Terminated: graceful node shutdown

# Order in which causes are reported when a replica has several at once.
_PRIORITY = (
    reasons.NODE_NOT_READY, reasons.NODE_LOST, reasons.FLAGGED_BY_COORDINATOR,
    reasons.POD_EVICTED, reasons.POD_FAILED, reasons.POD_DELETED,
)


@dataclass(frozen=True)
class RestartRecord:
    """One replacement of a replica: which incarnation failed, when, and on which node."""

    replica: int
    generation: int
    time: int  # unix seconds
    node: str | None


def parse_history(raw: str | None) -> list[RestartRecord]:
    """The annotation's records; anything unreadable counts as no history (never a crash)."""
    if not raw:
        return []
    try:
        items = json.loads(raw)
        return [RestartRecord(int(r), int(g), int(t), n if isinstance(n, str) else None) for r, g, t, n in items]
    except (ValueError, TypeError):
        return []


def format_history(records: Iterable[RestartRecord]) -> str:
    return json.dumps([[r.replica, r.generation, r.time, r.node] for r in records], separators=(",", ":"))


@dataclass
class ReplicaFailure:
    """Why one incarnation of a replica failed, and which nodes to exclude for it."""

    reason: str
    message: str
    node: str | None  # the node of the pod that failed first (for the history)
    exclude: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)


def is_hardware_verdict(evict_reason: str) -> bool:
    text = evict_reason.lower()
    return any(word in text for word in HARDWARE_WORDS)


def detect(
    replica: int,
    generation: int,
    nodes_per_replica: int,
    current: Mapping[int, ObservedPod],
    recorded_running: bool,
    nodes: Mapping[str, ObservedNode],
    history: list[RestartRecord],
    grace_seconds: int,
    now: datetime,
) -> tuple[ReplicaFailure | None, float | None]:
    """The failure of incarnation `generation` of `replica`, if any, and when to look again.

    `current` maps node rank to the incarnation's pods; `recorded_running` says the status
    recorded this incarnation with all its pods running (so a missing pod was lost, not
    yet created). The second value is the seconds until a NotReady node's grace runs out.
    """
    causes: list[tuple[str, str, str | None, str | None]] = []  # reason, message, node, exclude-reason
    recheck: float | None = None
    for rank in sorted(current):
        pod = current[rank]
        node = nodes.get(pod.node_name) if pod.node_name else None
        if node is not None and not node.ready and node.not_ready_since is not None:
            elapsed = (now - node.not_ready_since).total_seconds()
            if elapsed >= grace_seconds:
                causes.append((reasons.NODE_NOT_READY,
                               f"node {node.name} of pod {pod.name} NotReady for {int(elapsed)}s",
                               node.name, reasons.NODE_NOT_READY))
            else:
                wait = grace_seconds - elapsed
                recheck = wait if recheck is None else min(recheck, wait)
        if pod.evict_reason:
            hardware = is_hardware_verdict(pod.evict_reason) and pod.node_name
            causes.append((reasons.FLAGGED_BY_COORDINATOR,
                           f"pod {pod.name} flagged by the coordinator: {pod.evict_reason}",
                           pod.node_name, reasons.FLAGGED_BY_COORDINATOR if hardware else None))
        if pod.phase == "Failed":
            where = f" on node {pod.node_name}" if pod.node_name else ""
            if pod.reason in NODE_LOST_POD_REASONS:
                causes.append((reasons.NODE_LOST, f"pod {pod.name}{where} lost with its node ({pod.reason})",
                               pod.node_name, reasons.NODE_LOST if pod.node_name else None))
            elif pod.reason == "Evicted":
                causes.append((reasons.POD_EVICTED, f"pod {pod.name}{where} evicted", pod.node_name, None))
            else:
                code = "" if pod.exit_code is None else f" with exit code {pod.exit_code}"
                repeated = pod.node_name is not None and any(
                    h.node == pod.node_name and (h.replica, h.generation) != (replica, generation) for h in history
                )
                message = f"pod {pod.name}{where} failed{code}"
                if repeated:
                    message += f"; a second failure on node {pod.node_name} within the restart window"
                causes.append((reasons.POD_FAILED, message, pod.node_name,
                               reasons.REPEATED_FAILURES if repeated else None))
        elif pod.deleting:
            causes.append((reasons.POD_DELETED, f"pod {pod.name} deleted", pod.node_name, None))
    if recorded_running:
        for rank in range(nodes_per_replica):
            if rank not in current:
                causes.append((reasons.POD_DELETED, f"pod of node rank {rank} is gone", None, None))
    if not causes:
        return None, recheck
    causes.sort(key=lambda c: _PRIORITY.index(c[0]))
    reason, message, node, _ = causes[0]
    exclude: list[tuple[str, str]] = []
    for _, _, bad_node, why in causes:
        if why and bad_node and all(bad_node != n for n, _ in exclude):
            exclude.append((bad_node, why))
    return ReplicaFailure(reason, message, node, exclude), None


def backoff_seconds(failures_in_window: int, backoff: int, max_backoff: int) -> int:
    """Delay before creating a replica's next incarnation (spec.faultTolerance.backoffSeconds).

    The first replacement in the window is immediate; the second waits `backoff`, and each
    further one twice as long as the one before, up to `max_backoff`.
    """
    if failures_in_window <= 1:
        return 0
    return min(backoff * 2 ** min(failures_in_window - 2, 32), max_backoff)
