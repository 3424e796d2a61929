"""One committed checkpoint as a plain PyTorch file that `torch.load(path, weights_only=True)` reads.

Tools outside Transom (nanoGPT's `sample.py`, an evaluation harness) read a state dict with
`torch.load`. `export` writes the model's state dict of one committed step as a plain
`dict[str, torch.Tensor]` of whole CPU tensors, or with `include_optimizer`
`{"model": ..., "optimizer": ..., "step": N}`; nothing else is in the file (no RNG, sampler
or scaler state, no classes), so the file loads with `weights_only=True`.

The step is read as a restore reads it (restore.load_step): the manifest validated, every
data file's size and CRC-32 checked before it is parsed, no pickle from storage ever
loaded. A sharded checkpoint (FSDP2) is read shard by shard and joined into whole tensors
(assemble.py). The names are the keys the training script's `model.state_dict()` had:
what Transom added to store them (the `model/` key, a `shard-<r>/` prefix) is gone, what
the script's own wrappers added (DDP's `module.`, torch.compile's `_orig_mod.`) is kept,
since that is what the script saved; `strip_prefixes` removes such a prefix on request.

The file appears whole or not at all: it is written to a temporary file beside the
destination and renamed over it once complete, and the temporary file is created before
anything is read, so an unwritable destination fails at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from transom.checkpoint import assemble
from transom.checkpoint.restore import committed_steps, load_step, read_manifest
from transom.checkpoint.storage import Storage
from transom.errors import CorruptCheckpoint, IncompatibleCheckpoint, NoCheckpoint

log = logging.getLogger("transom.checkpoint")


def export(uri: str, step: int | None, dest: str | os.PathLike, include_optimizer: bool = False,
           strip_prefixes: Sequence[str] = (), **storage_options) -> tuple[int, dict]:
    """Write checkpoint `step` (None: the newest committed one) under `uri` to `dest`;
    (the step, the object written). Raises a CheckpointError (NoCheckpoint: no such step;
    CorruptCheckpoint: bytes that do not match the manifest; IncompatibleCheckpoint: no model
    state, or shards that cannot be joined; StorageStalled) or OSError (the destination, or
    storage that cannot be listed); `dest` is then untouched."""
    with destination(Path(dest)) as f:
        storage = Storage(uri, **storage_options)
        step = choose_step(storage, step)
        # Each rank's share is cut down to what the file holds before the ranks are joined:
        # the rest (each rank's own RNG state) need not, and does not, agree between them.
        merged = assemble.merge([select(s, step, include_optimizer) for s in read_shards(storage, step)])
        merged["model"] = strip(merged["model"], strip_prefixes)
        obj = plain(merged if include_optimizer else merged["model"])
        torch.save(obj, f)
    return step, obj


def choose_step(storage: Storage, step: int | None) -> int:
    """`step` if it is committed under `storage` (None: the newest committed step); NoCheckpoint if not."""
    committed, _ = committed_steps(storage)
    if not committed:
        raise NoCheckpoint(f"no committed checkpoint under {storage.uri}")
    if step is None:
        return committed[0]
    if step not in committed:
        shown = ", ".join(map(str, committed[:10])) + (", ..." if len(committed) > 10 else "")
        raise NoCheckpoint(f"no committed checkpoint of step {step} under {storage.uri} (committed: {shown})")
    return step


def read_shards(storage: Storage, step: int) -> list[Any]:
    """The object saved at `step` by each shard (one, unless FSDP2 sharded it), verified as a
    restore verifies it, each sharded tensor as its rank's `assemble.Part`."""
    try:
        num_shards = read_manifest(storage, step).num_shards
        return [load_step(storage, step, shard=r, num_shards=num_shards, rebuild=assemble.Part)
                for r in range(num_shards)]
    except CorruptCheckpoint as e:  # its message names a file or a key; say which checkpoint
        raise CorruptCheckpoint(f"checkpoint step {step} under {storage.uri} does not verify: {e}") from None


def select(state: Any, step: int, include_optimizer: bool) -> dict:
    """What of a saved state goes into the file: {"model": ...}, with `include_optimizer`
    also {"optimizer": ..., "step": step}."""
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        raise IncompatibleCheckpoint(f"the checkpoint of step {step} holds no model state dict (no 'model' entry)")
    if not include_optimizer:
        return {"model": model}
    if not isinstance(state.get("optimizer"), dict):
        raise IncompatibleCheckpoint(f"the checkpoint of step {step} holds no optimizer state dict")
    return {"model": model, "optimizer": state["optimizer"], "step": step}


def strip(model: dict, prefixes: Sequence[str]) -> dict:
    """`model` with each of `prefixes` taken off the front of the keys that start with it, in
    order (so `_orig_mod.` then `module.` undoes torch.compile of a DDP module)."""
    out: dict = {}
    for key, value in model.items():
        name = key
        for prefix in prefixes:
            if isinstance(name, str) and name.startswith(prefix):
                name = name[len(prefix):]
        if name in out:
            raise IncompatibleCheckpoint(f"stripping {', '.join(map(repr, prefixes))} names two entries {name!r}")
        out[name] = value
    for prefix in prefixes:
        if not any(isinstance(k, str) and k.startswith(prefix) for k in model):
            log.warning("no name in the model's state dict starts with %r; nothing stripped for it", prefix)
    return out


def plain(obj: Any) -> Any:
    """`obj` with each tensor in memory of its own: a restored tensor may be a view of the
    whole data file it was read from, and `torch.save` writes a view's entire storage."""
    if isinstance(obj, torch.Tensor):
        whole = obj.is_contiguous() and obj.storage_offset() == 0 \
            and obj.untyped_storage().nbytes() == obj.numel() * obj.element_size()
        return obj if whole else obj.clone(memory_format=torch.contiguous_format)
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [plain(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


@contextlib.contextmanager
def destination(dest: Path) -> Iterator[IO[bytes]]:
    """A file to write `dest` through: a temporary file beside it, renamed to `dest` when the
    block completes and removed if it raises. OSError at once if `dest` cannot be written."""
    if dest.is_dir():
        raise IsADirectoryError(f"cannot write {dest}: it is a directory")
    directory = dest.parent  # Path(".") for a bare name
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {dest}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes it 0600; give it the mode open() would
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)  # so that the rename, too, survives a crash


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it
    os.umask(mask)
    return mask
