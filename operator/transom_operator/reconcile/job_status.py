"""The job-level part of a TrainingJob's status: its state, its conditions and the
Events of a state transition, from the replicas' states that `replicas.plan` worked out
(and, for Rebalanced, from the batch shares the coordinator wrote in status.training).

Pure: `job_state` and `conditions` read only their arguments. A condition keeps its
lastTransitionTime while its status stays the same, so writing the same status twice
changes nothing.

States: Suspended (or Queued, while Kueue has not admitted the job), Failed and Succeeded
win in that order; below minReplicas healthy
replicas a job that ran before is Degraded (training pauses), one that never ran Pending;
a replica being replaced makes it Recovering; otherwise Running.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from transom_operator import api, reasons

J = api.JobState


@dataclass(frozen=True)
class JobView:
    """What the job-level status depends on, as one pass saw it."""

    replicas: int  # spec.replicas
    min_replicas: int
    healthy: int
    replacing: list[int]
    suspended: bool  # no worker may run: spec.suspend, or not admitted by Kueue
    failed: bool  # failed now or before
    succeeded: bool  # succeeded before, or complete with no worker running
    ran_before: bool
    queued: bool = False  # suspended because Kueue has not admitted the job (not spec.suspend)
    queue: str = ""


def job_state(v: JobView) -> api.JobState:
    if v.suspended:
        return J.QUEUED if v.queued else J.SUSPENDED
    if v.failed:
        return J.FAILED
    if v.succeeded:
        return J.SUCCEEDED
    if v.healthy < v.min_replicas:
        return J.DEGRADED if v.ran_before else J.PENDING
    return J.RECOVERING if v.replacing else J.RUNNING


def _condition(type_: str, true: bool, reason: str, message: str, prev: Mapping[str, api.Condition],
               generation: int | None, now: datetime) -> api.Condition:
    status = "True" if true else "False"
    old = prev.get(type_)
    since = old.last_transition_time if old is not None and old.status == status and old.last_transition_time else now
    return api.Condition(type=type_, status=status, reason=reason, message=message,
                         last_transition_time=since, observed_generation=generation)


def conditions(state: str, v: JobView, failed_message: str, prev: Mapping[str, api.Condition],
               generation: int | None, now: datetime,
               failed_reason: str = reasons.TOO_MANY_RESTARTS) -> list[api.Condition]:
    """Ready, Degraded, Recovering, Succeeded and Failed for `state`; `failed_reason`: why a
    Failed job failed (TooManyRestarts, or ScriptError)."""
    healthy, total = v.healthy, v.replicas
    ready_reason: str
    if state == J.RUNNING and healthy == total:
        ready_reason, ready_message = reasons.ALL_REPLICAS_HEALTHY, f"all {healthy} replicas running"
    else:
        by_state: dict[str, str] = {
            J.SUSPENDED: reasons.SUSPENDED, J.QUEUED: reasons.QUEUED, J.FAILED: failed_reason,
            J.SUCCEEDED: reasons.TRAINING_COMPLETE, J.DEGRADED: reasons.BELOW_MIN_REPLICAS,
            J.RECOVERING: reasons.REPLACING_REPLICAS,
        }
        ready_reason = by_state.get(state, reasons.REPLICAS_STARTING)
        ready_message = f"{healthy} of {total} replicas running"
    degraded = state == J.DEGRADED
    recovering = bool(v.replacing) and state in (J.RECOVERING, J.DEGRADED)
    replacing_message = "replacing replica " + ", ".join(map(str, v.replacing))
    return [
        _condition("Ready", ready_reason == reasons.ALL_REPLICAS_HEALTHY, ready_reason, ready_message,
                   prev, generation, now),
        _condition("Degraded", degraded,
                   reasons.BELOW_MIN_REPLICAS if degraded else reasons.ENOUGH_REPLICAS,
                   f"{healthy} of {total} replicas healthy, minReplicas is {v.min_replicas}"
                   + ("; training pauses" if degraded else ""), prev, generation, now),
        _condition("Recovering", recovering,
                   reasons.REPLACING_REPLICAS if recovering else reasons.NO_REPLACEMENT,
                   replacing_message if recovering else "no replica is being replaced", prev, generation, now),
        _condition("Succeeded", state == J.SUCCEEDED,
                   reasons.TRAINING_COMPLETE if state == J.SUCCEEDED else reasons.NOT_COMPLETE,
                   "training finished" if state == J.SUCCEEDED else "training has not finished",
                   prev, generation, now),
        _condition("Failed", state == J.FAILED,
                   failed_reason if state == J.FAILED else reasons.NOT_FAILED,
                   failed_message or "the job has not failed", prev, generation, now),
    ]


def rebalanced(shares: list[int] | None, prev: Mapping[str, api.Condition], generation: int | None,
               now: datetime) -> tuple[api.Condition, tuple[str, str, str] | None]:
    """The Rebalanced condition (a slow replica has a smaller share of each global batch:
    status.training.batchSharePercent) and the Event of a change of the shares, if any."""
    on = bool(shares)
    message = ("shares of the global batch: " + ", ".join(f"replica {r} {p}%" for r, p in enumerate(shares or []))
               if on else "every replica has its nominal share of the global batch")
    cond = _condition("Rebalanced", on, reasons.SLOW_REPLICA_REBALANCED if on else reasons.NOMINAL_SHARES,
                      message, prev, generation, now)
    old = prev.get("Rebalanced")
    changed = old.message != message if old is not None else on
    return cond, (reasons.NORMAL, reasons.EVENT_REBALANCED, message) if changed else None


def diverged(message: str | None, prev: Mapping[str, api.Condition], generation: int | None,
             now: datetime) -> api.Condition:
    """The Diverged condition: the coordinator found the replicas' states different with no
    majority (status.training.diverged) and stopped the job; it stays once set."""
    on = bool(message)
    return _condition("Diverged", on, reasons.REPLICAS_DIVERGED if on else reasons.REPLICAS_AGREE,
                      message or "no replicas were found to differ", prev, generation, now)


def checkpoint_trouble(trouble: str | None, prev: Mapping[str, api.Condition], generation: int | None,
                       now: datetime) -> tuple[api.Condition, tuple[str, str, str] | None]:
    """The CheckpointTrouble condition (True while status.training.checkpointTrouble says what
    the replicas' checkpoint writers fail at) and the Event of its start or end, if any."""
    on = bool(trouble)
    message = trouble if on else "checkpoints are written"
    cond = _condition("CheckpointTrouble", on, reasons.STORAGE_FAILING if on else reasons.CHECKPOINTS_OK,
                      message or "", prev, generation, now)
    old = prev.get("CheckpointTrouble")
    was_on = old is not None and old.status == "True"
    if on == was_on:
        return cond, None
    event = (reasons.WARNING, reasons.EVENT_CHECKPOINT_TROUBLE, f"checkpoints fail: {trouble}") if on else \
        (reasons.NORMAL, reasons.EVENT_CHECKPOINTS_WRITTEN, "checkpoints are written again")
    return cond, event


def admitted(admitted_now: bool, reason: str, message: str, prev: Mapping[str, api.Condition],
             generation: int | None, now: datetime) -> tuple[api.Condition, tuple[str, str, str] | None]:
    """The Admitted condition of a job queued through Kueue (reconcile/admission.py), and the
    Event of its admission, if it was admitted now."""
    cond = _condition("Admitted", admitted_now, reason, message, prev, generation, now)
    old = prev.get("Admitted")
    newly = admitted_now and (old is None or old.status != "True")
    return cond, (reasons.NORMAL, reasons.EVENT_JOB_ADMITTED, message) if newly else None


def transition_event(state: str, previous: str | None, v: JobView,
                     failed_message: str) -> tuple[str, str, str] | None:
    """The Event (type, reason, message) of entering `state`, if it has one."""
    if state == previous:
        return None
    events: dict[str, tuple[str, str, str]] = {
        J.DEGRADED: (reasons.WARNING, reasons.EVENT_JOB_DEGRADED,
                     f"{v.healthy} of {v.replicas} replicas healthy, fewer than minReplicas {v.min_replicas}"),
        J.FAILED: (reasons.WARNING, reasons.EVENT_JOB_FAILED, failed_message),
        J.SUCCEEDED: (reasons.NORMAL, reasons.EVENT_JOB_SUCCEEDED, "training finished"),
        J.SUSPENDED: (reasons.NORMAL, reasons.EVENT_JOB_SUSPENDED, "deleting the job's worker pods"),
        J.QUEUED: (reasons.NORMAL, reasons.EVENT_JOB_QUEUED,
                   f"waiting for Kueue to admit the job from queue {v.queue}"),
    }
    return events.get(state)


def refused(current: Mapping[str, Any] | None, message: str, generation: int | None,
            now: datetime) -> dict[str, Any]:
    """The operator's part of status for a job whose spec it cannot use (`message` says why):
    Ready False with reason InvalidSpec, for that generation of the spec. The rest of the
    status is left as it was: the operator acts on nothing until the spec is changed. Works
    on the raw status, which need not parse (it may be what is wrong)."""
    current = current if isinstance(current, Mapping) else {}
    conditions = [c for c in current.get("conditions") or [] if isinstance(c, dict)]
    old = next((c for c in conditions if c.get("type") == "Ready"), None)
    since = old.get("lastTransitionTime") if old is not None and old.get("status") == "False" else None
    ready = api.Condition(type="Ready", status="False", reason=reasons.INVALID_SPEC, message=message[:1024],
                          last_transition_time=now, observed_generation=generation)
    ready_json = ready.model_dump(by_alias=True, exclude_none=True, mode="json")
    if since:
        ready_json["lastTransitionTime"] = since  # False before: the status did not change
    out: dict[str, Any] = {"conditions": [ready_json if c is old else c for c in conditions] if old is not None
                           else [ready_json, *conditions]}
    if generation is not None:
        out["observedGeneration"] = generation
    return out
