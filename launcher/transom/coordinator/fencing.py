"""Refusals of incarnations that are no longer current: counted, and told once each.

An incarnation that was superseded (its replacement registered), declared failed (its
heartbeats stopped, a hang, a detector's verdict, its launcher's report) or that left gets
409 on every call (`Membership._live`). Such a call is the trace a *zombie* leaves: an
incarnation cut off or frozen for longer than the heartbeat timeout that comes back after
its replacement joined, and tries to commit a step (`/v1/quorum`), to stay alive
(`/v1/heartbeat`), or to write a checkpoint object or serve its state (`/v1/fence`, which a
replica asks before each such effect: ft/fencing.py).

The server counts every refusal per endpoint (`transom_coordinator_fenced_requests_total
{endpoint}`, metrics.py) and records one event (GET /v1/status) and one log line per
incarnation and endpoint, e.g. "refused replica 1 generation 0 attempt 0 on /v1/quorum:
superseded by generation 1 attempt 0", so that a test or a chaos scenario can show that a
zombie tried and was refused. Pure: no I/O, no clock.

An incarnation declared failed on its own side's word (its worker or its launcher reported
the failure) is no zombie: it knows it is out, and what it still sends (its launcher's last
signal rows, posted after its workers ended; a heartbeat in flight as the trainer closes)
is the end of its life. Such refusals are counted, not told (`told`): an event there only
repeated the failure, whose own event already said why, often as the run's last line.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from transom.coordinator.models import Identity, IncarnationAnswer
from transom.coordinator.records import Replica
from transom.words import FailureKind, IncarnationState

# The endpoints that refuse an incarnation that is no longer current: the metric shows each
# of them from the start (0 until something is refused), so a scrape before and after a
# fault gives the difference. A refusal on any other path is counted under its own.
ENDPOINTS = ("/v1/register", "/v1/heartbeat", "/v1/quorum", "/v1/leave", "/v1/aside", "/v1/checkpoint",
             "/v1/fence")
MAX_TOLD = 4096  # incarnation-endpoint pairs remembered as told; older ones may be told again


def refusal_message(identity: Identity, endpoint: str, known: IncarnationAnswer, current: Identity | None,
                    what: str | None = None) -> str:
    """The event and log line of a refusal. `known`: what the coordinator holds `identity` to be;
    `current`: the replica's incarnation on record; `what`: what the caller was about to do."""
    who = f"replica {identity.replica_id} generation {identity.generation} attempt {identity.attempt}"
    doing = f" ({what})" if what else ""
    if known.state == IncarnationState.SUPERSEDED and current is not None:
        why = f"superseded by generation {current.generation} attempt {current.attempt}"
    else:
        why = f"declared {known.state}" + (f": {known.reason}" if known.reason else "")
    return f"refused {who} on {endpoint}{doing}: {why}"


def told(identity: Identity, record: Replica | None) -> bool:
    """Whether refusing `identity` is worth an event; `record`: its replica's current one.
    Not for an incarnation that reported its own failure: it knows, and is no zombie."""
    if record is None or record.identity.key() != identity.key():
        return True  # superseded (or unknown): a zombie, if it acts
    return not (record.state == IncarnationState.FAILED and record.failure_kind == FailureKind.REPORTED)


@dataclass
class Refusals:
    """Every refusal, counted per endpoint; whether each incarnation was told about on it yet."""

    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    # 401s per endpoint: on Kubernetes a replaced pod's token stops authenticating once the
    # pod is gone, so a zombie healed late is refused before it can name its incarnation.
    unauthenticated: collections.Counter[str] = field(default_factory=collections.Counter)
    _told: collections.OrderedDict[tuple[int, int, int, str], None] = field(default_factory=collections.OrderedDict)

    def record(self, endpoint: str, identity: Identity) -> bool:
        """Count one refusal; True the first time this incarnation is refused on `endpoint`
        (the caller then records the event). Bounded: the oldest pairs are forgotten first."""
        self.counts[endpoint] += 1
        key = (identity.replica_id, identity.generation, identity.attempt, endpoint)
        if key in self._told:
            return False
        self._told[key] = None
        if len(self._told) > MAX_TOLD:
            self._told.popitem(last=False)
        return True

    def endpoints(self) -> list[str]:
        """The metric's label values: every refusing endpoint, and any other one seen."""
        return list(ENDPOINTS) + sorted(set(self.counts) - set(ENDPOINTS))
