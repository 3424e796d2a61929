"""Read back the newest complete checkpoint, verified, falling back to older ones.

Storage is not trusted to run code, and not trusted to be intact. So a restore reads the
manifest (JSON, validated as data by `layout.Manifest`), then for each data file it needs
checks the file's size on storage and reads it whole (the file's CRC-32 computed as its
ranges arrive), checks the CRC-32, and only then cuts the tensors out of it (blob.py: the
raw bytes of each `torch.save` blob, never its pickle) without copying them: the file's
CRC-32 covers every byte of every tensor, so the tensors' own CRC-32s (which the write
computed for DCP's readers and for the peer transfer) are not computed again.
DCP's `.metadata` pickle is never read.
A checkpoint that fails any check, or cannot be read at all for any reason, is skipped with
a warning and the one before it is tried. The number of replicas does not matter: every
checkpoint holds the whole state. A sharded checkpoint (FSDP2, one shard per rank of a
replica) loads only into a replica with as many ranks, each rank reading its own shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from transom.checkpoint import blob, layout, structure
from transom.checkpoint.storage import Storage, retry
from transom.errors import CorruptCheckpoint, IncompatibleCheckpoint, NoCheckpoint  # noqa: F401  (the family lives in errors.py)

log = logging.getLogger("transom.checkpoint")

# A manifest that storage fails to return (not one that is missing) is asked for again for
# this long before its checkpoint counts as unusable: S3 answers 500 for a moment after it
# comes back, and an older checkpoint taken for that would throw the newest one's steps away.
MANIFEST_READ_PATIENCE_S = 10.0


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


def read_manifest(storage: Storage, step: int, patience_s: float = MANIFEST_READ_PATIENCE_S) -> layout.Manifest:
    name = layout.step_dir(step)
    try:
        manifest = layout.Manifest.from_json(_manifest_text(storage, name, patience_s))
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"unreadable manifest: {e}") from None
    if manifest.step != step:
        raise CorruptCheckpoint(f"the manifest of {name} is the manifest of step {manifest.step}")
    return manifest


def _manifest_text(storage: Storage, name: str, patience_s: float) -> str:
    """The manifest's text; a storage error other than its absence is retried for `patience_s`."""
    deadline = time.monotonic() + patience_s
    return retry(f"reading the manifest of {name}",
                 lambda: storage.read_text(name, layout.MANIFEST, limit=layout.MAX_MANIFEST_BYTES),
                 stopped=lambda: time.monotonic() > deadline, first_s=0.25, max_s=2.0,
                 permanent=(FileNotFoundError, PermissionError, IsADirectoryError))


def load_step(storage: Storage, step: int, device: str | torch.device = "cpu", shard: int = 0, num_shards: int = 1,
              rebuild: Callable[[torch.Tensor, dict], Any] | None = None) -> Any:
    """Load and verify shard `shard` of `num_shards` of one checkpoint (an unsharded one
    loads whole for any shard); CorruptCheckpoint says why it is unusable."""
    manifest = read_manifest(storage, step)
    if manifest.num_shards != 1 and manifest.num_shards != num_shards:
        raise IncompatibleCheckpoint(
            f"checkpoint step {step} is sharded over {manifest.num_shards} ranks per replica and this replica "
            f"has {num_shards}; restore it with the same number of processes per replica")
    mine = shard if manifest.num_shards > 1 else 0
    by_file: dict[str, list[layout.Entry]] = {}
    for e in manifest.entries:
        if e.shard == mine:
            by_file.setdefault(e.file, []).append(e)
    tensors: dict[str, torch.Tensor] = {}
    files = _verified_files(storage, step, {path: manifest.files[path] for path in by_file})
    for path, entries in sorted(by_file.items()):
        data = files.pop(path)
        for e in entries:
            try:  # a view of the verified file's bytes (it stays alive as long as the tensor)
                tensors[e.key] = blob.decode(memoryview(data)[e.offset:e.offset + e.length], e.dtype, e.shape,
                                             copy=False)
            except blob.BlobError as err:
                raise CorruptCheckpoint(f"{e.key}: {err}") from None
        del data
    if str(device) != "cpu":
        tensors = {k: t.to(device) for k, t in tensors.items()}
    return structure.unflatten(manifest.structures[mine], tensors, rebuild)


def _verified_files(storage: Storage, step: int, infos: dict[str, layout.FileInfo]) -> dict[str, memoryview]:
    """Data files' bytes, read in parallel, once each one's size and CRC-32 match the
    manifest; CorruptCheckpoint if not."""
    name = layout.step_dir(step)
    try:
        for path, info in infos.items():  # before reading: a manifest cannot make us read more than exists
            size = storage.size(name, path)
            if size != info.size:
                raise CorruptCheckpoint(f"{path}: {size} bytes on storage, manifest says {info.size}")
        data = storage.read_files({f"{name}/{path}": info.size for path, info in infos.items()})
    except (OSError, ValueError) as e:
        if isinstance(e, CorruptCheckpoint):
            raise
        raise CorruptCheckpoint(f"{type(e).__name__}: {e}") from None
    out = {}
    for path, info in infos.items():
        out[path], crc = data.pop(f"{name}/{path}")
        if crc != info.crc32:
            raise CorruptCheckpoint(f"{path}: CRC-32 differs from the manifest's")
    return out


def load_newest(storage: Storage, steps: list[int], device: str | torch.device = "cpu", shard: int = 0,
                num_shards: int = 1, rebuild: Callable[[torch.Tensor, dict], Any] | None = None,
                agree: Callable[[bool], bool] = lambda ok: ok, use: Callable[[Any], None] | None = None) -> Restored:
    """The first of `steps` (newest first) that verifies (and that `use` takes); NoCheckpoint
    if none does.

    Any failure while reading or using a checkpoint makes it a bad one, never an exception
    here (only IncompatibleCheckpoint, a setup error, propagates). `agree` makes the ranks
    of a replica take the same step: it gets whether this rank's shard verified and returns
    whether every rank's did, so one rank's failure cannot leave the others waiting.
    """
    skipped: list[tuple[int, str]] = []
    for step in steps:
        state, why = None, "it failed on another rank"
        try:
            state = load_step(storage, step, device, shard, num_shards, rebuild)
            if use is not None:
                use(state)
        except IncompatibleCheckpoint:
            raise
        except Exception as e:  # noqa: BLE001 - whatever storage holds, it is just a bad checkpoint
            state, why = None, str(e) if isinstance(e, CorruptCheckpoint) else f"{type(e).__name__}: {e}"
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
