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
