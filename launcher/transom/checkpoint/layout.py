"""Where a checkpoint's files go, what its manifest says, and which checkpoints to keep.

Pure (no torch, no I/O), so the rules are table-tested alone. One checkpoint of step N:

    <uri>/step-<N, 12 digits>/
        part-<k>/__0_0.distcp       part k's tensors (DCP's file format)
        part-<k>/.metadata          DCP's index of that part
        part-<k>/checksums.json     its entries with their CRC-32, written last by its writer
        part-<k>/skipped            instead of the above: its writer skipped this checkpoint
        .metadata                   DCP's index of the whole step (the parts merged)
        manifest.json               written last of all: the commit

Replicas hold identical state, so each shard's entries are split into parts balanced by
size (`partition`), and each writer writes one part (`Slot`). Only a step directory with a
readable `manifest.json` is a checkpoint; anything else is an attempt that did not finish
and is never read. Step numbers are zero-padded so that names sort by step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

MANIFEST = "manifest.json"
PART_DONE = "checksums.json"
PART_SKIPPED = "skipped"
DCP_METADATA = ".metadata"
FORMAT = "transom-dcp-2"
_STEP_DIR = re.compile(r"^step-(\d{12})$")


def step_dir(step: int) -> str:
    if not 0 <= step < 10**12:
        raise ValueError(f"step must be between 0 and 10^12 - 1, got {step}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def part_dir(k: int) -> str:
    return f"part-{k}"


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
    def of(cls, replica_rank: int, num_replicas: int, rank: int, world_size: int, sharded: bool) -> "Slot":
        """The slot of `rank` (of `world_size` in its replica) in replica `replica_rank` of the quorum."""
        if sharded:  # rank r of every replica holds shard r: the replicas split it
            return cls(writer=replica_rank, writers=num_replicas, shard=rank, shards=world_size)
        return cls(writer=replica_rank * world_size + rank, writers=num_replicas * world_size)


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint, as the manifest records it."""

    key: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: list[int]
    nbytes: int
    crc32: int
    part: int
    shard: int = 0


@dataclass
class Manifest:
    step: int
    num_parts: int
    entries: list[Entry]
    structures: list  # per shard: JSON skeleton of the saved object, tensors replaced by their keys
    created: float  # unix seconds
    num_shards: int = 1
    format: str = FORMAT
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        """Parse a manifest; ValueError (never anything else) if it is not one of ours."""
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"unknown checkpoint format {raw.get('format')!r}")
            entries = [Entry(**e) for e in raw["entries"]]
            m = cls(step=int(raw["step"]), num_parts=int(raw["num_parts"]), entries=entries,
                    structures=list(raw["structures"]), created=float(raw["created"]),
                    num_shards=int(raw["num_shards"]), format=raw["format"],
                    files={str(k): int(v) for k, v in raw.get("files", {}).items()})
            if len(m.structures) != m.num_shards:
                raise ValueError(f"{len(m.structures)} structures for {m.num_shards} shards")
            return m
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed manifest: {e}") from None


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
