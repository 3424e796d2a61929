"""Where a checkpoint's files go, what its manifest says, and which checkpoints to keep.

Pure (no torch, no I/O), so the rules are table-tested alone. The location holds the job
it belongs to and the checkpoints; one checkpoint of step N:

    <uri>/job.json                          the job that owns the location (owner.py), written once
    <uri>/step-<N, 12 digits>/
        attempt-<a>/part-<k>/__0_0.distcp   part k's tensors (DCP's file format)
        attempt-<a>/part-<k>/checksums.json its entries, offsets and CRC-32s, written last by its writer
        attempt-<a>/part-<k>/skipped        instead of the above: its writer skipped this checkpoint
        .metadata                           DCP's index of the whole step (for `dcp.load`)
        manifest.json                       written last of all: the commit

Replicas hold identical state, so each shard's entries are split into parts balanced by
size (`partition`), and each writer writes one part (`Slot`). Every attempt at saving a
step (the writers of one quorum round) writes into a directory of its own, named from an
id all its writers share, so parts of different attempts (a crashed run and the run that
resumed, two lineages at the same step) can never mix: the committer reads only its own
attempt's parts. Only a step directory with a readable `manifest.json` is a checkpoint;
anything else is an attempt that did not finish and is never read. Step numbers are
zero-padded so that names sort by step.

A manifest is read back from storage, so it is data to check, not to trust: `Manifest`
validates every field and every cross-reference (dtypes from a fixed list, sizes that match
shapes, parts, shards, files and offsets in range, skeletons that name only its tensors)
and `Manifest.from_json` raises ValueError, never anything else, for anything off.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from transom.checkpoint import structure
from transom.checkpoint.tensor_entry import MAX_INT, TensorEntry

MANIFEST = "manifest.json"
JOB_RECORD = "job.json"  # at the root of the location: its owner (owner.py)
PART_DONE = "checksums.json"
PART_SKIPPED = "skipped"
DATA_FILE = "__0_0.distcp"  # DCP's name for a single writer's data file
DCP_METADATA = ".metadata"
FORMAT: Final = "transom-dcp-3"
MAX_MANIFEST_BYTES = 256 << 20  # a manifest larger than this is not one of ours
MAX_PARTS = 1 << 24
MAX_SHARDS = 1 << 16
_STEP_DIR = re.compile(r"^step-(\d{12})$")
_REL_PATH = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_./-]{0,255}$")


def is_inside(path: str) -> bool:
    """True for a path inside a step directory, as the manifest names it: relative, no ".."."""
    return bool(_REL_PATH.match(path)) and ".." not in path.split("/")


def step_dir(step: int) -> str:
    if not 0 <= step < 10**12:
        raise ValueError(f"step must be between 0 and 10^12 - 1, got {step}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def part_dir(k: int) -> str:
    return f"part-{k}"


def attempt_dir(attempt: str) -> str:
    """The directory of one attempt at a step: a short hash of the id its writers share."""
    if not attempt:
        raise ValueError("a checkpoint attempt id must not be empty")
    return "attempt-" + hashlib.sha256(attempt.encode()).hexdigest()[:16]


def data_path(attempt: str, part: int) -> str:
    """Part `part`'s data file, relative to the step directory."""
    return f"{attempt_dir(attempt)}/{part_dir(part)}/{DATA_FILE}"


def describe(path: str) -> str:
    """What a path under the checkpoint root is, in words ("checkpoint part 1 of step 10"), for
    the line that says it was not written (fencing) and the coordinator's event."""
    parts = path.strip("/").split("/")
    step = parse_step_dir(parts[0]) if parts else None
    if step is None:
        return path
    name, rest = parts[-1], parts[1:]
    part = next((p.removeprefix("part-") for p in rest if p.startswith("part-")), None)
    if not rest:
        return f"checkpoint of step {step}"
    if part is not None and name in (DATA_FILE, PART_DONE, PART_SKIPPED):
        what = {DATA_FILE: "checkpoint part", PART_DONE: "checksums of checkpoint part",
                PART_SKIPPED: "skipped marker of checkpoint part"}[name]
        return f"{what} {part} of step {step}"
    if rest == [DCP_METADATA]:
        return f"index (.metadata) of step {step}"
    if rest == [MANIFEST]:
        return f"manifest of step {step}"
    return f"{'/'.join(rest)} of step {step}"


def shard_prefix(shard: int, shards: int) -> str:
    """Key prefix of a shard's tensors: none when the state is not sharded."""
    return f"shard-{shard}/" if shards > 1 else ""


@dataclass(frozen=True)
class Slot:
    """The share of one checkpoint that one process writes.

    The state has `shards` shards: 1 when every rank of a replica holds the same state
    (one process, DDP), the replica's world size when each rank holds a different piece
    (FSDP2). Every shard is held by `writers` processes with identical copies, and split
    between them: writer w of shard s writes part `s * writers + w`.
    """

    writer: int = 0
    writers: int = 1
    shard: int = 0
    shards: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.writer < self.writers and 0 <= self.shard < self.shards):
            raise ValueError(f"invalid checkpoint slot {self}")

    @property
    def part(self) -> int:
        return self.shard * self.writers + self.writer

    @property
    def num_parts(self) -> int:
        return self.shards * self.writers

    @classmethod
    def of(cls, replica_rank: int, num_replicas: int, rank: int, world_size: int, sharded: bool) -> Slot:
        """The slot of `rank` (of `world_size` in its replica) in replica `replica_rank` of the quorum."""
        if sharded:  # rank r of every replica holds shard r: the replicas split it
            return cls(writer=replica_rank, writers=num_replicas, shard=rank, shards=world_size)
        return cls(writer=replica_rank * world_size + rank, writers=num_replicas * world_size)


