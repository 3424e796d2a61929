"""CamelCase reasons of conditions, replica failures and Events, defined once.

The same words serve as `status.conditions[].reason`, `status.replicas[].lastFailure.reason`,
`status.excludedNodes[].reason` and the `reason` of Kubernetes Events, so that a user can
grep one word from `kubectl get events` to `kubectl get tj -o yaml`. Each family is a
`StrEnum` (its members are the strings the API carries); the module-level names are its
members, so `reasons.POD_FAILED is FailureReason.POD_FAILED`.
"""

from __future__ import annotations

from enum import StrEnum

from transom import contract


class FailureReason(StrEnum):
    """Why a replica failed (lastFailure.reason, ReplicaFailed events): every reason a replica
    is replaced for (the operator's failure counter starts each at 0)."""

    POD_FAILED = "PodFailed"  # a container exited non-zero past the launcher's in-place restarts
    POD_DELETED = "PodDeleted"  # deleted (by a user, a drain, the pod GC) or gone
    POD_EVICTED = "PodEvicted"  # evicted by the kubelet (node pressure) or the eviction API
    NODE_NOT_READY = "NodeNotReady"  # its node NotReady for longer than the grace period
    NODE_LOST = "NodeLost"  # the kubelet reported the node lost or shut down
    FLAGGED_BY_COORDINATOR = "FlaggedByCoordinator"  # a verdict in status.training.verdicts
    EXITED_EARLY = "ExitedEarly"  # exited 0 before the coordinator recorded the job complete
    REPEATED_FAILURES = "RepeatedFailures"  # a second failure on the same node within the window
    NODE_EXCLUDED = "NodeExcluded"  # (spares) its node was excluded by a failure of another pod
    # The kernel's OOM killer ended a worker or the launcher (the container over its memory
    # limit): the script's memory, not the node. Also the reason of the Failed condition when
    # that keeps happening (reconcile/oom.py), and of the Event of a kill restarted in place.
    OOM_KILLED = contract.OOM_KILLED
    # A pre-flight check (transom.check) failed on the pod's node before its workers started
    # (the launcher exited contract.EXIT_PREFLIGHT_FAILED): the node, not the script.
    PREFLIGHT_FAILED = contract.PREFLIGHT_FAILED


class ConditionReason(StrEnum):
    """status.conditions[].reason."""

    ALL_REPLICAS_HEALTHY = "AllReplicasHealthy"
    REPLICAS_STARTING = "ReplicasStarting"
    REPLACING_REPLICAS = "ReplacingReplicas"
    NO_REPLACEMENT = "NoReplacementInProgress"
    BELOW_MIN_REPLICAS = "BelowMinReplicas"
    ENOUGH_REPLICAS = "EnoughReplicas"
    TRAINING_COMPLETE = "TrainingComplete"
    NOT_COMPLETE = "NotComplete"
    TOO_MANY_RESTARTS = "TooManyRestarts"
    NOT_FAILED = "NotFailed"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"  # Ready False while Kueue has not admitted the job
    INVALID_SPEC = "InvalidSpec"  # the operator cannot use the spec (also the Event): it acts on nothing
    SLOW_REPLICA_REBALANCED = "SlowReplicaRebalanced"  # spec.detection.slowAction Rebalance in force
    NOMINAL_SHARES = "NominalShares"
    STORAGE_FAILING = "StorageFailing"  # status.training.checkpointTrouble: writers retry
    CHECKPOINTS_OK = "CheckpointsOK"
    REPLICAS_DIVERGED = "ReplicasDiverged"  # status.training.diverged: the coordinator stopped the job
    REPLICAS_AGREE = "ReplicasAgree"
    # A container exited 4 (EXIT_SCRIPT_ERROR): the script raised a ScriptError, which every
    # incarnation would raise again. It ends the job (the Failed condition's reason), and is
    # never a replacement: not a FailureReason.
    SCRIPT_ERROR = "ScriptError"


class EventReason(StrEnum):
    """The reason of an Event: a transition a user can act on."""

    REPLICA_FAILED = "ReplicaFailed"
    REPLICA_REPLACED = "ReplicaReplaced"
    SPARE_PROMOTED = "SparePromoted"
    NODE_EXCLUDED = "NodeExcluded"
    NODE_ACTION_NOT_ALLOWED = "NodeActionNotAllowed"  # Taint/Cordon asked for, not allowed by the admin
    JOB_DEGRADED = "JobDegraded"
    JOB_FAILED = "JobFailed"
    JOB_SUCCEEDED = "JobSucceeded"
    JOB_SUSPENDED = "JobSuspended"
    JOB_QUEUED = "JobQueued"  # waiting for Kueue (again, after an eviction)
    JOB_ADMITTED = "JobAdmitted"  # Kueue admitted the job: its pods are created
    REBALANCED = "Rebalanced"  # the batch shares changed (status.training.batchSharePercent)
    CHECKPOINT_TROUBLE = "CheckpointTrouble"  # replicas' checkpoint writers began to fail (checkpointTrouble)
    CHECKPOINTS_WRITTEN = "CheckpointsWritten"  # ... and write again


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


