"""The calls about one replica's incarnation, as the membership applies them: it registers,
beats, steps aside, fails or leaves, reports a checkpoint, and its heartbeats expire; and
what the coordinator holds it to be (GET /v1/replicas/{id}). Rounds are membership.py's
(and rounds.py's); the bounds on claimed progress are claims.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transom.coordinator import claims
from transom.coordinator.models import (
    AsideRequest,
    CheckpointReport,
    FailureReport,
    HeartbeatRequest,
    Identity,
    IncarnationAnswer,
    LeaveRequest,
    RegisterRequest,
    RegisterResponse,
)
from transom.coordinator.records import Replica
from transom.coordinator.reports import quoted
from transom.errors import Evicted
from transom.words import EventKind, FailureKind, IncarnationState

if TYPE_CHECKING:
    from transom.coordinator.job_state import JobState


def register(m: JobState, req: RegisterRequest, now: float) -> RegisterResponse:
    rid = req.identity.replica_id
    if rid >= m.settings.num_replicas:
        raise ValueError(f"replica_id must be below num_replicas ({m.settings.num_replicas})")
    claims.check_registration(m, rid, req.step)
    old = m.replicas.get(rid)
    if old is not None and old.identity.key() > req.identity.key():
        raise Evicted(f"replica {rid} incarnation {req.identity.key()} is older than {old.identity.key()}")
    if old is not None and old.identity.key() == req.identity.key():
        if old.state != IncarnationState.HEALTHY:
            raise Evicted(f"replica {rid} incarnation {req.identity.key()} was declared {old.state}")
        old.store_addr, old.state_endpoints, old.last_heartbeat = req.store_addr, list(req.state_endpoints), now
        if rid not in m.answers:
            old.registered_step = req.step
    else:
        failures, last_failure = 0, None
        if old is not None:
            if old.state == IncarnationState.HEALTHY:
                m.fail(old, now, "replaced by a newer incarnation", FailureKind.SUPERSEDED)
            failures, last_failure = old.failures, old.last_failure
        m.replicas.put(Replica(
            identity=req.identity,
            store_addr=req.store_addr,
            state_endpoints=list(req.state_endpoints),
            last_heartbeat=now,
            step=req.step,
            registered_step=req.step,
            failures=failures,
            last_failure=last_failure,
        ))
        m.answers.pop(rid, None)
        m.event(now, EventKind.REGISTERED,
                f"replica {rid} generation {req.identity.generation} attempt {req.identity.attempt}", rid)
    release_checkpoints(m, now)  # a second replica's registration may support one held
    s = m.settings
    return RegisterResponse(
        heartbeat_interval_s=s.heartbeat_interval_s,
        heartbeat_timeout_s=s.heartbeat_timeout_s,
        num_replicas=s.num_replicas,
        min_replicas=s.min_replicas,
    )


def heartbeat(m: JobState, req: HeartbeatRequest, now: float) -> bool:
    """Take a live incarnation's beat; True when its checkpoint trouble began or ended."""
    rep = m.replicas.live(req.identity)
    claims.check(m, req.identity.replica_id, req.step, "heartbeat")
    rep.last_heartbeat = now
    rep.step = max(rep.step, req.step)
    return _note_checkpoint_trouble(m, rep, req.checkpoint_trouble, now)


def _note_checkpoint_trouble(m: JobState, rep: Replica, trouble: str | None, now: float) -> bool:
    """Keep what the replica says its checkpoint writer fails at; an event when that starts
    and when it ends (not for each new failure in between: a retry every few seconds).
    True when it started or ended."""
    rid = rep.identity.replica_id
    changed = (trouble is None) != (rep.checkpoint_trouble is None)
    if trouble is not None and rep.checkpoint_trouble is None:
        m.event(now, EventKind.CHECKPOINT_TROUBLE,
                f"replica {rid} cannot write its checkpoint: {quoted(trouble)} (retrying)", rid)
    elif trouble is None and rep.checkpoint_trouble is not None:
        m.event(now, EventKind.CHECKPOINT_TROUBLE_OVER, f"replica {rid} writes its checkpoint again", rid)
    rep.checkpoint_trouble = trouble
    return changed


