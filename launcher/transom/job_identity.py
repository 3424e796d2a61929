"""A job's identity: its name and its uid. A checkpoint location records the job it belongs
to (checkpoint/owner.py), and a job of another identity is refused there.

On Kubernetes they are the TrainingJob's `metadata.name` and `metadata.uid`, which the
operator puts in every worker pod (`contract.ENV_JOB`, `contract.ENV_JOB_UID`): a replica
restarted, a pod replaced or the coordinator restarted is the same job, while a job deleted
and created again under the same name is another one (a new uid).

`transom run` has no API server to give a uid: a local job is its name alone. The name is
`--job-name NAME`, or else a fresh `local-<8 hex digits>` per run, and the uid of every
local job is LOCAL_UID. So the replicas of one `transom run` (restarted in place, new
generations, spares) are one job, a second `transom run` on the same location is another
one, and `transom run --job-name NAME` says that it continues job NAME.

Standard library only: `transom run` and the launcher use it without torch.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from transom import contract

# A Kubernetes object name (a DNS subdomain, up to 253 characters) always matches; locally
# the name also becomes a label value in the spares' labels file (launch/local_pods.py).
NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9])?")  # whole: fullmatch ($ allows a "\n")
UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")  # a Kubernetes uid is a UUID
# The uid of every `transom run` job: the name alone tells local jobs apart (a Kubernetes uid
# is a UUID, never this word).
LOCAL_UID = "transom-run"
LOCAL_NAME_PREFIX = "local-"  # the name of a `transom run` without --job-name: this, 8 hex digits


@dataclass(frozen=True)
class JobIdentity:
    """Who a job is: two jobs are the same job when both fields are equal."""

    name: str
    uid: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ValueError(f"a job name must be 1 to 253 letters, digits, '-', '_' or '.', beginning and ending "
                             f"with a letter or digit, got {self.name!r}")
        if not isinstance(self.uid, str) or not UID.fullmatch(self.uid):
            raise ValueError(f"a job uid must be 1 to 128 letters, digits, '-', '_', '.' or ':', got {self.uid!r}")

    @property
    def local(self) -> bool:
        """A `transom run` job (its name alone identifies it)."""
        return self.uid == LOCAL_UID

    def describe(self) -> str:
        """The job as a user finds it again: "TrainingJob demo (uid 5f0c...)", or "`transom run`
        job local-3f2a9c1e"."""
        return f"`transom run` job {self.name}" if self.local else f"TrainingJob {self.name} (uid {self.uid})"

    @classmethod
    def for_local_run(cls, name: str | None) -> JobIdentity:
        """A `transom run`'s identity: `name` (--job-name), or a fresh name for this run."""
        return cls(name or LOCAL_NAME_PREFIX + secrets.token_hex(4), LOCAL_UID)

    @classmethod
    def of(cls, env: contract.ReplicaEnv) -> JobIdentity | None:
        """The identity a pod's environment carries; None without a uid (a script run by hand,
        a test's replicas, an older operator): such a process claims no location."""
        return cls(env.job, env.job_uid) if env.job_uid else None
