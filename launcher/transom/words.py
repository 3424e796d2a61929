"""The coordinator's and detectors' closed vocabularies, as `StrEnum`s: each member *is* its
wire string ("healthy" == IncarnationState.HEALTHY), so JSON, metrics labels and the CRD
read the same as before, while the code names a choice once instead of spelling it.

Torch-free and dependency-free: the operator, the launcher and the workers import it alike.
Where the operator's CRD model (operator/transom_operator/api*.py) spells one of these as a
`Literal`, the values here must stay identical (the CRD is generated from those models).
"""

from __future__ import annotations

from enum import StrEnum


class IncarnationState(StrEnum):
    """What the coordinator holds one replica incarnation to be (GET /v1/replicas/{id})."""

    HEALTHY = "healthy"
    FAILED = "failed"  # declared failed: reported, expired, hung, diverged or detected
    LEFT = "left"  # left on its own (completed, or stopped)
    SUPERSEDED = "superseded"  # a newer incarnation of its replica registered
    UNKNOWN = "unknown"  # never registered with this coordinator (or it restarted)


# The states in which an incarnation may no longer act: a 409 names one (errors.Evicted).
EVICTED = (IncarnationState.SUPERSEDED, IncarnationState.FAILED, IncarnationState.LEFT)


class FailureKind(StrEnum):
    """Why the coordinator declared an incarnation failed (the failures metric's label)."""

    REPORTED = "reported"  # its launcher reported a worker's exit
    HEARTBEAT = "heartbeat"  # its heartbeats stopped
    HUNG = "hung"  # it did not ask for its next quorum in time
    SUPERSEDED = "superseded"  # a newer incarnation registered
    DETECTED = "detected"  # a detector's verdict with the action Replace
    DIVERGED = "diverged"  # it committed a step nobody holding the state committed
    UNSUPPORTED = "unsupported"  # before a first round, it claimed more steps than a majority holds


class VerdictKind(StrEnum):
    """What a detector found (detect/), as the metrics and the trace name it."""

    SLOW = "slow"
    HANG = "hang"
    NAN = "nan"
    LOSS_SPIKE = "loss_spike"
    SDC = "sdc"


class VerdictReason(StrEnum):
    """A verdict's reason in status.training.verdicts[].reason (one CamelCase word, read by
    the operator for its conditions and Events)."""

    FAIL_SLOW = "FailSlow"
    HANG = "Hang"
    NON_FINITE = "NonFinite"
    LOSS_SPIKE = "LossSpike"
    SILENT_DATA_CORRUPTION = "SilentDataCorruption"


REASONS = {VerdictKind.SLOW: VerdictReason.FAIL_SLOW, VerdictKind.HANG: VerdictReason.HANG,
           VerdictKind.NAN: VerdictReason.NON_FINITE, VerdictKind.LOSS_SPIKE: VerdictReason.LOSS_SPIKE,
           VerdictKind.SDC: VerdictReason.SILENT_DATA_CORRUPTION}
# Hardware-class findings: the node is excluded, not only the replica replaced.
NODE_KINDS = (VerdictKind.SLOW, VerdictKind.SDC)


class DetectAction(StrEnum):
    """What a verdict does: spec.detection.action (Replace or Report) and slowAction (also
    Rebalance), as the CRD spells them."""

    REPLACE = "Replace"
    REPORT = "Report"
    REBALANCE = "Rebalance"  # slowAction only: a smaller share of each global batch


class EventKind(StrEnum):
    """What happened, as the coordinator's events name it (GET /v1/status `events[].kind`;
    `transom run --end-on KIND[:REPLICA]` waits for them)."""

    REGISTERED = "registered"  # an incarnation registered
    FAILED = "failed"  # an incarnation was declared failed
    QUORUM = "quorum"  # a new quorum (its members changed, or a step failed)
    CAUGHT_UP = "caught_up"  # a replica that caught up from its peers holds the job's state
    PAUSED = "paused"  # fewer than minReplicas ready: no round
    RESUMED = "resumed"  # enough replicas again
    ASIDE = "aside"  # a replica stepped out of the rounds (trainer.aside())
    LEFT = "left"  # an incarnation left on its own
    COMPLETED = "completed"  # a replica completed the job
    FINISHING = "finishing"  # the job's owner set the step the job ends at
    CHECKPOINT = "checkpoint"  # a checkpoint was committed
    CHECKPOINT_TROUBLE = "checkpoint_trouble"  # a replica's checkpoint writer keeps failing
    CHECKPOINT_TROUBLE_OVER = "checkpoint_trouble_over"  # ... and writes again
    VERDICT = "verdict"  # a detector's verdict
    REBALANCE = "rebalance"  # the batch shares changed
    DUPLICATE_DATA = "duplicate_data"  # replicas trained on identical inputs
    DIVERGED = "diverged"  # replicas hold different states and no majority says which is right: the job stops
    SHARED = "shared"  # a replica's shared script values were dropped
    REFUSED = "refused"  # a call of an incarnation that is no longer current was refused
