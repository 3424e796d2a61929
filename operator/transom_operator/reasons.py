"""CamelCase reasons of conditions, replica failures and Events, defined once.

The same constants serve as `status.conditions[].reason`, `status.replicas[].lastFailure.reason`,
`status.excludedNodes[].reason` and the `reason` of Kubernetes Events, so that a user can
grep one word from `kubectl get events` to `kubectl get tj -o yaml`.
"""

from __future__ import annotations

from transom import contract

# --- why a replica failed (lastFailure.reason, ReplicaFailed events) ---------------
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

# A container exited 4 (EXIT_SCRIPT_ERROR): the script raised a ScriptError, which every
# incarnation would raise again. It ends the job (also the Failed condition's reason), and is
# never a replacement: not in FAILURE_REASONS.
SCRIPT_ERROR = "ScriptError"

# Every reason a replica is replaced for (the operator's failure counter starts each at 0).
FAILURE_REASONS = (POD_FAILED, POD_DELETED, POD_EVICTED, NODE_NOT_READY, NODE_LOST, FLAGGED_BY_COORDINATOR,
                   EXITED_EARLY, REPEATED_FAILURES, NODE_EXCLUDED, OOM_KILLED)

# Failure reasons that say the node, not the software, is at fault.
HARDWARE_REASONS = frozenset({NODE_NOT_READY, NODE_LOST, REPEATED_FAILURES})

# --- condition reasons ----------------------------------------------------------------
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
INVALID_SPEC = "InvalidSpec"  # the operator cannot use the spec (also the Event): it acts on nothing
SLOW_REPLICA_REBALANCED = "SlowReplicaRebalanced"  # spec.detection.slowAction Rebalance in force
NOMINAL_SHARES = "NominalShares"

# --- Events (transitions a user can act on) -------------------------------------------
EVENT_REPLICA_FAILED = "ReplicaFailed"
EVENT_REPLICA_REPLACED = "ReplicaReplaced"
EVENT_SPARE_PROMOTED = "SparePromoted"
EVENT_NODE_EXCLUDED = "NodeExcluded"
EVENT_NODE_ACTION_NOT_ALLOWED = "NodeActionNotAllowed"  # Taint/Cordon asked for, not allowed by the admin
EVENT_JOB_DEGRADED = "JobDegraded"
EVENT_JOB_FAILED = "JobFailed"
EVENT_JOB_SUCCEEDED = "JobSucceeded"
EVENT_JOB_SUSPENDED = "JobSuspended"
EVENT_REBALANCED = "Rebalanced"  # the batch shares changed (status.training.batchSharePercent)

NORMAL = "Normal"
WARNING = "Warning"

# --- why a replica waits (status.replicas[].reason, and the Event once per incarnation) -------
# A pod's container waits for an image the kubelet cannot pull (ErrImagePull, ImagePullBackOff,
# InvalidImageName, ErrImageNeverPull). Not a failure: the kubelet retries with its own backoff,
# and the operator leaves the pod alone.
IMAGE_PULL_FAILED = "ImagePullFailed"
