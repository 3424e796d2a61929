"""How a round is decided, as pure functions of what its members asked: who holds the
newest state and who catches up from it, who diverged, how long a failed round waits for an
absent member. membership.py keeps the records, applies these and says what happened."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from transom.coordinator.models import MAX_SHARED_BYTES, Identity, QuorumRequest
from transom.coordinator.records import Decision, Replica
from transom.coordinator.settings import Settings
from transom.defaults import FAILED_GRACE_ROUNDS

MAX_SHARED_KEYS = 256  # script values one round hands on, at most (bytes: MAX_SHARED_BYTES)


@dataclass(frozen=True)
class Plan:
    """What the ready requests of a round say, before it is given a quorum id."""

    ids: list[int]  # the members' replica ids, sorted
    members: tuple[Identity, ...]
    failed: bool  # some member's last step failed: the groups are rebuilt
    max_step: int
    canonical: list[int]  # the members holding the newest state (the newest lineage at max_step)
    recovering: tuple[int, ...]  # the others: they catch up and contribute zeros
    snapshot_from: int | None  # the step the sources keep a snapshot of (None: nobody catches up)


def plan(ready: Mapping[int, QuorumRequest]) -> Plan:
    ids = sorted(ready)
    max_step = max(ready[i].step for i in ids)
    at_max = [i for i in ids if ready[i].step == max_step]
    # Replicas at the same step that committed it under different quorums can differ (a
    # collective that completed on some members only): the newest lineage wins. A member
    # still catching up counts its steps but does not hold their state yet.
    holding = [i for i in at_max if ready[i].catching_up_from is None]
    newest = max((ready[i].commit_quorum_id for i in holding), default=-1)
    canonical = [i for i in holding if ready[i].commit_quorum_id == newest]
    recovering = tuple(i for i in ids if i not in canonical)
    # What the joiners need: one that joins now records updates from this step on, one
    # catching up says from which step.
    needs = [ready[i].catching_up_from if ready[i].catching_up_from is not None else max_step for i in recovering]
    return Plan(ids=ids, members=tuple(ready[i].identity for i in ids), failed=any(ready[i].failed for i in ids),
                max_step=max_step, canonical=canonical, recovering=recovering,
                snapshot_from=max(needs) if needs else None)


def holder_in(current: Decision, ready: Mapping[int, QuorumRequest]) -> bool:
    """Whether a ready replica holds the current round's state (a member not catching up)."""
    return any(m.replica_id in ready and ready[m.replica_id].identity.key() == m.key()
               for m in current.members if m.replica_id not in current.recovering)


def diverged(ready: Mapping[int, QuorumRequest]) -> tuple[int | None, list[int]]:
    """The newest step a ready replica holding the state committed, and the ready replicas
    catching up that committed a later one: their last exchange completed on them only (a
    peer died in it), so the update they recorded belongs to a lineage nobody holds."""
    newest = max((r.step for r in ready.values() if r.catching_up_from is None), default=None)
    if newest is None:
        return None, []
    return newest, [rid for rid, r in ready.items() if r.catching_up_from is not None and r.step > newest]


def failed_grace_s(settings: Settings, current: Decision, replicas: Mapping[int, Replica],
                   round_seconds: Iterable[float], ready: Mapping[int, QuorumRequest], missing: list[int]) -> float:
    """How long a round with a failed step waits for the absent `missing` members.

    `failed_grace_s`, or FAILED_GRACE_ROUNDS of the job's recent rounds if that is longer
    (a live member asks again only after it meets the failed exchange, at the end of the
    step it is computing). As long as `round_timeout_s` when the absent include a member
    holding the newest state and no ready member holds it: the ready ones could not train
    without it, and cutting it loses the job's progress.
    """
    # Incarnations, not replica ids: a holder's restarted incarnation holds nothing yet.
    holders = {(m.replica_id, m.key()) for m in current.members if m.replica_id not in current.recovering}
    absent = {(r, replicas[r].identity.key()) for r in missing}
    if holders & absent and not holders & {(rid, req.identity.key()) for rid, req in ready.items()}:
        return settings.round_timeout_s
    grace = settings.failed_grace_s
    recent = list(round_seconds)
    if recent:
        grace = max(grace, FAILED_GRACE_ROUNDS * statistics.median(recent))
    return min(grace, settings.round_timeout_s)


def merged_shared(pending: dict, new: dict) -> dict | None:
    """The script values set aside since the last decision with `new` added (later ones win),
    or None when that is more than one request may carry."""
    merged = {**pending, **new}
    if len(merged) <= MAX_SHARED_KEYS and len(json.dumps(merged, separators=(",", ":"))) <= MAX_SHARED_BYTES:
        return merged
    return None
