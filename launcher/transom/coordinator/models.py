"""Wire messages of the coordinator API (`/v1/...`), one pydantic model per message.

Both the aiohttp server and the worker-side client use these models, so a field renamed
here changes both sides at once. Every field is bounded: the coordinator parses whatever a
client sends, and a bad value must become a 400 with the reason, never an exception deeper
in. Field names are snake_case on the wire (this is an internal API, not a Kubernetes one).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

MAX_REPLICAS = 4096
MAX_STEP = 2**62
ReplicaId = Field(ge=0, lt=MAX_REPLICAS, description="data-parallel replica index")
Generation = Field(ge=0, le=2**31, description="pod generation, bumped by the operator on replacement")
Attempt = Field(ge=0, le=2**31, description="in-place restart count of the launcher")
Step = Field(ge=0, le=MAX_STEP, description="number of committed optimizer steps")
MAX_SHARED_BYTES = 16384  # script values shared by one request or one decision, as JSON


def _bounded_shared(value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
    if value is not None and len(json.dumps(value, separators=(",", ":"))) > MAX_SHARED_BYTES:
        raise ValueError(f"shared script values take at most {MAX_SHARED_BYTES} bytes of JSON")
    return value


class _Msg(BaseModel):
    # Unknown fields are an error: a typo in a client should not silently do nothing.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Identity(_Msg):
    """Who is talking: a replica incarnation. Newer (generation, attempt) supersedes older."""

    replica_id: int = ReplicaId
    generation: int = Generation
    attempt: int = Attempt

    def key(self) -> tuple[int, int]:
        return (self.generation, self.attempt)


class RegisterRequest(_Msg):
    identity: Identity
    store_addr: str = Field(
        min_length=3, max_length=256, description="host:port of this replica's TCPStore for group building"
    )
    state_endpoints: list[str] = Field(
        min_length=1, max_length=1024, description="per rank of the replica, the URL serving recovery state"
    )
    step: int = Field(default=0, ge=0, le=MAX_STEP, description="the committed steps this replica holds now: until "
                      "a round answers it, it can claim no more (it commits nothing without a round)")


class RegisterResponse(_Msg):
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    num_replicas: int
    min_replicas: int


class HeartbeatRequest(_Msg):
    identity: Identity
    step: int = Step
    checkpoint_trouble: str | None = Field(
        None, min_length=1, max_length=300, pattern=r"^[\x20-\x7e]+$",
        description="what this replica's checkpoint writer has been failing at, while it retries "
                    "(CheckpointEngine.trouble): the replica's own word, shown as such in status.training",
    )


class AsideRequest(_Msg):
    """A replica that steps out of the rounds between two steps (`trainer.aside()`: an eval,
    sampling, saving a file): the rounds stop waiting for it, and it is not taken for hung.
    Its next quorum request brings it back, behind the others, to catch up like a joiner."""

    identity: Identity
    step: int = Step


class FailureReport(_Msg):
    identity: Identity
    reason: str = Field(min_length=1, max_length=1024)
    exit_code: int | None = Field(default=None, ge=-255, le=255)


class SignalRow(_Msg):
    """One rank's committed step as the detectors see it (transom/detect/step_rows.py)."""

    step: int = Step
    rank: int = Field(ge=0, lt=1 << 20)
    step_seconds: float = Field(ge=0, le=1e9, allow_inf_nan=False)
    tokens: float | None = Field(None, ge=0, le=1e15, allow_inf_nan=False)
    sum_len_sq: float | None = Field(None, ge=0, le=1e30, allow_inf_nan=False)
    loss: float | None = None  # may be NaN or inf: that is what the detectors look for
    grad_norm: float | None = None
    finite: bool = True
    fingerprint: int | None = Field(None, ge=-(2**63), lt=2**63)
    recovery: bool = False
    batch_share: float | None = Field(None, gt=0, le=1e3, allow_inf_nan=False)
    input_digest: int | None = Field(None, ge=-(2**63), lt=2**63, description="of the input the rank trained on")