class _Record(BaseModel):
    # Read back from storage: unknown fields, wrong types and coercions are all refused.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Entry(TensorEntry):
    """One tensor of the checkpoint, as the manifest records it."""

    nbytes: int = Field(ge=0, le=MAX_INT)
    crc32: int = Field(ge=0, lt=1 << 32)
    part: int = Field(ge=0, lt=MAX_PARTS)
    shard: int = Field(default=0, ge=0, lt=MAX_SHARDS)
    file: str = Field(default="", max_length=256)  # the data file, relative to the step
    offset: int = Field(default=0, ge=0, le=MAX_INT)  # where its blob starts in `file`
    length: int = Field(default=0, ge=0, le=MAX_INT)  # and how long the blob is

    @model_validator(mode="after")
    def _sizes_agree(self) -> Entry:
        if self.size != self.nbytes:
            raise ValueError(f"{self.key}: {self.dtype}{self.shape} is {self.size} bytes, not {self.nbytes}")
        return self


class FileInfo(_Record):
    """A file of the step directory: its size and CRC-32, checked before anything reads it."""

    size: int = Field(ge=0, le=MAX_INT)
    crc32: int = Field(ge=0, lt=1 << 32)


class PartRecord(_Record):
    """What a writer leaves in `checksums.json` when its part is complete."""

    attempt: str = Field(min_length=1, max_length=1024)
    entries: list[Entry]
    files: dict[str, FileInfo]
    structure: Any = None  # the shard's skeleton, from the shard's first writer only
    # The fingerprint of the writer's parameters and optimizer state (ft/guard.py): every
    # writer of a shard holds the same copy, so the committer refuses parts that disagree.
    state_digest: int | None = Field(None, ge=-(2**63), lt=2**63)


class Manifest(_Record):
    """The commit record of one checkpoint. Construction validates everything."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)

    format: Literal["transom-dcp-3"] = FORMAT
    step: int = Field(ge=0, lt=10**12)
    attempt: str = Field(min_length=1, max_length=1024)
    num_parts: int = Field(ge=1, le=MAX_PARTS)
    num_shards: int = Field(default=1, ge=1, le=MAX_SHARDS)
    entries: list[Entry]
    structures: list[Any]  # per shard: JSON skeleton of the saved object, tensors replaced by their keys
    files: dict[str, FileInfo]  # relative path -> size and CRC-32
    created: float  # unix seconds

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if len(self.structures) != self.num_shards:
            raise ValueError(f"{len(self.structures)} structures for {self.num_shards} shards")
        for path in self.files:
            if not is_inside(path):
                raise ValueError(f"file {path!r} is not a path inside the step directory")
        keys: list[set[str]] = [set() for _ in range(self.num_shards)]
        for e in self.entries:
            if e.part >= self.num_parts or e.shard >= self.num_shards:
                raise ValueError(f"{e.key}: part {e.part} or shard {e.shard} out of range")
            if e.key in keys[e.shard]:
                raise ValueError(f"{e.key}: stored twice in shard {e.shard}")
            keys[e.shard].add(e.key)
            info = self.files.get(e.file)
            if info is None or e.offset + e.length > info.size or e.length < e.nbytes:
                raise ValueError(f"{e.key}: bytes {e.offset}..{e.offset + e.length} are not inside {e.file!r}")
        for shard, skeleton in enumerate(self.structures):
            missing = set(structure.tensor_keys(skeleton)) - keys[shard]
            if missing:
                raise ValueError(f"shard {shard}'s skeleton names tensors it does not store: {sorted(missing)[:5]}")
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate a manifest; ValueError (never anything else) if it is not one of ours."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest of {len(text)} bytes")
        try:
            return cls.model_validate(json.loads(text))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"])) or "manifest"
            raise ValueError(f"malformed manifest: {where}: {first['msg']} ({e.error_count()} problems)") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, TypeError) as e:
            raise ValueError(f"malformed manifest: {type(e).__name__}: {e}") from None


def partition(sizes: Mapping[str, int], num_parts: int) -> dict[str, int]:
    """Assign each key to one of `num_parts` parts, largest first onto the lightest part.

    Deterministic for the same sizes and part count, so every replica computes the same
    split without talking to the others.
    """
    if num_parts < 1:
        raise ValueError("num_parts must be at least 1")
    load = [0] * num_parts
    out: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        k = min(range(num_parts), key=lambda i: (load[i], i))
        out[key] = k
        load[k] += max(1, sizes[key])
    return out


def to_delete(committed: Iterable[int], incomplete: Iterable[int], keep: int) -> list[int]:
    """Steps whose directories go: committed ones beyond the newest `keep`, and incomplete
    ones older than the newest committed step (a newer incomplete one may still be in flight)."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    done = sorted(set(committed), reverse=True)
    newest = done[0] if done else None
    old = done[keep:]
    stale = [s for s in set(incomplete) if newest is not None and s < newest and s not in done]
    return sorted(old + stale)
