"""Where a checkpoint's files go, what its manifest says, and which checkpoints to keep.

Pure (no torch, no I/O), so the rules are table-tested alone. One checkpoint of step N:

    <uri>/step-<N, 12 digits>/
        part-<k>/__0_0.distcp       shard k's tensors, written by replica k (DCP's file format)
        part-<k>/.metadata          DCP's index of that part
        part-<k>/checksums.json     written last by its writer: the part is complete
        .metadata                   DCP's index of the whole step (the parts merged)
        manifest.json               written last of all: the commit

Replicas hold identical state, so the entries are split into `num_parts` shards balanced
by size (`partition`), and replica k of the quorum writes part k. Only a step directory
with a readable `manifest.json` is a checkpoint; anything else is an attempt that did not
finish and is never read. Step numbers are zero-padded so that names sort by step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

MANIFEST = "manifest.json"
PART_DONE = "checksums.json"
DCP_METADATA = ".metadata"
FORMAT = "transom-dcp-1"
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


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint, as the manifest records it."""

    key: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: list[int]
    nbytes: int
    crc32: int
    part: int


@dataclass
class Manifest:
    step: int
    num_parts: int
    entries: list[Entry]
    structure: dict  # JSON skeleton of the saved object, tensors replaced by their keys
    created: float  # unix seconds
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
            return cls(step=int(raw["step"]), num_parts=int(raw["num_parts"]), entries=entries,
                       structure=raw["structure"], created=float(raw["created"]), format=raw["format"],
                       files={str(k): int(v) for k, v in raw.get("files", {}).items()})
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