MAX_COLLECTIVES = 2**62  # transom/collective_counts.py MAX_COUNT
Collectives = Field(ge=0, le=MAX_COLLECTIVES)


class CollectiveCounts(_Msg):
    """One rank's collectives entered and completed (transom/collective_counts.py): the
    evidence of who a hang waits for (transom/detect/hangs.py)."""

    rank: int = Field(ge=0, lt=1 << 20)
    group_id: int = Field(ge=-1, le=MAX_STEP, description="the quorum id of the cross-replica group counted")
    ftar_entered: int = Collectives
    ftar_completed: int = Collectives
    group_entered: int = Collectives
    group_completed: int = Collectives

    @model_validator(mode="after")
    def _completed_not_above_entered(self) -> CollectiveCounts:
        if self.ftar_completed > self.ftar_entered or self.group_completed > self.group_entered:
            raise ValueError("a rank cannot have completed more collectives than it entered")
        return self


class SignalBatch(_Msg):
    """A launcher's rows since its last batch (at most one batch a second), for its replica."""

    identity: Identity
    node_rank: int = Field(0, ge=0, lt=1 << 12)
    rows: list[SignalRow] = Field(max_length=4096)
    stacks: str | None = Field(None, max_length=16384, description="a hung worker's stacks (the hang watchdog)")
    collectives: list[CollectiveCounts] = Field(
        default_factory=list, max_length=1024, description="its workers' collective counts, when they changed")


class DuplicateDataFinding(_Msg):
    """The job's finding that ranks trained on identical inputs (detect/duplicates.py): a
    warning, not a verdict; status.training.duplicateData and `transom run`'s summary."""

    step: int = Step
    replicas: list[int] = Field(max_length=MAX_REPLICAS, description="the replicas whose ranks did")
    message: str = Field(max_length=1024, description="who, at which step, and the fix")


class SignalAnswer(_Msg):
    """Answer to POST /v1/signals."""

    verdicts: int = Field(ge=0, description="verdicts the batch's rows completed")
    next_post_s: float = Field(ge=0, allow_inf_nan=False, description="the launcher's pace: seconds to the next post")
    duplicate_data: DuplicateDataFinding | None = Field(None, description="the job's finding, once there is one")


class CheckpointReport(_Msg):
    """A replica committed a checkpoint (its manifest is written): it ends up in status.training."""

    identity: Identity
    step: int = Step
    uri: str = Field(min_length=1, max_length=2048, description="where the checkpoint lives")
    stall_seconds: float | None = Field(
        default=None, ge=0, le=86400, allow_inf_nan=False,
        description="how long the training loop waited for this checkpoint's memory snapshot",
    )


class FenceRequest(_Msg):
    """May this incarnation act now? Asked before each effect others can see (a checkpoint
    object written or deleted, state served to a peer): 200 if it is the replica's current,
    healthy incarnation, 409 otherwise (ft/fencing.py)."""

    identity: Identity
    what: str = Field(min_length=1, max_length=200, description="what it is about to do, for the refusal's event")


class FenceAnswer(_Msg):
    lease_s: float = Field(gt=0, le=86400, description="how long a confirmation vouches for the incarnation's "
                           "state server: the coordinator's heartbeat timeout")
    supported: bool = Field(True, description="False only as the client's reading of a coordinator that predates "
                            "fencing (no /v1/fence); never sent")


class LeaveRequest(_Msg):
    """A replica that stops without being counted as failed.

    `completed` says the job is done: this replica committed the job's last step (or its
    script ended the job on purpose). A replica that leaves because the job completed
    without it leaves with `completed` false.
    """

    identity: Identity
    step: int = Step
    completed: bool = Field(default=False, description="the job is complete at `step`")
    reason: str = Field(default="", max_length=256)


