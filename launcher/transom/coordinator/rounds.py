"""How a round is decided, as pure functions of what its members asked: who holds the
newest state and who catches up from it, who diverged, how long a failed round waits for an
absent member. membership.py keeps the records, applies these and says what happened."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from transom.coordinator.models import MAX_SHARED_BYTES, Identity, QuorumRequest
from transom.coordinator.records import Decision, Replica
from transom.coordinator.settings import Settings
from transom.defaults import FAILED_GRACE_ROUNDS
from transom.words import IncarnationState

MAX_SHARED_KEYS = 256  # script values one round hands on, at most (bytes: MAX_SHARED_BYTES)


@dataclass
class OpenRound:
    """The round not decided yet: who asked and since when, since when one of them reports a
    failed step, who came back from trainer.aside(), and the script values they set aside
    there, which the decision hands to every member (later ones win; bounded like one
    request)."""

    requests: dict[int, QuorumRequest] = field(default_factory=dict)
    since: dict[int, float] = field(default_factory=dict)  # when each first asked
    failed_since: float | None = None
    shared: dict = field(default_factory=dict)
    # Back from an aside, where a replica left its group (ft/exchange.py end_lease): the
    # decision names a new quorum, since a group's prefix is never built twice.
    returned: set[int] = field(default_factory=set)

    def enter(self, req: QuorumRequest, now: float) -> bool:
        """Add `req` to the round; False when its script values had to be dropped."""
        rid = req.identity.replica_id
        self.requests[rid] = req
        self.since.setdefault(rid, now)
        if req.failed and self.failed_since is None:
            self.failed_since = now
        if req.shared:
            merged = merged_shared(self.shared, req.shared)
            if merged is None:
                return False
            self.shared = merged
        return True

    def drop(self, replica_id: int) -> None:
        self.requests.pop(replica_id, None)
        self.since.pop(replica_id, None)
        self.returned.discard(replica_id)

    def keep(self, wanted: Callable[[QuorumRequest], bool]) -> dict[int, QuorumRequest]:
        """Drop the requests that are not `wanted`; the rest, by replica id."""
        for rid, req in list(self.requests.items()):
            if not wanted(req):
                self.drop(rid)
        return dict(self.requests)

    def opened(self, replica_ids: Iterable[int], now: float) -> float:
        """When the first of `replica_ids` asked (`now` for none)."""
        return min((self.since.get(r, now) for r in replica_ids), default=now)

    def close(self, answered: Iterable[int], now: float) -> None:
        """The round was decided for `answered`; stragglers start the next one, with their
        failure reports."""
        for rid in answered:
            self.drop(rid)
        self.shared = {}
        self.failed_since = now if any(req.failed for req in self.requests.values()) else None


@dataclass(frozen=True)
class RoundPlan:
    """What the ready requests of a round say, before it is given a quorum id."""

    ids: list[int]  # the members' replica ids, sorted
    members: tuple[Identity, ...]
    failed: bool  # some member's last step failed: the groups are rebuilt
    max_step: int
    canonical: list[int]  # the members holding the newest state (the newest lineage at max_step)
    recovering: tuple[int, ...]  # the others: they catch up and contribute zeros
    snapshot_from: int | None  # the step the sources keep a snapshot of (None: nobody catches up)


def plan(ready: Mapping[int, QuorumRequest]) -> RoundPlan:
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
    needs = [max_step if (since := ready[i].catching_up_from) is None else since for i in recovering]
    return RoundPlan(ids=ids, members=tuple(ready[i].identity for i in ids), failed=any(ready[i].failed for i in ids),
                max_step=max_step, canonical=canonical, recovering=recovering,
                snapshot_from=max(needs) if needs else None)


def holder_in(current: Decision, ready: Mapping[int, QuorumRequest]) -> bool:
    """Whether a ready replica holds the current round's state (a member not catching up)."""
    return any(m.replica_id in ready and ready[m.replica_id].identity.key() == m.key()
               for m in current.members if m.replica_id not in current.recovering)


def diverged(ready: Mapping[int, QuorumRequest]) -> dict[int, str]:
    """The ready replicas catching up that committed a step later than any ready replica
    holding the state did, and why: their last exchange completed on them only (a peer died
    in it), so the update they recorded belongs to a lineage nobody holds. They restart as
    fresh joiners; otherwise no member could be a source and every one would be told to."""
    newest = max((r.step for r in ready.values() if r.catching_up_from is None), default=None)
    if newest is None:
        return {}
    return {rid: (f"committed step {r.step} while catching up, and no replica holding the state did (at step "
                  f"{newest}); it catches up again")
            for rid, r in ready.items() if r.catching_up_from is not None and r.step > newest}


def absent(current: Decision, replicas: Mapping[int, Replica], ready: Mapping[int, QuorumRequest]) -> list[int]:
    """The members of the current round whose incarnation is still healthy but did not ask."""
    return [m.replica_id for m in current.members
            if m.replica_id not in ready
            and (rep := replicas.get(m.replica_id)) is not None
            and rep.state == IncarnationState.HEALTHY
            and rep.identity.key() == m.key()]


def overdue(settings: Settings, open_round: OpenRound, current: Decision, ready: Mapping[int, QuorumRequest],
            grace_s: float, now: float) -> str | None:
    """Why the round's absent members are waited for no longer (they are hung), or None while
    it still waits: `grace_s` after a failed step, `round_timeout_s` after the first member
    asked (not a replacement: it may ask in the middle of the members' step, which proves
    nothing)."""
    member_ids = {m.replica_id for m in current.members}
    opened = open_round.opened([r for r in ready if r in member_ids], now)
    if open_round.failed_since is not None and now - open_round.failed_since >= grace_s:
        return f"did not return within {grace_s:.3g}s of a failed step"
    if now - opened >= settings.round_timeout_s:
        return f"did not ask for its next quorum within {settings.round_timeout_s:g}s"
    return None


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
