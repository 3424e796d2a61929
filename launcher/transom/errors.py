"""Every exception Transom raises that a training script or a tool may want to catch: one
family, so `except transom.errors.TransomError` catches them all and nothing else.

    TransomError
    ├── CoordinatorError          the coordinator refused a request, or stayed unreachable
    │   ├── Evicted               409: this incarnation was declared dead or superseded: exit
    │   │   └── Fenced            an effect of such an incarnation refused before it happened
    │   ├── NotRegistered         404: the coordinator does not know this replica: register again
    │   ├── Forbidden             403: the caller's credential does not speak for that replica
    │   ├── TooManyRequests       429: signals posted faster than the coordinator takes them: later
    │   └── JobCompleted          410: the job is complete: there is nothing left to join
    ├── NoQuorum                  no quorum formed within `quorum_timeout_s`
    ├── TooManyFailedSteps        the replica failed `max_failed_steps` steps in a row
    ├── MustRestart               this replica cannot go on where it is; its launcher restarts it
    ├── ScriptError               the script is wrong: every retry fails the same way, so the job ends
    │   ├── UsageError            the API used out of order (a bug in the calling script)
    │   ├── IncompatibleCheckpoint  (also a CheckpointError, below)
    │   └── CheckpointLocationTaken (also a CheckpointError, below)
    ├── BackendError              a collective backend that cannot work where the tensors are
    ├── CheckpointError
    │   ├── NoCheckpoint          no committed checkpoint to restore
    │   ├── CorruptCheckpoint     a checkpoint whose bytes do not match its manifest
    │   ├── IncompatibleCheckpoint  a sound checkpoint that does not fit this job
    │   ├── CheckpointLocationTaken the checkpoint location belongs to another job
    │   └── StorageStalled        storage stopped answering a restore's reads
    ├── IncompatibleState         a replica state (a peer's, a checkpoint's) that the live objects do not take
    └── InvalidBytes              bytes from a peer or from storage that are not what they claim
        ├── WireError             a peer's replica state
        └── BlobError             a tensor blob in a checkpoint

A ScriptError that escapes a worker ends the whole job at once, never retried
(transom/script_errors.py): its launcher exits with `contract.EXIT_SCRIPT_ERROR`. The set is
kept small on purpose: only what fails the same way on any node, in any incarnation.
BackendError is not one: a pod that sees no GPU, or replicas that share one, is the node's
or the placement's doing, which a replica started elsewhere can escape.

The coordinator raises the same CoordinatorError classes that its client raises (it
maps each to its HTTP status), so one name means one thing on both ends. A class that took
the place of a builtin its callers caught before it existed also derives from that builtin
(RuntimeError, ValueError, LookupError, TimeoutError), so older `except ValueError:` code
still works; CoordinatorError and its subclasses, ScriptError and CheckpointError derive from
TransomError alone. Imports nothing heavy.
"""

from __future__ import annotations

from transom.words import EVICTED


class TransomError(Exception):
    """The root of every exception Transom raises on purpose."""


class CoordinatorError(TransomError):
    """The coordinator refused a request (`status`: its HTTP status) or stayed unreachable
    past the deadline (`status` None)."""

    default_status: int | None = None

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status if status is not None else self.default_status


EVICTED_STATES = EVICTED  # transom/words.py: superseded, failed, left


class Evicted(CoordinatorError):
    """409: this incarnation was declared dead or superseded; the process should exit.

    `state`: what the coordinator holds this incarnation to be, one of EVICTED_STATES
    (None where it did not say, e.g. an older coordinator)."""

    default_status = 409

    def __init__(self, message: str, status: int | None = None, state: str | None = None):
        super().__init__(message, status)
        self.state = state if state in EVICTED_STATES else None


class Fenced(Evicted):
    """An effect of an incarnation that is no longer current (superseded, failed or left) was
    refused before it happened: a checkpoint object not written or not deleted, state not
    served (transom/ft/fencing.py). Nothing of it reached storage or a peer; the message is
    the one line that says so ("fenced: replica 1 generation 0 attempt 0 was superseded;
    checkpoint part 1 of step 10 not written")."""