class StepReport(_Msg):
    """The figures a replica reports of its last step trained on its own batch and
    committed: carried whole by its next quorum request, kept whole by the coordinator (the
    newest per replica) and shown whole in GET /v1/status. A new per-step figure is a field
    here and the value ft/commit.py (`Commit._record`) puts in it."""

    loss: float | None = Field(default=None, allow_inf_nan=True)
    seconds: float | None = Field(default=None, ge=0, le=1e7, description="the step's wall time")
    grad_norm: float | None = Field(
        default=None, allow_inf_nan=True,  # a NaN norm is itself the news
        description="the norm of the leader rank's own gradients before the exchange (with detection on)")


class QuorumRequest(_Msg):
    identity: Identity
    step: int = Step
    commit_quorum_id: int = Field(
        ge=-1, le=MAX_STEP, description="quorum under which `step` was committed, -1 if none"
    )
    last_round: int = Field(ge=-1, le=MAX_STEP, description="the last round this incarnation received")
    failed: bool = Field(default=False, description="the last step failed (its update was discarded)")
    report: StepReport | None = Field(
        default=None, description="the last step, if it was committed and trained on this replica's own batch")
    catching_up_from: int | None = Field(
        default=None, ge=0, le=MAX_STEP,
        description="the replica trains in step but still fetches its tensors from peers: it contributes zeros "
                    "and needs a snapshot of this step or later (ft/catchup.py)",
    )
    timeout_s: float = Field(default=30.0, gt=0, le=120, description="long-poll limit")
    follows_shares: bool = Field(
        default=False, description="the replica takes its batches from the share schedule (trainer.batches): "
                                   "it can be rebalanced (transom/detect/rebalance.py)",
    )
    shares_held: list[Annotated[float, Field(gt=0, le=MAX_REPLICAS, allow_inf_nan=False)]] | None = Field(
        default=None, max_length=MAX_REPLICAS,
        description="the newest share vector this replica was told (its schedule): a restarted coordinator "
                    "carries on with it instead of changing the shares under a step already drawn",
    )
    shares_held_from: int = Field(default=0, ge=0, le=MAX_STEP, description="the step from which `shares_held` apply")
    shared: dict[str, JsonValue] | None = Field(
        default=None, max_length=256,
        description="script values this replica set in trainer.aside() (`<extra_state part>/<key>`): the next "
                    "decision hands them to every member (ft/shared_values.py)",
    )

    _shared_size = field_validator("shared")(_bounded_shared)

    @model_validator(mode="after")
    def _catching_up_from_the_past(self) -> QuorumRequest:
        if self.catching_up_from is not None and self.catching_up_from > self.step:
            raise ValueError(f"catching_up_from {self.catching_up_from} is past the step {self.step}")
        return self


class RecoverySource(_Msg):
    """A member that holds the newest state and serves it to those catching up."""

    replica_id: int = ReplicaId
    endpoints: list[str] = Field(description="its ranks' state servers, in rank order")


class QuorumResponse(_Msg):
    """The decision of one round, identical for every member but `rank` and `serve_recovery`."""

    round: int
    quorum_id: int = Field(description="strictly increasing; changes exactly when the groups must be rebuilt")
    members: list[int] = Field(description="replica ids in group-rank order")
    rank: int = Field(description="this replica's rank in the cross-replica groups")
    store_addr: str
    store_prefix: str = Field(description="never reused: a group built under it is new")
    max_step: int
    participants: int = Field(description="members that contribute gradients this step")
    recovering: list[int] = Field(description="members that catch up from the sources (they contribute zeros)")
    serve_recovery: bool = Field(description="this replica is a source: it serves its state this round")
    sources: list[RecoverySource] = Field(default_factory=list, description="the sources, when anyone catches up")
    snapshot_from: int | None = Field(
        default=None, description="sources keep a snapshot of this step or later; None: they keep none"
    )
    shares: list[float] | None = Field(
        default=None, description="each replica's share of the global batch (1.0 nominal), None: all nominal"
    )
    shares_from: int = Field(default=0, description="the step from which `shares` apply")
    shared: dict[str, JsonValue] | None = Field(
        default=None, description="script values set aside by members since the last decision: every member "
                                  "sets them before the step's exchange")
    ends_job: bool = Field(
        default=False, description="the job ends at `max_step` (its owner asked: POST /v1/finish): the members "
                                   "train no further step and complete the job where they are")
    diverged: str | None = Field(
        default=None, description="the replicas' states differ and no majority says which is right: every member "
                                  "stops (raises Diverged) instead of training on")
    holds_until: int | None = Field(
        default=None, description="a lease: the members train the steps up to this one under this quorum without "
                                  "asking (coordinator/lease.py); None: they ask for the next step")

    _shared_size = field_validator("shared")(_bounded_shared)


