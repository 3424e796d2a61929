"""The replica policy: from a TrainingJob, its pods and the nodes, what to do and what status to write.

`plan(job, pods, nodes, now)` is level-based and idempotent: it compares the world with the
spec on every pass, and given the same world twice (after its status was written) the
second plan asks for nothing new. All memory lives in the job's status, which a job's user
cannot write: the replicas' generations, restarts and last failures in `status.replicas`,
the excluded nodes in `status.excludedNodes`, and the restart history in
`status.restartHistory`. So an operator restarted mid-recovery converges.

Rules:
- The current generation of a replica is the highest of its pods' generations and the one
  recorded in status (0 for a new replica); pods of older generations are deleted.
- A failed incarnation (see `failures.detect`) has all its pods deleted and the next
  generation's created (restarts + 1, lastFailure), after a backoff that doubles with each
  replacement of that replica within the restart window (the first one is immediate);
  `requeue_after` says when to look again. Hardware-class failures put the node on
  `excludedNodes` unless nodeExclusionPolicy is None; new pods avoid excluded nodes, and
  prefer (a soft preference, which the scheduler may overrule) a node other than the one
  the failed incarnation failed on.
- More than maxReplicaRestarts replacements within restartWindowSeconds fails the job:
  its worker pods are deleted (they would hold GPUs for nothing) and nothing more is
  created; the coordinator stays for inspection. Failed and Succeeded are final.
- The job is complete when its coordinator records it (`status.training.completedStep`:
  a replica committed the last step). A replica whose pods exited 0 before that failed
  (ExitedEarly, after `failures.COMPLETION_WAIT_S`). Once complete, nothing is replaced or
  created, pods not yet running are deleted, and the job is Succeeded when no worker pod
  runs any more.
- Fewer than minReplicas healthy replicas after the job ran: Degraded.
- spec.suspend deletes every worker pod; the replicas come back with their next
  generation when it is cleared.
- Replicas with ids >= spec.replicas (a scale-down) have their pods deleted.
- Hot spares (`spares.py`): a failed replica whose replacement a Ready spare can take is
  promoted at once by relabelling the spare's pods (no backoff: nothing new has to start);
  the spare is refilled in the background. Without a Ready spare, the rules above apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from transom_operator import api, reasons, resources
from transom_operator.reconcile import failures, spares
from transom_operator.reconcile.observe import ObservedNode, ObservedPod, group_pods

MAX_EXCLUDED_NODES = 1024  # as status.excludedNodes


@dataclass
class Plan:
    """What one reconcile pass asks `kube.py` to do, and the status it computed."""

    create: list[dict[str, Any]] = field(default_factory=list)  # pod manifests
    delete: list[str] = field(default_factory=list)  # pod names
    relabel: list[tuple[str, dict[str, str | None]]] = field(default_factory=list)  # (pod, labels; None removes)
    excluded_nodes_added: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    status: api.TrainingJobStatus = field(default_factory=api.TrainingJobStatus)
    requeue_after: float | None = None  # seconds until a backoff or grace period runs out

    def status_patch(self) -> dict[str, Any]:
        """The operator's part of status (not `training`, which the coordinator owns)."""
        return self.status.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"training"})

    def _requeue(self, seconds: float) -> None:
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


@dataclass
class _Replica:
    """One replica while planning."""

    id: int
    generation: int
    current: dict[int, ObservedPod]  # node rank -> pod of the current generation
    stale: list[ObservedPod]
    recorded: api.ReplicaStatus | None
    failure: failures.ReplicaFailure | None = None
    state: str = "Pending"

    @property
    def restarts(self) -> int:
        return self.recorded.restarts if self.recorded else 0

    @property
    def last_failure(self) -> api.Failure | None:
        return self.recorded.last_failure if self.recorded else None


def _group(pods: Iterable[ObservedPod], spec: api.TrainingJobSpec,
           recorded: Mapping[int, api.ReplicaStatus]) -> tuple[list[_Replica], list[ObservedPod]]:
    # Spare pods have no replica label (spares.group takes them).
    sets, extra = group_pods(pods, lambda p: p.replica, spec.replicas, spec.nodes_per_replica,
                             {i: r.generation for i, r in recorded.items()})
    return [_Replica(id=i, generation=s.generation, current=s.current, stale=s.stale, recorded=recorded.get(i))
            for i, s in enumerate(sets)], extra


