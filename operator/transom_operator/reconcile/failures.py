"""When a replica has failed, why, and which node is to blame: one policy, no I/O.

A replica (one incarnation: the pods of its current generation) fails when one of its pods
- sits on a node that has been NotReady for longer than nodeNotReadyGraceSeconds (NodeNotReady),
- was lost with its node (NodeLost),
- is named by a verdict of the job's coordinator in `status.training.verdicts`
  (FlaggedByCoordinator),
- was evicted (PodEvicted): by the kubelet (node pressure), or on someone's request, which its
  DisruptionTarget condition says (a drain through the eviction API, a preemption, a NoExecute
  taint). A requested one is voluntary: never blamed on the node, and counted neither against
  maxReplicaRestarts nor towards the backoff (replicas.py),
- was OOMKilled (OOMKilled: the container's memory, never the node's fault; oom.py),
- exited non-zero (PodFailed),
- exited with the launcher's EXIT_PREFLIGHT_FAILED (PreflightFailed): a pre-flight check
  (transom.check) failed on its node before its workers started. Hardware class: the node is
  excluded. Only the pod's own node: a pod can say nothing about any other node (as with two
  failures in a row on one node, RepeatedFailures, which a script could cause as well),
- exited with the launcher's EXIT_SCRIPT_ERROR (ScriptError): the script raised an error that
  every incarnation would raise again. It comes first and ends the job (replicas.py): it is
  never replaced and never blamed on a node. The exit code and the termination message are
  the pod's own, about its own replica and its job's own script, so nothing else is
  trusted to them,
- exited 0 although the coordinator has not recorded the job complete (ExitedEarly),
- is being deleted, or is gone although the replica was recorded Running (PodDeleted); gone
  without a trace from a node that is cordoned, it was drained (PodEvicted, requested).
Hardware-class failures name the node to exclude: NodeNotReady, NodeLost, PreflightFailed, a
verdict that blames a node, and a second failure on the same node within the restart window
(RepeatedFailures).

Every input is something a job's user cannot write: pod and node status (kubelet, node
controller), the operator's own status (the restart history) and the coordinator's part of
status. Pod annotations and labels from the template are never read as a verdict.

The restart history (one record per replaced incarnation, kept in `status.restartHistory`
so that it survives operator restarts) is what the restart limit, the backoff and the
repeated-failure rule count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from transom import contract
from transom_operator import api, reasons
from transom_operator.reconcile import oom
from transom_operator.reconcile.observe import ObservedNode, ObservedPod, PodPhase

# Pod status reasons that mean the node went away under the pod.
NODE_LOST_POD_REASONS = frozenset({"NodeLost", "NodeShutdown", "Terminated"})  # Terminated: graceful node shutdown
# How long a pod that exited 0 may wait for the coordinator's completion record before it
# counts as an early exit. The launcher exits 0 only after the coordinator confirmed the
# completion, and the coordinator writes status.training at once when it happens.
COMPLETION_WAIT_S = 30.0
MAX_TERMINATION_MESSAGE = 2048  # of a failure's message (4096 at most)
# DisruptionTarget reasons (ObservedPod.disruption) of a deletion someone asked for: a drain or
# any other use of the eviction API (the job's PodDisruptionBudget allowed it), the scheduler
# preempting for a pod of higher priority (PreemptionByKubeScheduler before Kubernetes 1.27), a
# NoExecute taint on a Ready node. A cluster upgrade drains every node once: that must neither
# exclude nodes nor use up the job's restart budget.
VOLUNTARY_DISRUPTIONS = frozenset({"EvictionByEvictionAPI", "PreemptionByScheduler", "PreemptionByKubeScheduler",
                                   "DeletionByTaintManager"})
TAINT_EVICTION = "DeletionByTaintManager"

# Order in which causes are reported when a replica has several at once.
_PRIORITY = (
    reasons.SCRIPT_ERROR, reasons.NODE_NOT_READY, reasons.NODE_LOST, reasons.FLAGGED_BY_COORDINATOR,
    reasons.PREFLIGHT_FAILED, reasons.POD_EVICTED, reasons.OOM_KILLED, reasons.POD_FAILED, reasons.EXITED_EARLY,
    reasons.POD_DELETED,
)


@dataclass
class ReplicaFailure:
    """Why one incarnation of a replica failed, and which nodes to exclude for it."""

    reason: str
    message: str
    node: str | None  # the node of the pod that failed first (for the history)
    exclude: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    voluntary: bool = False  # a requested eviction (VOLUNTARY_DISRUPTIONS): not in the restart history


@dataclass(frozen=True)
class Incarnation:
    """One incarnation of a replica as `detect` sees it."""

    replica: int
    generation: int
    current: Mapping[int, ObservedPod]  # node rank -> pod of this generation
    recorded_running: bool  # status recorded it with every pod running: a missing pod was lost
    verdict: api.Verdict | None  # the coordinator's verdict about this generation, if any
    # node rank -> the last state of a pod of this generation that is gone from the API (its
    # DELETED event's): a pod deleted before any pass saw it deleting is judged from it.
    departed: Mapping[int, ObservedPod] = field(default_factory=dict)
    # The nodes status recorded for this incarnation's pods, by node rank: where a pod that is
    # gone without a trace (no DELETED event seen by this instance) last ran.
    recorded_nodes: Sequence[str] = ()


def detect(inc: Incarnation, *, nodes_per_replica: int, nodes: Mapping[str, ObservedNode],
           history: list[api.RestartRecord], grace_seconds: int, completed: bool,
           now: datetime) -> tuple[ReplicaFailure | None, float | None]:
    """The failure of `inc`, if any, and the seconds until a grace period runs out (when to
    look again). `completed`: the coordinator recorded the job complete, so a pod that
    exited 0 finished."""
    causes: list[tuple[str, str, str | None, str | None]] = []  # reason, message, node, exclude-reason
    asked: list[tuple[str, str, str | None, str | None]] = []  # the causes that are requested evictions
    recheck: float | None = None

    def later(seconds: float) -> None:
        nonlocal recheck
        recheck = seconds if recheck is None else min(recheck, seconds)

    pods = {rank: replace(p, deleting=True) for rank, p in inc.departed.items() if rank not in inc.current}
    pods.update(inc.current)
    for rank in sorted(pods):
        pod = pods[rank]
        node = nodes.get(pod.node_name) if pod.node_name else None
        if node is not None and not node.ready and node.not_ready_since is not None:
            elapsed = (now - node.not_ready_since).total_seconds()
            if elapsed >= grace_seconds:
                causes.append((reasons.NODE_NOT_READY,
                               f"node {node.name} of pod {pod.name} NotReady for {int(elapsed)}s",
                               node.name, reasons.NODE_NOT_READY))
            else:
                later(grace_seconds - elapsed)
        if pod.phase == PodPhase.RUNNING and not pod.deleting:
            continue  # the common case, and nothing below applies to it
        where = f" on node {pod.node_name}" if pod.node_name else ""
        if pod.phase == PodPhase.FAILED:
            causes.append(_failed(pod, where, node, asked, inc, history))
        elif pod.phase == PodPhase.SUCCEEDED and not completed:
            waited = (now - pod.finished).total_seconds() if pod.finished else COMPLETION_WAIT_S
            if waited >= COMPLETION_WAIT_S:
                causes.append((reasons.EXITED_EARLY,
                               f"pod {pod.name}{where} exited 0 but the coordinator has not recorded the job "
                               "complete", pod.node_name, None))
            else:
                later(COMPLETION_WAIT_S - waited)
        elif pod.deleting:
            causes.append(_deleted(pod, where, node, asked))
    if inc.verdict is not None:
        causes.append(_verdict_cause(inc.verdict, inc.current))
    if inc.recorded_running:
        for rank in range(nodes_per_replica):
            if rank not in pods:
                causes.append(_gone(rank, inc.recorded_nodes, nodes, asked))
    if not causes:
        return None, recheck
    causes.sort(key=lambda c: _PRIORITY.index(c[0]))
    reason, message, first_node, _ = causes[0]
    exclude: list[tuple[str, str]] = []
    for _, _, bad_node, why in causes:
        if why and bad_node and all(bad_node != n for n, _ in exclude):
            exclude.append((bad_node, why))
    return ReplicaFailure(reason, message, first_node, exclude, voluntary=causes[0] in asked), None


def _failed(pod: ObservedPod, where: str, node: ObservedNode | None,
            asked: list[tuple[str, str, str | None, str | None]], inc: Incarnation,
            history: list[api.RestartRecord]) -> tuple[str, str, str | None, str | None]:
    """The cause of a pod in phase Failed: its node lost, an eviction, a deletion, a script
    error, an OOM kill, or a failure (a second one on the same node blames the node)."""
    if pod.reason in NODE_LOST_POD_REASONS:
        return (reasons.NODE_LOST, f"pod {pod.name}{where} lost with its node ({pod.reason})",
                pod.node_name, reasons.NODE_LOST if pod.node_name else None)
    if pod.reason == "Evicted":
        return reasons.POD_EVICTED, f"pod {pod.name}{where} evicted", pod.node_name, None
    if pod.deleting:
        # Deleted (by a user, a drain), and its containers' exit on the way out (143: the
        # SIGTERM) says nothing about the node: a deletion, not a pod failure.
        return _deleted(pod, where, node, asked)
    if pod.exit_code == contract.EXIT_SCRIPT_ERROR:
        return reasons.SCRIPT_ERROR, script_error_message(pod), pod.node_name, None
    if is_preflight_failure(pod):
        return (reasons.PREFLIGHT_FAILED, preflight_message(pod, where), pod.node_name,
                reasons.PREFLIGHT_FAILED if pod.node_name else None)
    if oom.is_oom_killed(pod):
        return reasons.OOM_KILLED, oom.pod_message(pod, where), pod.node_name, None
    code = "" if pod.exit_code is None else f" with exit code {pod.exit_code}"
    repeated = pod.node_name is not None and any(
        h.node == pod.node_name and (h.replica, h.generation) != (inc.replica, inc.generation) for h in history
    )
    message = f"pod {pod.name}{where} failed{code}"
    if repeated:
        message += f"; a second failure on node {pod.node_name} within the restart window"
    return reasons.POD_FAILED, message, pod.node_name, reasons.REPEATED_FAILURES if repeated else None


def _deleted(pod: ObservedPod, where: str, node: ObservedNode | None,
             asked: list[tuple[str, str, str | None, str | None]]) -> tuple[str, str, str | None, str | None]:
    """The cause of a pod being deleted, as far as its DisruptionTarget condition tells who asked
    (a requested eviction is also put on `asked`)."""
    if pod.disruption is None:
        return reasons.POD_DELETED, f"pod {pod.name} deleted", pod.node_name, None
    if pod.disruption == TAINT_EVICTION and node is not None and not node.ready:
        # The node's not-ready or unreachable taint outlasted the pod's toleration (300 s by
        # default) before nodeNotReadyGraceSeconds did: the node is lost all the same.
        return (reasons.NODE_NOT_READY, f"pod {pod.name}{where} evicted by the taint manager: node {node.name} "
                f"NotReady", node.name, reasons.NODE_NOT_READY)
    if pod.disruption not in VOLUNTARY_DISRUPTIONS:  # the kubelet's own (TerminationByKubelet, ...)
        return reasons.POD_EVICTED, f"pod {pod.name}{where} evicted ({pod.disruption})", pod.node_name, None
    # The node did not fail: it is named in the message, not in the history (whose nodes the
    # repeated-failure rule counts).
    cause = (reasons.POD_EVICTED, f"pod {pod.name}{where} evicted ({pod.disruption}): a voluntary disruption, "
             "not counted against maxReplicaRestarts", None, None)
    asked.append(cause)
    return cause


def _gone(rank: int, recorded_nodes: Sequence[str], nodes: Mapping[str, ObservedNode],
          asked: list[tuple[str, str, str | None, str | None]]) -> tuple[str, str, str | None, str | None]:
    """The cause of a pod that is gone without a trace: this instance of the operator never saw
    it deleting nor its DELETED event (it started, or took the Lease, after the pod went: a
    drain that evicted the leader with the pod). Gone from a node that is cordoned, it was
    drained (kubectl drain, an upgrade, an autoscaler's scale-down cordon first and then evict):
    a requested eviction, like one whose DisruptionTarget condition was seen. Only a cluster
    admin can cordon a node, so a job's user cannot make a failure look voluntary this way."""
    node = nodes.get(recorded_nodes[rank]) if rank < len(recorded_nodes) else None
    if node is None or not node.cordoned:
        return reasons.POD_DELETED, f"pod of node rank {rank} is gone", None, None
    cause = (reasons.POD_EVICTED, f"pod of node rank {rank} is gone from node {node.name}, which is cordoned: "
             "taken as a drain, a voluntary disruption, not counted against maxReplicaRestarts", None, None)
    asked.append(cause)
    return cause


def script_error_message(pod: ObservedPod) -> str:
    """What a job that a ScriptError ended says: the pod, the error (its launcher wrote it as
    the termination message) and what to do."""
    error = (pod.message or "").strip()[:MAX_TERMINATION_MESSAGE] or "its log has the traceback"
    return (f"pod {pod.name} exited {contract.EXIT_SCRIPT_ERROR}: the training script is wrong, and retrying "
            f"cannot help: {error}; fix the script and create the job again")


def is_preflight_failure(pod: ObservedPod) -> bool:
    """The pod's launcher exited EXIT_PREFLIGHT_FAILED: a check failed on its node."""
    return pod.phase == PodPhase.FAILED and not pod.deleting and pod.exit_code == contract.EXIT_PREFLIGHT_FAILED


def preflight_checks(message: str) -> list[str]:
    """The checks a pre-flight failure's message names ("compute: ..."; "memory: ..."), for the
    metric's label: only names of contract.PREFLIGHT_CHECKS, so the pod's words cannot grow it."""
    return [c for c in contract.PREFLIGHT_CHECKS if f"{c}: " in message]


def preflight_message(pod: ObservedPod, where: str) -> str:
    """What a pod whose pre-flight failed says: its node and the launcher's termination
    message (the checks that failed, their values and expected ranges)."""
    found = (pod.message or "").strip()[:MAX_TERMINATION_MESSAGE] or "its log has the checks' results"
    return f"pod {pod.name}{where} failed its pre-flight checks: {found}"


def _verdict_cause(verdict: api.Verdict, current: Mapping[int, ObservedPod]) -> tuple[str, str, str | None, str | None]:
    pod = current.get(verdict.node_rank) if verdict.node_rank is not None else None
    node = pod.node_name if pod is not None else None
    message = f"the coordinator found {verdict.reason}" + (f": {verdict.message}" if verdict.message else "")
    blamed = reasons.FLAGGED_BY_COORDINATOR if verdict.blame == "Node" and node else None
    return reasons.FLAGGED_BY_COORDINATOR, message, node, blamed


# nodeExclusionPolicy values that change a node for every workload on it, not just this job:
# the operator carries them out only where the cluster admin allowed it.
NODE_ACTIONS = ("Taint", "Cordon")


def node_action(requested: str, allowed: frozenset[str]) -> tuple[str, str | None]:
    """The exclusion policy carried out for a job that asks for `requested`, and why it differs.

    A job's user writes the spec; tainting or cordoning nodes is the cluster admin's call
    (`transom-operator --allow-node-taint/--allow-node-cordon`, the chart's `nodeExclusion`
    values). Otherwise the node is excluded for this job only.
    """
    if requested in NODE_ACTIONS and requested not in allowed:
        return "Exclude", (f"nodeExclusionPolicy {requested} is not allowed by this installation of the "
                           f"operator (--allow-node-{requested.lower()}); the node is excluded for this job only")
    return requested, None


def backoff_seconds(failures_in_window: int, backoff: int, max_backoff: int) -> int:
    """Delay before creating a replica's next incarnation (spec.faultTolerance.backoffSeconds).

    The first replacement in the window is immediate; the second waits `backoff`, and each
    further one twice as long as the one before, up to `max_backoff`.
    """
    if failures_in_window <= 1:
        return 0
    return min(backoff * 2 ** min(failures_in_window - 2, 32), max_backoff)
