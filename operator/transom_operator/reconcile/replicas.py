"""The replica policy: from a TrainingJob, its pods and the nodes, what to do and what status to write.

`plan(job, pods, nodes, now)` is level-based and idempotent: it compares the world with the
spec on every pass, and given the same world twice (after its status was written) the second
plan asks for nothing new. One pass runs in stages: detect each replica's failure, count it
against the restart budget, act per replica (suspend, freeze, or replace and create what is
missing), settle what a final or complete job may still do, then the status (the job-level
state and conditions are job_status.py's). All memory lives in the job's status, which a
job's user cannot write: the replicas' generations, restarts and last failures in
`status.replicas`, the excluded nodes in `status.excludedNodes`, and the restart history in
`status.restartHistory`. So an operator restarted mid-recovery converges.

A pass writes the status at the same time as it creates pods (controller.py), and deletes
and relabels only once the status is written. So an operator killed between a replacement's
pod creates and its status write leaves pods of a generation the status has not recorded,
beside the failed incarnation's pods, which nothing has deleted yet: the next pass finds
the failure on those again and records it then (restarts, lastFailure, the history), so no
restart is lost from the count however the pass was cut short.

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
- A replica that failed with a ScriptError (its launcher exited EXIT_SCRIPT_ERROR: the
  script is wrong, and every replica and every incarnation would fail the same way) fails
  the job at once, the same way, with reason ScriptError: nothing is replaced or counted
  as a restart, and no node is excluded. The pods that ended so are kept for their logs.
- Repeated OOM kills of one replica fail the job the same way, with reason OOMKilled
  (`oom.ends_job`); a kill its launcher restarted in place, which the coordinator reported
  in status.training.oomKills, becomes the replica's lastFailure with an Event (`oom.in_place`).
- The job is complete when its coordinator records it (`status.training.completedStep`:
  a replica committed the last step). A replica whose pods exited 0 before that failed
  (ExitedEarly, after `failures.COMPLETION_WAIT_S`). Once complete, nothing is replaced or
  created, pods not yet running are deleted, and the job is Succeeded when no worker pod
  runs any more.
- A voluntary eviction (`failures.VOLUNTARY_DISRUPTIONS`: a drain, a preemption) replaces the
  replica like any failure (restarts + 1, lastFailure PodEvicted), but it is not put in the
  restart history: it counts neither against maxReplicaRestarts nor towards the backoff, and
  its node is never blamed. A cluster upgrade drains every node once.
- A pod that waits for an image the kubelet cannot pull is left alone (the kubelet retries
  with its own backoff; a new pod would pull again): the replica's status entry gets
  `reason` ImagePullFailed and a `message` naming the pod, container, image and the
  kubelet's reason, and its incarnation one Warning Event (the recorded reason says it was
  told). The other replicas train on.
- Fewer than minReplicas healthy replicas after the job ran: Degraded.
- spec.suspend deletes every worker pod; the replicas come back with their next
  generation when it is cleared.
- A job queued through Kueue (`admission.py`) is handled as suspended (state Queued) until
  Kueue admits it, and again after an eviction; its pods are placed where the admission says.
- Replicas with ids >= spec.replicas (a scale-down) have their pods deleted.
- Hot spares (`spares.py`): a failed replica whose replacement a Ready spare can take is
  promoted at once by relabelling the spare's pods (no backoff: nothing new has to start);
  the spare is refilled in the background. Without a Ready spare, the rules above apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

from transom import contract
from transom_operator import api, reasons, resources
from transom_operator.reconcile import admission as kueue
from transom_operator.reconcile import failures, job_status, oom, spares
from transom_operator.reconcile.observe import ObservedNode, ObservedPod, PodPhase, group_pods

J, R, S = api.JobState, api.ReplicaPhase, api.SpareState

MAX_EXCLUDED_NODES = 1024  # as status.excludedNodes
# A job waiting for Kueue reads its Workload again this often (no watch on Workloads: the
# operator needs no Kueue installed to start, nor permission to watch Workloads everywhere).
QUEUED_POLL_S = 2.0
MAX_HELD_MESSAGE = 1024  # as status.replicas[].message


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
    state: api.ReplicaPhase = R.PENDING
    # The failure that made the current generation, when the pass that replaced it was cut
    # short before its status write (`unrecorded`).
    lost: failures.ReplicaFailure | None = None
    lost_at: datetime | None = None
    in_place: api.Failure | None = None  # an OOM kill of the current incarnation, restarted in place

    @cached_property  # asked several times per replica and pass; its inputs never change
    def unrecorded(self) -> int:
        """Generations of pods newer than the recorded one: created by a pass whose status
        write never happened (an operator killed in between, or the write failed)."""
        if self.recorded is None or not self.current:
            return 0
        return max(0, self.generation - self.recorded.generation)

    @property
    def restarts(self) -> int:
        return (self.recorded.restarts if self.recorded else 0) + self.unrecorded

    @property
    def last_failure(self) -> api.Failure | None:
        if self.in_place is not None:
            return self.in_place
        if self.lost is not None:
            return api.Failure(reason=self.lost.reason, message=self.lost.message, time=self.lost_at)
        return self.recorded.last_failure if self.recorded else None


def _group(pods: Iterable[ObservedPod], spec: api.TrainingJobSpec,
           recorded: Mapping[int, api.ReplicaStatus]) -> tuple[list[_Replica], list[ObservedPod]]:
    # Spare pods have no replica label (spares.group takes them).
    sets, extra = group_pods(pods, lambda p: p.replica, spec.replicas, spec.nodes_per_replica,
                             {i: r.generation for i, r in recorded.items()})
    return [_Replica(id=i, generation=s.generation, current=s.current, stale=s.stale, recorded=recorded.get(i))
            for i, s in enumerate(sets)], extra


def _pods_state(r: _Replica, nodes_per_replica: int) -> api.ReplicaPhase:
    succeeded = True
    for rank in range(nodes_per_replica):
        p = r.current.get(rank)
        phase = None if p is None or p.deleting else p.phase
        if phase != PodPhase.RUNNING and phase != PodPhase.SUCCEEDED:
            # Coming up: the first incarnation is Pending, a later one is a replacement.
            return R.REPLACING if r.last_failure is not None else R.PENDING
        succeeded = succeeded and phase == PodPhase.SUCCEEDED
    return R.SUCCEEDED if succeeded else R.RUNNING


def _replica_status(r: _Replica, generation: int, state: str, restarts: int, last_failure: api.Failure | None,
                    nodes: list[str], held: tuple[str, str] | None = None) -> api.ReplicaStatus:
    """The replica's entry in status: the recorded one itself when nothing in it changed, as for
    nearly every replica of a large job on any pass (building 250 validated entries again is
    most of such a pass's planning time). `held`: (reason, message) of what keeps it from running."""
    rec = r.recorded
    reason, message = held or (None, None)
    if (rec is not None and rec.generation == generation and rec.state == state and rec.restarts == restarts
            and rec.nodes == nodes and rec.last_failure == last_failure and rec.reason == reason
            and rec.message == message):
        return rec
    return api.ReplicaStatus(id=r.id, generation=generation, state=state, restarts=restarts,
                             last_failure=last_failure, nodes=nodes, reason=reason, message=message)


@dataclass
class _Pass:
    """What one reconcile pass knows, shared by its stages."""

    job: api.TrainingJob
    now: datetime
    node_map: dict[str, ObservedNode]
    history: list[api.RestartRecord]  # replacements within the restart window, this pass's included
    excluded: dict[str, api.ExcludedNode]
    completed: bool  # the coordinator recorded the last step committed
    suspended: bool
    final: bool  # Failed or Succeeded before this pass
    out: Plan
    admission: kueue.Admission | None = None  # None: the job does not queue through Kueue
    new_restarts: int = 0  # replicas this pass starts a new generation of

    @property
    def spec(self) -> api.TrainingJobSpec:
        return self.job.spec

    @property
    def ft(self) -> api.FaultTolerance:
        return self.job.spec.fault_tolerance


def plan(job: api.TrainingJob, pods: Iterable[ObservedPod],
         nodes: Mapping[str, ObservedNode] | Iterable[ObservedNode], now: datetime,
         departed: Iterable[ObservedPod] = (), admission: kueue.Admission | None = None) -> Plan:
    """Actions and status for one reconcile pass of `job` (see the module docstring).
    `departed`: the last state of the job's pods deleted lately (WatchCache.departed);
    `admission`: what Kueue allows, for a job queued through it."""
    spec = job.spec
    prev = job.status or api.TrainingJobStatus()
    now_s = int(now.timestamp())
    training = prev.training or api.TrainingProgress()
    final = prev.state in (J.FAILED, J.SUCCEEDED)
    ps = _Pass(
        job=job, now=now, out=Plan(),
        node_map=dict(nodes) if isinstance(nodes, Mapping) else {n.name: n for n in nodes},
        history=[h for h in prev.restart_history if now_s - h.time < spec.fault_tolerance.restart_window_seconds],
        excluded={e.name: e for e in prev.excluded_nodes},
        completed=training.completed_step is not None,  # the coordinator's record, not a pod's exit
        suspended=(spec.suspend or (admission is not None and not admission.admitted)) and not final,
        final=final, admission=admission,
    )
    pods = list(pods)
    replicas, extra = _group(pods, spec, {r.id: r for r in prev.replicas})
    spare_list, spare_extra = spares.group(pods, spec, {s.id: s for s in prev.spares})
    ps.out.delete.extend(p.name for p in extra if not p.deleting)

    if not ps.suspended and not ps.final:
        _detect(ps, replicas, {(v.replica, v.generation): v for v in training.verdicts}, departed)
        _oom_in_place(ps, replicas, oom.records(training))
        for failure in spares.preflight_failures(spare_list):
            _exclude_nodes(ps, failure)
    failed_now = None
    if not ps.suspended and not ps.final and not ps.completed:
        failed_now = _script_error(replicas) or _out_of_memory(ps, replicas) or _over_budget(ps, replicas)

    statuses: list[api.ReplicaStatus] = []
    for r in replicas:
        if ps.suspended:
            statuses.append(_suspend(ps, r))
        elif ps.final or failed_now or (ps.completed and r.failure):
            statuses.append(_frozen(ps, r))
        else:
            statuses.append(_replace(ps, r, spare_list))
    _settle(ps, replicas, failed_now, prev.state == J.FAILED)

    # Spares serve only a job that is still training; otherwise they would hold GPUs for nothing.
    active = not (ps.suspended or ps.final or failed_now or ps.completed)
    spare_plan = spares.plan(job, spare_list, spare_extra, active, ps.node_map, ps.excluded, now)
    ps.out.create.extend(spare_plan.create)
    ps.out.delete.extend(spare_plan.delete)
    if spare_plan.requeue_after is not None:
        ps.out._requeue(spare_plan.requeue_after)
    ps.out.status = _status(ps, prev, replicas, statuses, failed_now, spare_plan)
    if admission is not None:
        _queued(ps, admission)
    return ps.out


def _queued(ps: _Pass, admission: kueue.Admission) -> None:
    """A job queued through Kueue: its pods go where the admission places them, status gains
    the Admitted condition, and a job still waiting is looked at again soon."""
    for manifest in ps.out.create:
        kueue.place(manifest, admission)
    prev = {c.type: c for c in (ps.job.status.conditions if ps.job.status else [])}
    cond, event = job_status.admitted(admission.admitted, admission.reason, admission.message, prev,
                                      ps.job.metadata.get("generation"), ps.now)
    ps.out.status.conditions.append(cond)
    if event is not None:
        ps.out.events.append(event)
    if not admission.admitted and not ps.final:
        ps.out._requeue(QUEUED_POLL_S)


# --- detect ---------------------------------------------------------------------------------
def _detect(ps: _Pass, replicas: list[_Replica], verdicts: Mapping[tuple[int, int], Any],
            departed: Iterable[ObservedPod]) -> None:
    """Each replica's failure, if its current incarnation has one (failures.detect), and the
    failure of the recorded incarnation of a replica whose replacement was not recorded."""
    gone: dict[tuple[int, int], dict[int, ObservedPod]] = {}
    for p in departed:
        if p.replica is not None and p.generation is not None and p.node_rank is not None:
            gone.setdefault((p.replica, p.generation), {})[p.node_rank] = p

    def detect(replica: int, generation: int, pods: Mapping[int, ObservedPod], recorded_running: bool,
               recorded: api.ReplicaStatus | None):
        nodes = recorded.nodes if recorded is not None and recorded.generation == generation else ()
        return failures.detect(
            failures.Incarnation(replica, generation, pods, recorded_running, verdicts.get((replica, generation)),
                                 gone.get((replica, generation), {}), nodes),
            nodes_per_replica=ps.spec.nodes_per_replica, nodes=ps.node_map, history=ps.history,
            grace_seconds=ps.ft.node_not_ready_grace_seconds, completed=ps.completed, now=ps.now,
        )

    for r in replicas:
        rec = r.recorded
        running = rec is not None and rec.state in (R.RUNNING, R.SUCCEEDED)
        if r.unrecorded and rec is not None:
            previous = {p.node_rank: p for p in r.stale if p.generation == rec.generation and p.node_rank is not None}
            r.lost, _ = detect(r.id, rec.generation, previous, running, rec)
            r.lost_at = ps.now
        r.failure, recheck = detect(r.id, r.generation, r.current,
                                    running and rec is not None and rec.generation == r.generation, rec)
        if recheck is not None:
            ps.out._requeue(recheck)


def _script_error(replicas: list[_Replica]) -> tuple[str, str] | None:
    """(reason, message) if a replica failed with a ScriptError: the job fails now, since
    its replacement, and every other replica, would run into the same error."""
    for r in replicas:
        if r.failure is not None and r.failure.reason == reasons.SCRIPT_ERROR:
            return reasons.SCRIPT_ERROR, f"replica {r.id}: {r.failure.message}"
    return None


def _oom_in_place(ps: _Pass, replicas: list[_Replica], records: Mapping[int, api.OomKills]) -> None:
    """Show an OOM kill its launcher restarted in place (the pods run on) as the lastFailure."""
    for r in replicas:
        if r.failure is None and (shown := oom.in_place(records.get(r.id), r.generation, r.last_failure)):
            r.in_place = shown
            ps.out.events.append((reasons.WARNING, reasons.OOM_KILLED,
                                  f"Replica {r.id} generation {r.generation}: {shown.message}"))


def _out_of_memory(ps: _Pass, replicas: list[_Replica]) -> tuple[str, str] | None:
    """(reason, message) if a replica's OOM kills end the job (oom.ends_job)."""
    for r in replicas:
        if r.failure is not None and r.failure.reason == reasons.OOM_KILLED:
            message = oom.ends_job(r.id, r.generation, r.current.values(), ps.history)
            if message is not None:
                return reasons.OOM_KILLED, message
    return None


def _over_budget(ps: _Pass, replicas: list[_Replica]) -> tuple[str, str] | None:
    """Record this pass's failures in the history; (reason, message) if that is more
    replacements within the window than maxReplicaRestarts allows."""
    now_s = int(ps.now.timestamp())
    for r in replicas:
        # A voluntary eviction (a drain) is a replacement, but not one the budget is for.
        if r.failure and not r.failure.voluntary and all((h.replica, h.generation) != (r.id, r.generation)
                                                         for h in ps.history):
            ps.history.append(api.RestartRecord(replica=r.id, generation=r.generation, time=now_s, node=r.failure.node,
                                                reason=r.failure.reason))
        for generation in range(r.generation - r.unrecorded, r.generation):  # replacements not recorded
            if r.lost is not None and r.lost.voluntary and generation == r.generation - r.unrecorded:
                continue
            if all((h.replica, h.generation) != (r.id, generation) for h in ps.history):
                node, why = (r.lost.node, r.lost.reason) if r.lost is not None else (None, None)
                ps.history.append(api.RestartRecord(replica=r.id, generation=generation, time=now_s, node=node,
                                                    reason=why))
    if len(ps.history) <= ps.ft.max_replica_restarts:
        return None
    failing = ", ".join(str(r.id) for r in replicas if r.failure)
    return (reasons.TOO_MANY_RESTARTS,
            f"{len(ps.history)} replica replacements within {ps.ft.restart_window_seconds}s, more than "
            f"maxReplicaRestarts {ps.ft.max_replica_restarts} (last failed: replica {failing})")


# --- act, per replica -----------------------------------------------------------------------
def _nodes(current: Mapping[int, ObservedPod]) -> list[str]:
    return [name for k in sorted(current) if (name := current[k].node_name)]


def _suspend(ps: _Pass, r: _Replica) -> api.ReplicaStatus:
    """spec.suspend: delete the replica's pods; it comes back as a new incarnation."""
    ps.out.delete.extend(p.name for p in [*r.current.values(), *r.stale] if not p.deleting)
    generation = r.generation + 1 if r.current else r.generation  # one the coordinator has not seen
    return api.ReplicaStatus(id=r.id, generation=generation, state=R.PENDING, restarts=r.restarts,
                             last_failure=r.last_failure)


def _frozen(ps: _Pass, r: _Replica) -> api.ReplicaStatus:
    """A job that is final, fails now, or completed with this replica failed: record, replace nothing."""
    state, last_failure = _pods_state(r, ps.spec.nodes_per_replica), r.last_failure
    if r.failure or (ps.final and r.recorded and r.recorded.state == R.FAILED):
        state = R.FAILED
        if r.failure:
            last_failure = api.Failure(reason=r.failure.reason, message=r.failure.message, time=ps.now)
    return _replica_status(r, r.generation, state, r.restarts, last_failure, _nodes(r.current))


def _replace(ps: _Pass, r: _Replica, spare_list: list) -> api.ReplicaStatus:
    """A training job's replica: start its next generation if it failed (from a Ready spare
    when there is one), and create the pods it is missing once its backoff has passed."""
    stale, current = list(r.stale), dict(r.current)
    generation, restarts, last_failure = r.generation, r.restarts, r.last_failure
    ps.new_restarts += r.unrecorded  # replacements made by a pass cut short, counted now
    if r.lost is not None:  # the replacement happened; its record is written now
        ps.out.events.append((reasons.WARNING, reasons.EVENT_REPLICA_FAILED,
                              f"Replica {r.id} generation {generation - 1} failed: {r.lost.message}"))
        _exclude_nodes(ps, r.lost)
    if r.failure:
        stale.extend(current.values())
        current, generation, restarts = {}, generation + 1, restarts + 1
        ps.new_restarts += 1
        last_failure = api.Failure(reason=r.failure.reason, message=r.failure.message, time=ps.now)
        ps.out.events.append((reasons.WARNING, reasons.EVENT_REPLICA_FAILED,
                              f"Replica {r.id} generation {r.generation} failed: {r.failure.message}"))
        _exclude_nodes(ps, r.failure)
        spare = spares.take_ready(spare_list, ps.spec.nodes_per_replica, ps.node_map, ps.excluded)
        if spare is not None:
            current, patches = spares.promote(spare, r.id, generation)
            ps.out.relabel.extend(patches)
            ps.out.events.append((reasons.NORMAL, reasons.EVENT_SPARE_PROMOTED,
                                  f"Spare {spare.id} took over replica {r.id} as generation {generation}"))
    ps.out.delete.extend(p.name for p in stale if not p.deleting)
    _create_missing(ps, r.id, generation, current, stale, last_failure)

    state = _pods_state(_Replica(r.id, generation, current, [], r.recorded), ps.spec.nodes_per_replica)
    # A promoted spare's pods too: until a later pass sees them relabelled, recording the
    # replica Running would make their absence (a crash before the relabel) a new failure.
    if r.failure or (state == R.PENDING and last_failure is not None):
        state = R.REPLACING
    if ps.completed and state == R.REPLACING:  # too late: it is not replaced any more
        state = R.FAILED
    held = _image_pull(ps, r, generation, current) if state in (R.PENDING, R.REPLACING) else None
    return _replica_status(r, generation, state, restarts, last_failure, _nodes(current), held)


def _image_pull(ps: _Pass, r: _Replica, generation: int, current: Mapping[int, ObservedPod]) -> tuple[str, str] | None:
    """(reason, message) while a pod of the replica waits for an image the kubelet cannot pull,
    and a Warning Event the first time its generation is seen so (the status remembers). The pod
    is left alone: the kubelet retries with its own backoff, and a new pod would only pull again."""
    pod = next((p for _, p in sorted(current.items()) if p.image_pull is not None and not p.deleting), None)
    if pod is None or pod.image_pull is None:
        return None
    pull = pod.image_pull
    # Short in status (one per replica: a large job whose image is wrong has them all); the
    # kubelet's own message goes into the Event, once.
    message = f"pod {pod.name}: container {pull.container} cannot pull image {pull.image!r}: {pull.reason}"
    message = message[:MAX_HELD_MESSAGE]
    rec = r.recorded
    if rec is None or rec.generation != generation or rec.reason != reasons.IMAGE_PULL_FAILED:
        said = f" ({pull.message})" if pull.message else ""
        ps.out.events.append((reasons.WARNING, reasons.IMAGE_PULL_FAILED,
                              f"Replica {r.id} generation {generation} cannot start: {message}{said}. The kubelet "
                              "keeps retrying; if the image is wrong, fix spec.template and delete the pod"))
    return reasons.IMAGE_PULL_FAILED, message


def _exclude_nodes(ps: _Pass, failure: failures.ReplicaFailure) -> None:
    if ps.ft.node_exclusion_policy == "None":
        return
    for node, why in failure.exclude:
        if node not in ps.excluded and len(ps.excluded) < MAX_EXCLUDED_NODES:
            ps.excluded[node] = api.ExcludedNode(name=node, reason=why, time=ps.now)
            ps.out.excluded_nodes_added.append((node, why))
            ps.out.events.append((reasons.WARNING, reasons.EVENT_NODE_EXCLUDED,
                                  f"Excluded node {node} from job {ps.job.metadata['name']}: {why}"))


def _create_missing(ps: _Pass, replica: int, generation: int, current: Mapping[int, ObservedPod],
                    stale: list[ObservedPod], last_failure: api.Failure | None) -> None:
    """Pods for the node ranks `current` lacks, once the replica's backoff has run out."""
    missing = [rank for rank in range(ps.spec.nodes_per_replica) if rank not in current]
    if not missing:
        return
    wait = 0.0
    counted = [h for h in ps.history if h.replica == replica]
    # Only a failure the history counts delays its replacement: not a voluntary eviction's.
    if last_failure is not None and last_failure.time is not None and any(h.generation == generation - 1
                                                                          for h in counted):
        delay = failures.backoff_seconds(len(counted), ps.ft.backoff_seconds, ps.ft.max_backoff_seconds)
        wait = (last_failure.time - ps.now).total_seconds() + delay
    if wait > 0:
        ps.out._requeue(wait)
        return
    # Where the last incarnation failed, even for a reason not blamed on the node.
    failed_on = {h.node for h in ps.history if h.replica == replica and h.generation == generation - 1 and h.node}
    failed_on |= {p.node_name for p in stale if p.node_name}
    for rank in missing:
        ps.out.create.append(resources.worker_pod(ps.job, replica, rank, generation, excluded_nodes=ps.excluded,
                                                  avoid_nodes=failed_on))
    if len(missing) == ps.spec.nodes_per_replica and last_failure is not None and generation > 0:
        ps.out.events.append((reasons.NORMAL, reasons.EVENT_REPLICA_REPLACED,
                              f"Creating replica {replica} generation {generation}"))


def _settle(ps: _Pass, replicas: list[_Replica], failed_now: tuple[str, str] | None, was_failed: bool) -> None:
    """A job that is final or fails now creates nothing (a failed one deletes its workers);
    a complete one starts nothing new and deletes pods that have not started."""
    out = ps.out
    if failed_now or ps.final:
        out.create.clear()
        out.delete.clear()
        if failed_now or was_failed:  # a failed job stops: its pods would hold GPUs for nothing
            out.delete.extend(p.name for r in replicas for p in [*r.current.values(), *r.stale]
                              if not p.deleting and p.phase != PodPhase.SUCCEEDED and not _shows_script_error(p))
    elif ps.completed:
        out.create.clear()
        out.delete.extend(p.name for r in replicas for p in r.current.values()
                          if not p.deleting and p.phase == PodPhase.PENDING and p.name not in out.delete)


def _shows_script_error(pod: ObservedPod) -> bool:
    """A pod that ended with a ScriptError is kept: it holds nothing any more, and its log
    has the traceback that the user needs to fix the script."""
    return pod.phase == PodPhase.FAILED and pod.exit_code == contract.EXIT_SCRIPT_ERROR


# --- status ---------------------------------------------------------------------------------
def _status(ps: _Pass, prev: api.TrainingJobStatus, replicas: list[_Replica], statuses: list[api.ReplicaStatus],
            failed_now: tuple[str, str] | None, spare_plan: Any) -> api.TrainingJobStatus:
    spec = ps.spec
    healthy = sum(1 for s in statuses if s.state in (R.RUNNING, R.SUCCEEDED))
    # Complete, and no worker still runs: the others got "job completed" and exited 0.
    all_done = ps.completed and not any(p.phase == PodPhase.RUNNING and not p.deleting
                                        for r in replicas for p in r.current.values())
    view = job_status.JobView(
        replicas=spec.replicas, min_replicas=spec.min_replicas, healthy=healthy,
        replacing=[s.id for s in statuses if s.state == R.REPLACING], suspended=ps.suspended,
        queued=ps.suspended and not ps.spec.suspend,
        queue=ps.admission.queue if ps.admission is not None else "",
        failed=prev.state == J.FAILED or failed_now is not None, succeeded=prev.state == J.SUCCEEDED or all_done,
        ran_before=prev.state in (J.RUNNING, J.RECOVERING, J.DEGRADED) or any(s.restarts for s in statuses),
    )
    state = job_status.job_state(view)
    prev_conditions = {c.type: c for c in prev.conditions}
    old_failed = prev_conditions.get("Failed")
    failed_reason: str = reasons.TOO_MANY_RESTARTS
    failed_message = ""
    if failed_now:
        failed_reason, failed_message = failed_now
    elif prev.state == J.FAILED and old_failed is not None:  # final: as written when it failed
        failed_reason, failed_message = old_failed.reason or failed_reason, old_failed.message or ""
    gen = ps.job.metadata.get("generation")
    event = job_status.transition_event(state, prev.state, view, failed_message)
    if event is not None:
        ps.out.events.append(event)
    shares = prev.training.batch_share_percent if prev.training is not None else None
    rebalanced, shares_event = job_status.rebalanced(shares, prev_conditions, gen, ps.now)
    trouble, trouble_event = job_status.checkpoint_trouble(
        prev.training.checkpoint_trouble if prev.training is not None else None, prev_conditions, gen, ps.now)
    ps.out.events += [e for e in (shares_event, trouble_event) if e is not None]
    return api.TrainingJobStatus(
        observed_generation=gen,
        state=state,
        healthy=f"{healthy}/{spec.replicas}",
        conditions=[*job_status.conditions(state, view, failed_message, prev_conditions, gen, ps.now, failed_reason),
                    rebalanced, trouble,
                    job_status.diverged(prev.training.diverged if prev.training is not None else None,
                                        prev_conditions, gen, ps.now)],
        healthy_replicas=healthy,
        total_restarts=(prev.total_restarts or 0) + (0 if failed_now else ps.new_restarts),
        replicas=statuses,
        ready_spare_replicas=(sum(1 for s in spare_plan.statuses if s.state == S.READY)
                              if spec.spare_replicas or prev.spares else None),
        spares=spare_plan.statuses,
        restart_history=sorted(ps.history, key=lambda h: (h.time, h.replica, h.generation)),
        excluded_nodes=list(ps.excluded.values()),
        training=prev.training,
    )
