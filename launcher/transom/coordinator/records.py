"""What the coordinator's membership keeps: each replica id's current incarnation
(`Replica`) and each round's decision (`Decision`), as plain records without behaviour
(membership.py decides; these only hold)."""

from __future__ import annotations

from dataclasses import dataclass

from transom.coordinator.models import Identity, StepReport
from transom.words import FailureKind, IncarnationState


@dataclass
class Replica:
    identity: Identity
    store_addr: str
    state_endpoints: list[str]
    state: IncarnationState = IncarnationState.HEALTHY  # healthy, failed or left (superseded: replaced)
    last_heartbeat: float = 0.0
    step: int = 0
    registered_step: int = 0  # what it held when it registered: its bound until a round answers it
    last_report: StepReport | None = None  # of its newest committed step trained on its own batch
    failures: int = 0  # over all incarnations of this replica id
    last_failure: str | None = None
    failure_kind: FailureKind | None = None  # why this incarnation was declared failed, once it was
    aside: bool = False  # stepped out of the rounds between two steps (trainer.aside()); its next request ends it
    checkpoint_trouble: str | None = None  # its heartbeat's word: its checkpoint writer fails and retries


@dataclass(frozen=True)
class Decision:
    round: int
    quorum_id: int
    members: tuple[Identity, ...]
    store_addr: str
    store_prefix: str
    max_step: int
    participants: int
    recovering: tuple[int, ...]  # members catching up (they contribute zeros)
    sources: tuple[int, ...] = ()  # members holding the newest state, serving it while anyone catches up
    snapshot_from: int | None = None  # the sources keep a snapshot of this step or later
    shares: tuple[float, ...] | None = None  # each replica's share of the global batch (Rebalance)
    shares_from: int = 0  # ... from this step on
    shared: dict | None = None  # script values set aside since the last decision (QuorumResponse.shared)
    ends_job: bool = False  # the job's last round: its members complete the job at max_step (POST /v1/finish)
    holds_until: int | None = None  # a lease: its members train up to this step without asking (lease.py)

    def member_ids(self) -> list[int]:
        return [m.replica_id for m in self.members]
