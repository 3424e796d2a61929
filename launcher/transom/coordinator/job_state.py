"""One job's membership state, as the coordinator keeps it: the replicas' incarnations, the
rounds decided, the events, the counters, the newest checkpoint. `Membership` decides the
rounds over it (membership.py); the functions that act on one incarnation or read the job
(claims.py, incarnations.py, reports.py, job_end.py) take this record, not `Membership`,
so that none of them depends on the round logic."""

from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass, field

from transom.coordinator import rounds
from transom.coordinator.goodput import GoodputClock
from transom.coordinator.models import CheckpointReport, Event
from transom.coordinator.records import Decision, Replica
from transom.coordinator.roster import Roster
from transom.coordinator.settings import Settings
from transom.detect.rebalance import SharePolicy
from transom.words import EventKind, FailureKind, IncarnationState

ROUNDS_TIMED = 16  # the recent rounds whose median length is "a round"


@dataclass
class JobState:
    settings: Settings
    # Distinguishes this coordinator's life from a previous one: quorum ids restart at 0
    # after a restart, and group prefixes must never repeat (a reused prefix hangs).
    epoch: str = field(default_factory=lambda: secrets.token_hex(4))
    replicas: Roster = field(default_factory=Roster)  # each replica id's newest incarnation (roster.py)
    open: rounds.OpenRound = field(default_factory=rounds.OpenRound)  # the requests not yet answered
    answers: dict[int, Decision] = field(default_factory=dict)
    current: Decision | None = None
    # One past the highest max_step of any decided round: no replica can hold more steps.
    step_limit: int = 0
    next_round: int = 0
    last_quorum_id: int = -1
    decided_at: float | None = None  # when the newest round was decided
    round_seconds: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=ROUNDS_TIMED))
    paused: bool = False
    # Set when the first replica leaves with `completed`: the job's last step. A replica
    # still asking for a quorum after that cannot be helped (its peers are gone).
    completed_step: int | None = None
    end_step: int | None = None  # where its owner asked the job to end (job_end.py): the round there says so
    diverged: str | None = None  # replicas disagree without a majority: every answer stops its member
    events: collections.deque[Event] = field(default_factory=lambda: collections.deque(maxlen=256))
    # Monotonic counters exported as metrics.
    failures_total: collections.Counter[str] = field(default_factory=collections.Counter)
    quorum_changes_total: int = 0
    events_total: int = 0
    # For status.training: the newest committed checkpoint (step, wall-clock unix time) and
    # the goodput clock, advanced by every decided round.
    last_checkpoint: tuple[int, float] | None = None
    last_checkpoint_stall_s: float | None = None  # the committing replica's snapshot stall
    held_checkpoints: dict[int, tuple[CheckpointReport, float]] = field(default_factory=dict)  # claims.supported
    goodput: GoodputClock = field(default_factory=GoodputClock)
    # Rebalance (spec.detection.slowAction): the detectors set who is slow, a decision
    # publishes the shares (transom/detect/rebalance.py).
    shares: SharePolicy = field(init=False)

    def __post_init__(self) -> None:
        self.shares = SharePolicy(self.settings.num_replicas)

    # --- helpers -----------------------------------------------------------------------
    def event(self, now: float, kind: str, message: str, replica: int | None = None) -> None:
        """Record what happened (about `replica`, if one): GET /v1/status shows the newest."""
        self.events.append(Event(time=now, kind=kind, message=message, replica=replica))
        self.events_total += 1

    def fail(self, rep: Replica, now: float, reason: str, kind: str) -> None:
        """Declare incarnation `rep` failed (`kind`: why, as the failures metric counts it)."""
        rep.state = IncarnationState.FAILED
        rep.failures += 1
        rep.last_failure = reason
        rep.failure_kind = FailureKind(kind)
        self.failures_total[kind] += 1
        self.open.drop(rep.identity.replica_id)
        self.event(now, EventKind.FAILED, f"replica {rep.identity.replica_id}: {reason}", rep.identity.replica_id)
