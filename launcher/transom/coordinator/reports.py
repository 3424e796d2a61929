"""What the coordinator's membership tells others, read from it without changing it: a
member's quorum answer, a starting replica's progress, status.training of the TrainingJob
and GET /v1/status. Membership decides; these only describe (membership.py delegates)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from transom.coordinator.goodput import as_decimal
from transom.coordinator.models import (
    JobProgress,
    JobStatus,
    QuorumResponse,
    RecoverySource,
    ReplicaStatus,
)
from transom.coordinator.records import Decision, Replica
from transom.words import IncarnationState

if TYPE_CHECKING:
    from transom.coordinator.job_state import JobState

STATUS_EVENTS = 50  # the newest events GET /v1/status shows (membership keeps more)
TROUBLE_SHOWN = 4  # replicas checkpointTrouble quotes (each up to 300 characters; the CRD allows 2048)


def response(m: JobState, decision: Decision, replica_id: int) -> QuorumResponse:
    """Member `replica_id`'s answer to the quorum request `decision` decided."""
    ids = decision.member_ids()
    sources = [RecoverySource(replica_id=s, endpoints=list(m.replicas[s].state_endpoints))
               for s in decision.sources] if replica_id in decision.recovering else []
    return QuorumResponse(
        round=decision.round,
        quorum_id=decision.quorum_id,
        members=ids,
        rank=ids.index(replica_id),
        store_addr=decision.store_addr,
        store_prefix=decision.store_prefix,
        max_step=decision.max_step,
        participants=decision.participants,
        recovering=sorted(decision.recovering),
        serve_recovery=replica_id in decision.sources,
        sources=sources,
        snapshot_from=decision.snapshot_from,
        shares=list(decision.shares) if decision.shares is not None else None,
        shares_from=decision.shares_from,
        shared=decision.shared,
        ends_job=decision.ends_job,
        diverged=m.diverged,
        holds_until=decision.holds_until,
    )


def training(m: JobState, now: float) -> dict:
    """status.training of the TrainingJob (camelCase, as the CRD has it), without updateTime.
    `step` only once this coordinator has decided a round: a restarted one knows no replica
    until they register again, and would write 0 over the job's committed step (a merge
    patch without it leaves the last one in place)."""
    out: dict = {"step": m.replicas.max_step()} if m.current is not None else {}
    if m.completed_step is not None:
        out["completedStep"] = m.completed_step
    if m.last_checkpoint is not None:
        step, wall = m.last_checkpoint
        out["lastCheckpoint"] = step
        out["lastCheckpointTime"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))
    out["checkpointTrouble"] = checkpoint_trouble(m)  # None: a merge patch's null removes what was shown
    if m.diverged is not None:
        out["diverged"] = m.diverged
    goodput = m.goodput.value(now)
    if goodput is not None:
        out["goodput"] = as_decimal(goodput)
    if m.shares.published is not None:
        out["batchSharePercent"] = [round(v * 100) for v in m.shares.published]
    elif m.shares.published_from > 0:  # rebalanced before: a merge patch's null removes it
        out["batchSharePercent"] = None
    return out


def in_checkpoint_trouble(m: JobState) -> list[Replica]:
    """The healthy replicas whose heartbeats say their checkpoint writer fails, by id."""
    return [r for r in sorted(m.replicas.values(), key=lambda r: r.identity.replica_id)
            if r.state == IncarnationState.HEALTHY and r.checkpoint_trouble is not None]


def quoted(words: str) -> str:
    """A replica's own words, in double quotes, as they are shown beside its id.

    The words are the replica's script's to choose (its heartbeat's `checkpoint_trouble`):
    replica 1 saying `OK; replica 0: PermissionError` must not read as an entry of replica 0.
    Inside the quotes there is no double quote (made `'`), so the words cannot close them;
    no `;` (made `,`), the separator between replicas' entries; and nothing unprintable.
    Replacing rather than escaping keeps the length: the CRD bounds what status shows."""
    kept = "".join("'" if c == '"' else "," if c == ";" else c if " " <= c <= "~" else "?" for c in words)
    return f'"{kept}"'


def checkpoint_trouble(m: JobState) -> str | None:
    """status.training.checkpointTrouble: what the healthy replicas say their checkpoint
    writers fail at, each in its own words, `quoted` ('replica 0: "writing part 0 of step 40:
    ConnectError"'), the first TROUBLE_SHOWN of them, separated by "; "; None when none does."""
    said = [f"replica {r.identity.replica_id}: {quoted(r.checkpoint_trouble)}"
            for r in in_checkpoint_trouble(m) if r.checkpoint_trouble is not None]
    if len(said) > TROUBLE_SHOWN:
        said = [*said[:TROUBLE_SHOWN], f"and {len(said) - TROUBLE_SHOWN} more replicas"]
    return "; ".join(said) or None


def progress(m: JobState, caller: int | None) -> JobProgress:
    """What replica `caller` (None: the job's token holder) needs when it starts."""
    peers = [r for r in m.replicas.values() if r.state == IncarnationState.HEALTHY and r.identity.replica_id != caller]
    newest = max(peers, key=lambda r: (r.step, -r.identity.replica_id), default=None)
    return JobProgress(peer_step=newest.step if newest else None, completed_step=m.completed_step,
                       last_checkpoint=m.last_checkpoint[0] if m.last_checkpoint else None,
                       peer_endpoint=newest.state_endpoints[0] if newest and newest.state_endpoints else None)


def status(m: JobState, now: float) -> JobStatus:
    """GET /v1/status: the current round and every replica id's current incarnation."""
    cur = m.current
    return JobStatus(
        round=m.next_round - 1,
        quorum_id=cur.quorum_id if cur else -1,
        members=cur.member_ids() if cur else [],
        max_step=m.replicas.max_step(),
        num_replicas=m.settings.num_replicas,
        min_replicas=m.settings.min_replicas,
        healthy_replicas=m.replicas.healthy_count(),
        paused=m.paused,
        completed_step=m.completed_step,
        diverged=m.diverged,
        last_checkpoint=m.last_checkpoint[0] if m.last_checkpoint else None,
        goodput=m.goodput.value(now),
        replicas=[
            ReplicaStatus(
                replica_id=r.identity.replica_id,
                generation=r.identity.generation,
                attempt=r.identity.attempt,
                state=r.state,
                step=r.step,
                last_report=r.last_report,
                heartbeat_age_s=round(now - r.last_heartbeat, 3) if r.state == IncarnationState.HEALTHY else None,
                failures=r.failures,
                last_failure=r.last_failure,
                checkpoint_trouble=r.checkpoint_trouble,
            )
            for r in sorted(m.replicas.values(), key=lambda r: r.identity.replica_id)
        ],
        events=list(m.events)[-STATUS_EVENTS:],
    )