class FinishRequest(_Msg):
    """The job's owner ends the job at a step (`transom run --end-on`, or an administrator
    with the job's token): every replica completes it there, with its final checkpoint."""

    step: int = Field(ge=0, le=MAX_STEP, description="the step to end at; a job already past it ends at the "
                      "earliest step it still can (the step after the current round's)")


class FinishAnswer(_Msg):
    step: int = Field(description="the step at which the job will end")


class ReplicaStatus(_Msg):
    replica_id: int
    generation: int
    attempt: int
    state: Literal["healthy", "failed", "left"]
    step: int
    last_report: StepReport | None  # of its newest committed step trained on its own batch
    heartbeat_age_s: float | None
    failures: int
    last_failure: str | None
    checkpoint_trouble: str | None = None


class JobProgress(_Msg):
    """Answer to GET /v1/progress: what a starting replica needs to choose between restoring
    the checkpoint and catching up from a peer, and nothing about the other replicas'
    identities (GET /v1/status, with every replica's generation, is the job token's)."""

    peer_step: int | None = Field(description="the newest step a healthy replica other than the caller reported")
    last_checkpoint: int | None = Field(description="the newest checkpoint a replica reported committed")
    completed_step: int | None = None
    peer_endpoint: str | None = Field(
        None, max_length=256,
        description="that peer's state server (its rank 0's), for a new pod's link check (transom.check)")


class FingerprintRecord(_Msg):
    """Answer to GET /v1/fingerprints/{step}/{rank}: what the replicas' rows said about rank's
    parameters after `step` committed steps (the detectors' record; detect/detectors.py)."""

    state: Literal["agreed", "disputed", "single", "unknown"] = Field(
        description="agreed: a strict majority of two or more replicas; disputed: no strict majority; single: "
                    "one replica fingerprinted it (nothing to compare); unknown: not judged yet, or too long ago")
    value: int | None = None


class IncarnationAnswer(_Msg):
    """Answer to GET /v1/replicas/{id}: what the coordinator thinks of one incarnation."""

    replica_id: int
    state: Literal["healthy", "failed", "left", "superseded", "unknown"]
    reason: str | None = None
    job_completed: bool = Field(default=False,
                                description="a replica completed the job, or the round that ends it is decided "
                                            "(the launcher's exit 0 needs it)")


class Event(_Msg):
    time: float
    kind: str
    message: str
    replica: int | None = Field(default=None, description="the replica it is about, if one")


class JobStatus(_Msg):
    round: int
    quorum_id: int
    members: list[int]
    max_step: int
    num_replicas: int
    min_replicas: int
    healthy_replicas: int
    paused: bool
    completed_step: int | None = None
    last_checkpoint: int | None = None
    goodput: float | None = None
    duplicate_data: DuplicateDataFinding | None = None
    diverged: str | None = Field(None, description="why the job stopped: replicas whose states differ with no "
                                                   "majority (every member raised Diverged)")
    replicas: list[ReplicaStatus]
    events: list[Event]


class RendezvousInfo(_Msg):
    """Where node 0 of a multi-node replica serves torch.distributed's store."""

    identity: Identity
    master_addr: str = Field(min_length=1, max_length=256)
    master_port: int = Field(gt=0, lt=65536)


class ErrorBody(_Msg):
    error: str
    retry: bool = False
    state: Literal["superseded", "failed", "left"] | None = Field(
        default=None, description="on a 409: what the coordinator holds the calling incarnation to be")