# --- why a replica failed ------------------------------------------------------------
POD_FAILED = FailureReason.POD_FAILED
POD_DELETED = FailureReason.POD_DELETED
POD_EVICTED = FailureReason.POD_EVICTED
NODE_NOT_READY = FailureReason.NODE_NOT_READY
NODE_LOST = FailureReason.NODE_LOST
FLAGGED_BY_COORDINATOR = FailureReason.FLAGGED_BY_COORDINATOR
EXITED_EARLY = FailureReason.EXITED_EARLY
REPEATED_FAILURES = FailureReason.REPEATED_FAILURES
NODE_EXCLUDED = FailureReason.NODE_EXCLUDED
OOM_KILLED = FailureReason.OOM_KILLED
PREFLIGHT_FAILED = FailureReason.PREFLIGHT_FAILED
SCRIPT_ERROR = ConditionReason.SCRIPT_ERROR

FAILURE_REASONS = tuple(FailureReason)

# Failure reasons that say the node, not the software, is at fault.
HARDWARE_REASONS = frozenset({NODE_NOT_READY, NODE_LOST, REPEATED_FAILURES, PREFLIGHT_FAILED})

# --- condition reasons ----------------------------------------------------------------
ALL_REPLICAS_HEALTHY = ConditionReason.ALL_REPLICAS_HEALTHY
REPLICAS_STARTING = ConditionReason.REPLICAS_STARTING
REPLACING_REPLICAS = ConditionReason.REPLACING_REPLICAS
NO_REPLACEMENT = ConditionReason.NO_REPLACEMENT
BELOW_MIN_REPLICAS = ConditionReason.BELOW_MIN_REPLICAS
ENOUGH_REPLICAS = ConditionReason.ENOUGH_REPLICAS
TRAINING_COMPLETE = ConditionReason.TRAINING_COMPLETE
NOT_COMPLETE = ConditionReason.NOT_COMPLETE
TOO_MANY_RESTARTS = ConditionReason.TOO_MANY_RESTARTS
NOT_FAILED = ConditionReason.NOT_FAILED
SUSPENDED = ConditionReason.SUSPENDED
QUEUED = ConditionReason.QUEUED
INVALID_SPEC = ConditionReason.INVALID_SPEC
SLOW_REPLICA_REBALANCED = ConditionReason.SLOW_REPLICA_REBALANCED
NOMINAL_SHARES = ConditionReason.NOMINAL_SHARES
STORAGE_FAILING = ConditionReason.STORAGE_FAILING
CHECKPOINTS_OK = ConditionReason.CHECKPOINTS_OK
REPLICAS_DIVERGED = ConditionReason.REPLICAS_DIVERGED
REPLICAS_AGREE = ConditionReason.REPLICAS_AGREE

# --- Events ---------------------------------------------------------------------------
EVENT_REPLICA_FAILED = EventReason.REPLICA_FAILED
EVENT_REPLICA_REPLACED = EventReason.REPLICA_REPLACED
EVENT_SPARE_PROMOTED = EventReason.SPARE_PROMOTED
EVENT_NODE_EXCLUDED = EventReason.NODE_EXCLUDED
EVENT_NODE_ACTION_NOT_ALLOWED = EventReason.NODE_ACTION_NOT_ALLOWED
EVENT_JOB_DEGRADED = EventReason.JOB_DEGRADED
EVENT_JOB_FAILED = EventReason.JOB_FAILED
EVENT_JOB_SUCCEEDED = EventReason.JOB_SUCCEEDED
EVENT_JOB_SUSPENDED = EventReason.JOB_SUSPENDED
EVENT_JOB_QUEUED = EventReason.JOB_QUEUED
EVENT_JOB_ADMITTED = EventReason.JOB_ADMITTED
EVENT_REBALANCED = EventReason.REBALANCED
EVENT_CHECKPOINT_TROUBLE = EventReason.CHECKPOINT_TROUBLE
EVENT_CHECKPOINTS_WRITTEN = EventReason.CHECKPOINTS_WRITTEN

NORMAL = EventType.NORMAL
WARNING = EventType.WARNING

# --- why a replica waits (status.replicas[].reason, and the Event once per incarnation) -------
# A pod's container waits for an image the kubelet cannot pull (ErrImagePull, ImagePullBackOff,
# InvalidImageName, ErrImageNeverPull). Not a failure: the kubelet retries with its own backoff,
# and the operator leaves the pod alone.
IMAGE_PULL_FAILED = "ImagePullFailed"