class NotRegistered(CoordinatorError):
    """404: the coordinator does not know this replica (it restarted): register again."""

    default_status = 404


class Forbidden(CoordinatorError):
    """403: the caller's credential names another replica (or node, or no replica at all):
    a replica's code speaks only for its own replica (coordinator/identity.py)."""

    default_status = 403


class TooManyRequests(CoordinatorError):
    """429: the coordinator takes no more signals from this poster now (its rate or the
    detectors' time budget is spent); post the same rows again later."""

    default_status = 429


class JobCompleted(CoordinatorError):
    """410: the job is complete (a replica committed its last step); this one should stop."""

    default_status = 410


class NoQuorum(TransomError, RuntimeError):
    """The coordinator formed no quorum with this replica within `FTConfig.quorum_timeout_s`."""


class MustRestart(TransomError, RuntimeError):
    """This replica cannot go on from where it is (e.g. it skipped restoring a checkpoint
    for a peer that is gone); let it propagate: its launcher restarts it."""


class ScriptError(TransomError):
    """The training script, or the job's configuration of it, is wrong in a way that every
    retry repeats: the same call fails on any node and in any incarnation. When one escapes
    a worker, its launcher restarts nothing and exits with `contract.EXIT_SCRIPT_ERROR`, and
    the job ends (`transom run` stops every replica; the operator marks the job Failed).
    Raised only as one of its subclasses."""


class UsageError(ScriptError, RuntimeError):
    """The training API was used out of order: a bug in the calling script; the message
    says which call was expected."""


class Diverged(ScriptError, ValueError):
    """Replicas that must hold the same parameters and optimizer state do not, and no strict
    majority says which of them is right (two replicas, or an even split). Nothing assembled
    from them is trustworthy: no checkpoint of them is committed, and the job stops with
    this message (a state that is not registered with Transom, such as an LR scheduler left
    out of `extra_state`, or a non-deterministic update, are the usual causes)."""


class TooManyFailedSteps(TransomError, RuntimeError):
    """`FTConfig.max_failed_steps` steps in a row were not committed."""


class BackendError(TransomError, ValueError):
    """A collective backend that cannot work for these processes and tensors (e.g. NCCL
    with CPU gradients); the message says what to change."""


class CheckpointError(TransomError):
    """A checkpoint could not be restored."""


class NoCheckpoint(CheckpointError, LookupError):
    """There is no committed checkpoint (of that step) under the URI."""


class CorruptCheckpoint(CheckpointError, ValueError):
    """A checkpoint's files do not match its manifest (size, checksum, layout)."""


class IncompatibleCheckpoint(CheckpointError, ScriptError, ValueError):
    """A sound checkpoint that does not fit this job (e.g. sharded for another number of ranks).
    A ScriptError: every incarnation of every replica restores the same newest checkpoint
    and fails the same way, until the job's processes per replica or its URI change."""


class CheckpointLocationTaken(CheckpointError, ScriptError):
    """The checkpoint location belongs to another job (its job record names another name or
    uid), or holds a job record that is not one (checkpoint/owner.py). Raised when the job
    starts, before it restores or writes anything. A ScriptError: every replica of this job
    would be refused the same way, until the job's checkpoint URI changes or the location's
    job record is deleted; the message names both jobs, the location and what to do."""


class StorageStalled(CheckpointError, TimeoutError):
    """Storage returned none of a restore's reads for `checkpoint.storage.READ_STALL_S`."""


class IncompatibleState(TransomError, ValueError):
    """A replica state, from a peer or a checkpoint, that this script's model, optimizer or
    scaler does not take (another architecture, a disabled GradScaler, a step that is no number)."""


class InvalidBytes(TransomError, ValueError):
    """Bytes from a peer or from storage that are not what they claim to be; never executed."""


class WireError(InvalidBytes):
    """A peer's replica state that does not parse or does not match its index."""


class SnapshotChanged(WireError):
    """The sources no longer serve the snapshot being fetched (a newer one replaced it)."""


class BlobError(InvalidBytes):
    """A tensor blob whose header, size or checksum is wrong."""


class WarmStartFailed(TransomError):
    """The warm interpreter did not start a worker (launch/warm_start.py): the launcher starts
    it, and the ones after it, as new processes."""