def _pods_state(r: _Replica, nodes_per_replica: int) -> str:
    pods = [r.current.get(rank) for rank in range(nodes_per_replica)]
    if all(p is not None and not p.deleting and p.phase == "Succeeded" for p in pods):
        return "Succeeded"
    if all(p is not None and not p.deleting and p.phase in ("Running", "Succeeded") for p in pods):
        return "Running"
    # Coming up: the first incarnation is Pending, a later one is a replacement.
    return "Replacing" if r.last_failure is not None else "Pending"


def _condition(type_: str, true: bool, reason: str, message: str, prev: Mapping[str, api.Condition],
               generation: int | None, now: datetime) -> api.Condition:
    status = "True" if true else "False"
    old = prev.get(type_)
    since = old.last_transition_time if old is not None and old.status == status and old.last_transition_time else now
    return api.Condition(type=type_, status=status, reason=reason, message=message,
                         last_transition_time=since, observed_generation=generation)


def plan(job: api.TrainingJob, pods: Iterable[ObservedPod],
         nodes: Mapping[str, ObservedNode] | Iterable[ObservedNode], now: datetime) -> Plan:
    """Actions and status for one reconcile pass of `job` (see the module docstring)."""
    spec, ft = job.spec, job.spec.fault_tolerance
    name = job.metadata["name"]
    prev = job.status or api.TrainingJobStatus()
    node_map = dict(nodes) if isinstance(nodes, Mapping) else {n.name: n for n in nodes}
    out = Plan()
    now_s = int(now.timestamp())

    history = [h for h in prev.restart_history if now_s - h.time < ft.restart_window_seconds]
    training = prev.training or api.TrainingProgress()
    completed = training.completed_step is not None  # the coordinator's record, not a pod's exit
    verdicts = {(v.replica, v.generation): v for v in training.verdicts}
    excluded = {e.name: e for e in prev.excluded_nodes}
    pods = list(pods)
    replicas, extra = _group(pods, spec, {r.id: r for r in prev.replicas})
    spare_list, spare_extra = spares.group(pods, spec, {s.id: s for s in prev.spares})
    was_failed = prev.state == "Failed"
    was_succeeded = prev.state == "Succeeded"
    final = was_failed or was_succeeded
    suspended = spec.suspend and not final

    out.delete.extend(p.name for p in extra if not p.deleting)

    # --- detect ---------------------------------------------------------------------
    if not suspended and not final:
        for r in replicas:
            rec = r.recorded
            recorded_running = (rec is not None and rec.generation == r.generation
                                and rec.state in ("Running", "Succeeded"))
            incarnation = failures.Incarnation(r.id, r.generation, r.current, recorded_running,
                                               verdicts.get((r.id, r.generation)))
            r.failure, recheck = failures.detect(
                incarnation, nodes_per_replica=spec.nodes_per_replica, nodes=node_map, history=history,
                grace_seconds=ft.node_not_ready_grace_seconds, completed=completed, now=now,
            )
            if recheck is not None:
                out._requeue(recheck)
    training_done = completed

    failed_now: tuple[str, str] | None = None
    if not suspended and not final and not training_done:
        for r in replicas:
            if r.failure and all((h.replica, h.generation) != (r.id, r.generation) for h in history):
                history.append(api.RestartRecord(replica=r.id, generation=r.generation, time=now_s,
                                                 node=r.failure.node))
        if len(history) > ft.max_replica_restarts:
            failing = ", ".join(str(r.id) for r in replicas if r.failure)
            failed_now = (reasons.TOO_MANY_RESTARTS,
                          f"{len(history)} replica replacements within {ft.restart_window_seconds}s, more than "
                          f"maxReplicaRestarts {ft.max_replica_restarts} (last failed: replica {failing})")

    # --- act ------------------------------------------------------------------------
    new_restarts = 0
    statuses: list[api.ReplicaStatus] = []
    for r in replicas:
        restarts, last_failure, generation = r.restarts, r.last_failure, r.generation
        if suspended:
            if r.current or r.stale:
                out.delete.extend(p.name for p in [*r.current.values(), *r.stale] if not p.deleting)
            if r.current:
                generation += 1  # resume as a new incarnation the coordinator has not seen
            statuses.append(api.ReplicaStatus(id=r.id, generation=generation, state="Pending",
                                              restarts=restarts, last_failure=last_failure))
            continue
        if final or failed_now or (training_done and r.failure):
            state = _pods_state(r, spec.nodes_per_replica)
            if r.failure or (final and r.recorded and r.recorded.state == "Failed"):
                state = "Failed"
                if r.failure:
                    last_failure = api.Failure(reason=r.failure.reason, message=r.failure.message, time=now)
            statuses.append(api.ReplicaStatus(
                id=r.id, generation=generation, state=state, restarts=restarts, last_failure=last_failure,
                nodes=[r.current[k].node_name for k in sorted(r.current) if r.current[k].node_name],
            ))
            continue

        stale = list(r.stale)
        current = dict(r.current)
        if r.failure:
            stale.extend(current.values())
            current = {}
            generation += 1
            restarts += 1
            new_restarts += 1
            last_failure = api.Failure(reason=r.failure.reason, message=r.failure.message, time=now)
            out.events.append((reasons.WARNING, reasons.EVENT_REPLICA_FAILED,
                               f"Replica {r.id} generation {r.generation} failed: {r.failure.message}"))
            if ft.node_exclusion_policy != "None":
                for node, why in r.failure.exclude:
                    if node not in excluded and len(excluded) < MAX_EXCLUDED_NODES:
                        excluded[node] = api.ExcludedNode(name=node, reason=why, time=now)
                        out.excluded_nodes_added.append((node, why))
                        out.events.append((reasons.WARNING, reasons.EVENT_NODE_EXCLUDED,
                                           f"Excluded node {node} from job {name}: {why}"))
            spare = spares.take_ready(spare_list, spec.nodes_per_replica, node_map, excluded)
            if spare is not None:
                current, patches = spares.promote(spare, r.id, generation)
                out.relabel.extend(patches)
                out.events.append((reasons.NORMAL, reasons.EVENT_SPARE_PROMOTED,
                                   f"Spare {spare.id} took over replica {r.id} as generation {generation}"))
        out.delete.extend(p.name for p in stale if not p.deleting)

        missing = [rank for rank in range(spec.nodes_per_replica) if rank not in current]
        if missing:
            delay = 0
            if last_failure is not None and last_failure.time is not None:
                in_window = sum(1 for h in history if h.replica == r.id)
                delay = failures.backoff_seconds(in_window, ft.backoff_seconds, ft.max_backoff_seconds)
                wait = (last_failure.time - now).total_seconds() + delay
            else:
                wait = 0
            if wait <= 0:
                # Where the last incarnation failed, even for a reason not blamed on the node.
                failed_on = {h.node for h in history if h.replica == r.id and h.generation == generation - 1 and h.node}
                failed_on |= {p.node_name for p in stale if p.node_name}
                for rank in missing:
                    out.create.append(resources.worker_pod(job, r.id, rank, generation, excluded_nodes=excluded,
                                                           avoid_nodes=failed_on))
                if len(missing) == spec.nodes_per_replica and last_failure is not None and generation > 0:
                    out.events.append((reasons.NORMAL, reasons.EVENT_REPLICA_REPLACED,
                                       f"Creating replica {r.id} generation {generation}"))
            else:
                out._requeue(wait)
        view = _Replica(r.id, generation, current, [], r.recorded)
        state = _pods_state(view, spec.nodes_per_replica)
        # A promoted spare's pods too: until a later pass sees them relabelled, recording the
        # replica Running would make their absence (a crash before the relabel) a new failure.
        if r.failure or (state == "Pending" and last_failure is not None):
            state = "Replacing"
        if training_done and state == "Replacing":  # too late: it is not replaced any more
            state = "Failed"
        statuses.append(api.ReplicaStatus(
            id=r.id, generation=generation, state=state, restarts=restarts, last_failure=last_failure,
            nodes=[current[k].node_name for k in sorted(current) if current[k].node_name],
        ))

    if failed_now or final:
        out.create.clear()
        out.delete.clear()
        if failed_now or was_failed:  # a failed job stops: its pods would hold GPUs for nothing
            out.delete.extend(p.name for r in replicas for p in [*r.current.values(), *r.stale]
                              if not p.deleting and p.phase != "Succeeded")
    elif training_done:  # nothing new starts; what has not started yet never will be needed
        out.create.clear()
        out.delete.extend(p.name for r in replicas for p in r.current.values()
                          if not p.deleting and p.phase == "Pending" and p.name not in out.delete)
    # Spares serve only a job that is still training; otherwise they would hold GPUs for nothing.
    active = not (suspended or final or failed_now or training_done)
    spare_plan = spares.plan(job, spare_list, spare_extra, active, node_map, excluded, now)
    out.create.extend(spare_plan.create)
    out.delete.extend(spare_plan.delete)
    if spare_plan.requeue_after is not None:
        out._requeue(spare_plan.requeue_after)

    # --- status ---------------------------------------------------------------------
    healthy = sum(1 for s in statuses if s.state in ("Running", "Succeeded"))
    replacing = [s.id for s in statuses if s.state == "Replacing"]
    # Complete, and no worker still runs: the others got "job completed" and exited 0.
    all_done = training_done and not any(p.phase == "Running" and not p.deleting
                                         for r in replicas for p in r.current.values())
    ran_before = prev.state in ("Running", "Recovering", "Degraded") or any(s.restarts for s in statuses)
    if suspended:
        state = "Suspended"
    elif was_failed or failed_now:
        state = "Failed"
    elif was_succeeded or all_done:
        state = "Succeeded"
    elif healthy < spec.min_replicas:
        state = "Degraded" if ran_before else "Pending"
    elif replacing:
        state = "Recovering"
    else:
        state = "Running"

    gen = job.metadata.get("generation")
    prev_conditions = {c.type: c for c in prev.conditions}
    old_failed = prev_conditions.get("Failed")
    failed_message = (failed_now[1] if failed_now
                      else old_failed.message if was_failed and old_failed and old_failed.message else "")

    if state == "Running" and healthy == spec.replicas:
        ready_reason, ready_message = reasons.ALL_REPLICAS_HEALTHY, f"all {healthy} replicas running"
    else:
        ready_reason = {
            "Suspended": reasons.SUSPENDED, "Failed": reasons.TOO_MANY_RESTARTS,
            "Succeeded": reasons.TRAINING_COMPLETE, "Degraded": reasons.BELOW_MIN_REPLICAS,
            "Recovering": reasons.REPLACING_REPLICAS,
        }.get(state, reasons.REPLICAS_STARTING)
        ready_message = f"{healthy} of {spec.replicas} replicas running"
    replacing_message = ("replacing replica " + ", ".join(map(str, replacing))) if replacing else "no replica is being replaced"
    degraded = state == "Degraded"
    recovering = bool(replacing) and state in ("Recovering", "Degraded")
    conditions = [
        _condition("Ready", ready_reason == reasons.ALL_REPLICAS_HEALTHY, ready_reason, ready_message,
                   prev_conditions, gen, now),
        _condition("Degraded", degraded,
                   reasons.BELOW_MIN_REPLICAS if degraded else reasons.ENOUGH_REPLICAS,
                   f"{healthy} of {spec.replicas} replicas healthy, minReplicas is {spec.min_replicas}"
                   + ("; training pauses" if degraded else ""), prev_conditions, gen, now),
        _condition("Recovering", recovering,
                   reasons.REPLACING_REPLICAS if recovering else reasons.NO_REPLACEMENT,
                   replacing_message if recovering else "no replica is being replaced", prev_conditions, gen, now),
        _condition("Succeeded", state == "Succeeded",
                   reasons.TRAINING_COMPLETE if state == "Succeeded" else reasons.NOT_COMPLETE,
                   "training finished" if state == "Succeeded" else "training has not finished",
                   prev_conditions, gen, now),
        _condition("Failed", state == "Failed",
                   reasons.TOO_MANY_RESTARTS if state == "Failed" else reasons.NOT_FAILED,
                   failed_message or "the job has not failed", prev_conditions, gen, now),
    ]

    if state != prev.state:
        transition_events = {
            "Degraded": (reasons.WARNING, reasons.EVENT_JOB_DEGRADED,
                         f"{healthy} of {spec.replicas} replicas healthy, fewer than minReplicas {spec.min_replicas}"),
            "Failed": (reasons.WARNING, reasons.EVENT_JOB_FAILED, failed_message),
            "Succeeded": (reasons.NORMAL, reasons.EVENT_JOB_SUCCEEDED, "training finished"),
            "Suspended": (reasons.NORMAL, reasons.EVENT_JOB_SUSPENDED, "deleting the job's worker pods"),
        }
        if state in transition_events:
            out.events.append(transition_events[state])

    out.status = api.TrainingJobStatus(
        observed_generation=gen,
        state=state,
        healthy=f"{healthy}/{spec.replicas}",
        conditions=conditions,
        healthy_replicas=healthy,
        total_restarts=(prev.total_restarts or 0) + (0 if failed_now else new_restarts),
        replicas=statuses,
        ready_spare_replicas=(sum(1 for s in spare_plan.statuses if s.state == "Ready")
                              if spec.spare_replicas or prev.spares else None),
        spares=spare_plan.statuses,
        restart_history=sorted(history, key=lambda h: (h.time, h.replica, h.generation)),
        excluded_nodes=list(excluded.values()),
        training=prev.training,
    )
    return out
