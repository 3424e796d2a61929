"""One job per checkpoint location: the job record at its root, and the check a job makes
when it starts.

`<uri>/job.json` names the job the location belongs to (job_identity.JobIdentity: its name
and uid). The first job that starts on a location writes it, once: created only where there
is none (`Storage.create`), then read back, so that of two jobs starting at the same moment
one owns the location and the other reads the winner's record. Every start of a replica (a
restart, a replaced pod, a whole job started again) reads it before it restores or writes
anything: the same job goes on; another job is refused with CheckpointLocationTaken, a
ScriptError (the job ends, and nothing restarts it in a loop), whose message names both
jobs and the location and says what to do. A location with checkpoints and no record
(written before records existed) is taken by the first job that starts on it.

The record comes from storage, so it is data to check, never code: at most
MAX_RECORD_BYTES, parsed as JSON and validated (`JobRecord`). A record that is not one
refuses the job too, with a message that says so rather than the parser's traceback.

The decisions (`refusal`, `unreadable`) are pure; `claim` does the I/O.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from transom.checkpoint.layout import JOB_RECORD
from transom.checkpoint.storage import Storage, retry
from transom.errors import CheckpointLocationTaken
from transom.job_identity import JobIdentity

log = logging.getLogger("transom.checkpoint")
FORMAT: Final = "transom-job-1"
MAX_RECORD_BYTES = 64 << 10  # a record is about 150 bytes: anything this large is not one


class JobRecord(BaseModel):
    """What `job.json` holds."""

    # Wrong types and coercions are refused. Unknown fields are ignored, so that a later
    # version may add one without locking this one out of its own job's location.
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    format: Literal["transom-job-1"] = FORMAT
    name: str = Field(max_length=253)
    uid: str = Field(max_length=128)
    created: float  # unix seconds: when the job took the location, for whoever looks at it

    @model_validator(mode="after")
    def _an_identity(self) -> JobRecord:
        JobIdentity(self.name, self.uid)  # ValueError if the name or the uid is not one
        return self

    @property
    def identity(self) -> JobIdentity:
        return JobIdentity(self.name, self.uid)

    @classmethod
    def of(cls, identity: JobIdentity, created: float) -> JobRecord:
        return cls(name=identity.name, uid=identity.uid, created=created)

    def to_json(self) -> bytes:
        return (self.model_dump_json(indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, text: str | bytes) -> JobRecord:
        """Parse and validate a record; ValueError (never anything else) if it is not one."""
        try:
            return cls.model_validate(json.loads(text))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"])) or "record"
            raise ValueError(f"{where}: {first['msg']}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, TypeError) as e:
            raise ValueError(f"not JSON: {e}") from None


def refusal(mine: JobIdentity, owner: JobIdentity, location: str) -> str | None:
    """None when the location's `owner` is this job (`mine`); else why this job may not start
    there and what to do, in words a user acts on."""
    if owner == mine:
        return None
    text = (f"checkpoint location {location} belongs to {owner.describe()}, not to this job, {mine.describe()}: "
            "two jobs on one location would restore and overwrite each other's checkpoints, so this job does "
            f"not start. Give this job a checkpoint URI of its own; or, if job {owner.name} is gone for good and "
            f"this job is to take over its checkpoints, delete {location}/{JOB_RECORD} and start this job again")
    if mine.local and owner.local:
        text += f"; or, if this run continues job {owner.name}, run it with `transom run --job-name {owner.name}`"
    return text + "."


def unreadable(location: str, why: str) -> str:
    """Why a job may not start on a location whose job record is not one."""
    return (f"checkpoint location {location} holds a job record, {location}/{JOB_RECORD}, that is not valid "
            f"({why}), so which job the location belongs to is unknown and this job does not start. If no other "
            f"job uses {location}, delete {location}/{JOB_RECORD} and start this job again; it records itself")


def claim(storage: Storage, mine: JobIdentity, stopped: Callable[[], bool],
          now: Callable[[], float] = time.time) -> bool:
    """Make sure the location of `storage` belongs to `mine`: record it where no job is
    recorded; CheckpointLocationTaken where another job is, or where the record is not one.
    Storage that is away is retried until `stopped()`, then its error is raised. True if this
    call wrote the record."""
    record = JobRecord.of(mine, now()).to_json()
    try:
        created, owner = retry("reading the checkpoint location's job record",
                               lambda: _read_or_create(storage, record), stopped=stopped, first_s=0.5, max_s=5.0)
    except ValueError as e:  # the record, or what stands in its place, is not one
        raise CheckpointLocationTaken(unreadable(storage.uri, str(e))) from None
    why = refusal(mine, owner.identity, storage.uri)
    if why is not None:
        raise CheckpointLocationTaken(why)
    if created:
        log.info("checkpoint location %s now belongs to %s", storage.uri, mine.describe())
    return created


def _read_or_create(storage: Storage, record: bytes) -> tuple[bool, JobRecord]:
    """(whether this call wrote it, the location's record): read, or else created from
    `record` and read back (ours, or the one that won a race to create it)."""
    created = False
    try:
        text = storage.read_text(JOB_RECORD, limit=MAX_RECORD_BYTES)
    except FileNotFoundError:
        created = storage.create(record, JOB_RECORD)
        text = storage.read_text(JOB_RECORD, limit=MAX_RECORD_BYTES)
    return created, JobRecord.from_json(text)
