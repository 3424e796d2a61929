"""Read back the newest complete checkpoint, verified, falling back to older ones.

A checkpoint is a step directory with a manifest. Before loading, every file the manifest
lists must exist with its recorded size (a truncated upload fails here, cheaply); after
loading, every tensor's CRC-32 must match. A checkpoint that fails either check, or
cannot be read at all, is skipped with a warning and the one before it is tried. The number
of replicas does not matter: every checkpoint holds the whole state. A sharded checkpoint
(FSDP2, one shard per rank of a replica) loads only into a replica with as many ranks, each
rank reading its own shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FsspecReader

from transom.checkpoint import layout, structure
from transom.checkpoint.persist import crc32, run_dcp
from transom.checkpoint.storage import Storage

log = logging.getLogger("transom.checkpoint")


class NoCheckpoint(LookupError):
    """No complete, valid checkpoint exists under the URI."""


class CorruptCheckpoint(ValueError):
    pass


class IncompatibleCheckpoint(ValueError):
    """The checkpoint is sound but sharded for a different number of ranks."""


@dataclass
class Restored:
    step: int
    state: Any  # the object that was saved
    uri: str  # the step directory it came from
    skipped: list[tuple[int, str]]  # newer checkpoints that failed verification: (step, why)


def committed_steps(storage: Storage) -> tuple[list[int], list[int]]:
    """(steps with a manifest, newest first; steps without one)."""
    steps = [s for s in (layout.parse_step_dir(n) for n in storage.list_dirs()) if s is not None]
    done = [s for s in steps if storage.exists(layout.step_dir(s), layout.MANIFEST)]
    return sorted(done, reverse=True), sorted(set(steps) - set(done))


def load_step(storage: Storage, step: int, device: str | torch.device = "cpu", shard: int = 0, num_shards: int = 1,
              rebuild: Callable[[torch.Tensor, dict], Any] | None = None) -> Any:
    """Load and verify shard `shard` of `num_shards` of one checkpoint (an unsharded one
    loads whole for any shard); CorruptCheckpoint says why it is unusable."""
    name = layout.step_dir(step)
    try:
        manifest = layout.Manifest.from_json(storage.read_text(name, layout.MANIFEST))
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"unreadable manifest: {e}") from None
    if manifest.num_shards != 1 and manifest.num_shards != num_shards:
        raise IncompatibleCheckpoint(
            f"checkpoint step {step} is sharded over {manifest.num_shards} ranks per replica and this replica "
            f"has {num_shards}; restore it with the same number of processes per replica")
    mine = shard if manifest.num_shards > 1 else 0
    entries = [e for e in manifest.entries if e.shard == mine]
    sizes = storage.sizes(name)
    for path, size in manifest.files.items():
        if sizes.get(path) != size:
            raise CorruptCheckpoint(f"{path}: {sizes.get(path, 'missing')} bytes on storage, manifest says {size}")
    tensors = {e.key: torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in entries}
    if tensors:
        try:
            run_dcp(lambda: dcp.load(tensors, storage_reader=FsspecReader(storage.url(name)), no_dist=True))
        except Exception as e:  # a corrupt shard fails inside torch's deserialisation
            raise CorruptCheckpoint(f"DCP could not read it: {type(e).__name__}: {e}") from None
    for e in entries:
        got = crc32(tensors[e.key])
        if got != e.crc32:
            raise CorruptCheckpoint(f"checksum mismatch for {e.key} (part {e.part}): {got} != {e.crc32}")
    if str(device) != "cpu":
        tensors = {k: t.to(device) for k, t in tensors.items()}
    return structure.unflatten(manifest.structures[mine], tensors, rebuild)


def load_newest(storage: Storage, steps: list[int], device: str | torch.device = "cpu", shard: int = 0,
                num_shards: int = 1, rebuild: Callable[[torch.Tensor, dict], Any] | None = None,
                agree: Callable[[bool], bool] = lambda ok: ok) -> Restored:
    """The first of `steps` (newest first) that verifies; NoCheckpoint if none does.

    `agree` makes the ranks of a replica take the same step: it gets whether this rank's
    shard verified and returns whether every rank's did.
    """
    skipped: list[tuple[int, str]] = []
    for step in steps:
        state, why = None, "it failed on another rank"
        try:
            state = load_step(storage, step, device, shard, num_shards, rebuild)
        except CorruptCheckpoint as e:
            why = str(e)
        if not agree(state is not None):
            log.warning("checkpoint step %d under %s is unusable (%s); trying an older one", step, storage.uri, why)
            skipped.append((step, why))
            continue
        return Restored(step=step, state=state, uri=storage.url(layout.step_dir(step)), skipped=skipped)
    raise NoCheckpoint(f"no complete checkpoint under {storage.uri}"
                       + (f" ({len(skipped)} failed verification)" if skipped else ""))


def load_latest(uri: str, device: str | torch.device = "cpu", **storage_options) -> Restored:
    """The newest (unsharded) checkpoint that verifies; NoCheckpoint if there is none."""
    storage = Storage(uri, **storage_options)
    return load_newest(storage, committed_steps(storage)[0], device)