def step_aside(m: JobState, req: AsideRequest, now: float) -> None:
    """The replica works outside the steps for a while: rounds go on without it (not
    counted as hung) until it asks for a quorum again, behind the others."""
    rep = m.replicas.live(req.identity)
    claims.check(m, req.identity.replica_id, req.step, "aside")
    rep.last_heartbeat = now
    if not rep.aside:
        rep.aside = True
        m.event(now, EventKind.ASIDE, f"replica {req.identity.replica_id} stepped aside at step {req.step}",
                req.identity.replica_id)


def report_failure(m: JobState, req: FailureReport, now: float) -> bool:
    """Mark an incarnation failed. Idempotent; reports about old incarnations are ignored."""
    rep = m.replicas.current(req.identity)
    if rep is None:
        return False
    code = f" (exit code {req.exit_code})" if req.exit_code is not None else ""
    m.fail(rep, now, req.reason + code, FailureKind.REPORTED)
    return True


def leave(m: JobState, req: LeaveRequest, now: float) -> None:
    rep = m.replicas.live(req.identity)
    claims.check(m, req.identity.replica_id, req.step, "leave")
    if req.completed:
        claims.check_completion(m, req.identity.replica_id, req.step)
    rep.state = IncarnationState.LEFT
    rep.step = max(rep.step, req.step)
    if req.completed and m.completed_step is None:
        m.completed_step = req.step
        m.goodput.finish(now)
        m.event(now, EventKind.COMPLETED, f"replica {rep.identity.replica_id} completed the job at step {req.step}",
                rep.identity.replica_id)
    m.open.drop(rep.identity.replica_id)
    why = req.reason or ("completed" if req.completed else "no reason given")
    m.event(now, EventKind.LEFT, f"replica {rep.identity.replica_id} left at step {req.step}: {why}",
            rep.identity.replica_id)


def replica_state(m: JobState, identity: Identity) -> IncarnationAnswer:
    rep = m.replicas.get(identity.replica_id)
    # The round that ends the job is decided: its members complete it where they are, and a
    # member that was still catching up (ft/exchange.py) has left with it.
    done = m.completed_step is not None or (m.current is not None and m.current.ends_job)
    if rep is None or rep.identity.key() < identity.key():
        return IncarnationAnswer(replica_id=identity.replica_id, state=IncarnationState.UNKNOWN, job_completed=done)
    if rep.identity.key() > identity.key():
        return IncarnationAnswer(replica_id=identity.replica_id, state=IncarnationState.SUPERSEDED, job_completed=done)
    return IncarnationAnswer(replica_id=identity.replica_id, state=rep.state, reason=rep.last_failure,
                        job_completed=done)


def expire(m: JobState, now: float) -> bool:
    """Declare replicas whose heartbeats stopped failed. Returns whether anything changed."""
    expired = m.replicas.expired(now, m.settings.heartbeat_timeout_s)
    for rep, age in expired:
        m.fail(rep, now, f"no heartbeat for {age:.1f}s", FailureKind.HEARTBEAT)
    return bool(expired)


def record_checkpoint(m: JobState, req: CheckpointReport, wall_time: float, now: float) -> bool:
    """A replica committed the checkpoint of `req.step`; older reports are ignored. One past
    what the job's evidence supports (a replica alone before the first round) is held until
    it is supported (`release_checkpoints`): one replica's word is not the job's checkpoint."""
    m.replicas.live(req.identity)
    claims.check(m, req.identity.replica_id, req.step, "checkpoint report")
    if not claims.supported(m, req.step):
        m.held_checkpoints[req.identity.replica_id] = (req, wall_time)
        return m.last_checkpoint is None or req.step > m.last_checkpoint[0]
    return _newest_checkpoint(m, req, wall_time, now)


def release_checkpoints(m: JobState, now: float) -> None:
    """Count the held checkpoint reports the job's evidence now supports."""
    for rid, (req, wall_time) in list(m.held_checkpoints.items()):
        if claims.supported(m, req.step):
            del m.held_checkpoints[rid]
            _newest_checkpoint(m, req, wall_time, now)


def _newest_checkpoint(m: JobState, req: CheckpointReport, wall_time: float, now: float) -> bool:
    if m.last_checkpoint is not None and req.step <= m.last_checkpoint[0]:
        return False
    m.last_checkpoint = (req.step, wall_time)
    m.last_checkpoint_stall_s = req.stall_seconds
    m.event(now, EventKind.CHECKPOINT, f"checkpoint of step {req.step} committed by replica {req.identity.replica_id}",
            req.identity.replica_id)
    return True
