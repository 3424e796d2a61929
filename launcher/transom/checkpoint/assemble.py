"""Whole tensors from a sharded checkpoint: the ranks' local parts of each DTensor, joined.

An FSDP2 checkpoint stores shard r as rank r's state, each DTensor as its local part with
a description (`sharding.localize`: placements, global shape). Restoring gives each rank
its part back; exporting (export.py) needs the whole tensor instead. `merge` takes the
state of every shard, as `restore.load_step(..., rebuild=Part)` returns it, and walks them
side by side: a DTensor's parts are concatenated along its sharded dimension, everything
else must be the same on every rank and is taken once.

Only what FSDP2 over the ranks of a replica makes is joined: a one-dimensional device
mesh, placed `Shard(d)` (parts cut the way `torch.chunk` cuts, the later ranks' possibly
empty) or `Replicate()`. A layout the checkpoint does not describe fully (a mesh of two or
more dimensions: which rank holds which coordinate is not stored) is refused with
`IncompatibleCheckpoint`, and so is state that differs between ranks where it should not;
each part's size is checked against the cut its rank must hold, so parts never join into
a tensor of the right size by accident.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from transom.errors import CorruptCheckpoint, IncompatibleCheckpoint


@dataclass(frozen=True)
class Part:
    """One rank's local part of a sharded tensor and its description, as stored. Passed as
    `rebuild` to `restore.load_step`, it keeps the two together instead of making a DTensor."""

    local: torch.Tensor
    meta: dict


def merge(shards: Sequence[Any], path: str = "") -> Any:
    """The state of `shards` (one per rank, in rank order) as one state of whole tensors."""
    first = shards[0]
    where = path or "<root>"
    if isinstance(first, Part):
        if not all(isinstance(s, Part) and s.meta == first.meta for s in shards):
            raise IncompatibleCheckpoint(f"{where}: sharded on some ranks and not on others, or described differently")
        return join([s.local for s in shards], first.meta, where)
    if isinstance(first, torch.Tensor):
        if not all(isinstance(s, torch.Tensor) and _equal(first, s) for s in shards):
            raise IncompatibleCheckpoint(f"{where}: an unsharded tensor that differs between ranks; "
                                         "it has no single value to export")
        return first
    if isinstance(first, dict):
        if not all(isinstance(s, dict) and list(s) == list(first) for s in shards):
            raise IncompatibleCheckpoint(f"{where}: the ranks' states have different keys")
        return {k: merge([s[k] for s in shards], f"{path}/{k}" if path else str(k)) for k in first}
    if isinstance(first, (list, tuple)):
        if not all(type(s) is type(first) and len(s) == len(first) for s in shards):
            raise IncompatibleCheckpoint(f"{where}: the ranks' states differ in length")
        items = [merge([s[i] for s in shards], f"{path}/{i}" if path else str(i)) for i in range(len(first))]
        return tuple(items) if isinstance(first, tuple) else items
    if not all(_same_value(first, s) for s in shards):
        raise IncompatibleCheckpoint(f"{where}: differs between ranks ({first!r} on rank 0)")
    return first


def join(parts: list[torch.Tensor], meta: Any, where: str) -> torch.Tensor:
    """The whole tensor whose rank-ordered local parts are `parts`, placed as `meta` says."""
    placements, shape = _described(meta, where)
    if len(placements) != 1:
        raise IncompatibleCheckpoint(
            f"{where}: sharded over a {len(placements)}-dimensional device mesh; export joins only a "
            "one-dimensional mesh (FSDP2 over the ranks of a replica): which rank holds which part is not stored")
    if any(p.dtype != parts[0].dtype for p in parts):
        raise CorruptCheckpoint(f"{where}: the ranks' parts have different dtypes")
    placement = placements[0]
    if placement == ["replicate"]:
        if list(parts[0].shape) != shape or not all(_equal(parts[0], p) for p in parts):
            raise IncompatibleCheckpoint(f"{where}: replicated, but the ranks hold different values")
        return parts[0]
    dim = placement[1]
    if not 0 <= dim < len(shape):
        raise CorruptCheckpoint(f"{where}: sharded along dimension {dim} of a {len(shape)}-dimensional tensor")
    for rank, part in enumerate(parts):
        expected = [*shape[:dim], chunk_length(shape[dim], len(parts), rank), *shape[dim + 1:]]
        if list(part.shape) != expected:
            raise IncompatibleCheckpoint(
                f"{where}: rank {rank} holds a part of shape {list(part.shape)}, not the {expected} that "
                f"Shard({dim}) of {shape} over {len(parts)} ranks gives it (a mesh other than the replica's ranks?)")
    return torch.cat(parts, dim)


def chunk_length(n: int, ranks: int, rank: int) -> int:
    """How much of a dimension of `n` rank `rank` of `ranks` holds: `torch.chunk`'s cut,
    which DTensor's `Shard` and FSDP2 use (ceil(n / ranks) each, the rest to the last, none after)."""
    size = math.ceil(n / ranks)
    return max(0, min(size, n - rank * size))


def _described(meta: Any, where: str) -> tuple[list, list[int]]:
    """(placements, global shape) of a stored description; CorruptCheckpoint if it is not one
    `sharding.localize` writes (it came from storage: data to check)."""
    placements: Any = meta.get("placements") if isinstance(meta, dict) else None
    shape: Any = meta.get("shape") if isinstance(meta, dict) else None
    valid = (isinstance(placements, list) and placements
             and all(p == ["replicate"] or (isinstance(p, list) and len(p) == 2 and p[0] == "shard"
                                            and _is_int(p[1])) for p in placements)
             and isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape))
    if not valid:
        raise CorruptCheckpoint(f"{where}: malformed description of a sharded tensor: {str(meta)[:200]}")
    return placements, shape


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaNs included: equal bits are the same value here)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.numel():
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b
