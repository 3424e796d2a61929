"""Write one part of a checkpoint, and commit a step once every part is complete.

A part is written with torch.distributed.checkpoint's own writer (`FsspecWriter`,
`no_dist=True`: each replica writes its part alone, no collective), so the bytes on
storage are DCP's format and DCP reads them. Why DCP's format: users can open a Transom
checkpoint with the standard `dcp.load` (the step directory carries a merged `.metadata`),
and DCP already streams tensors to any fsspec file system. What Transom adds around it:
the split of the work between replicas, the checksums, and the commit.

Each writer ends its part with `checksums.json`: the part's entries (key, dtype, shape,
size, CRC-32) and, from a shard's first writer, the shard's JSON skeleton. The commit (by
part 0's writer) waits for every part's file, builds the manifest from them, merges the
parts' DCP metadata into the step's `.metadata` (each entry's file path prefixed with its
part directory), and writes `manifest.json` last. A writer killed at any point leaves no
manifest, and a directory without one is never read. A writer that skips a checkpoint
(busy with the previous one) leaves a `skipped` marker, so the committer gives up at once
instead of waiting out its timeout.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import pickle
import time
import warnings
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from transom.checkpoint import layout
from transom.checkpoint.storage import Storage

log = logging.getLogger("transom.checkpoint")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (zlib releases the GIL on large buffers)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    return zlib.crc32(memoryview(flat.view(torch.uint8).numpy()))


class DcpError(RuntimeError):
    """A failure inside torch.distributed.checkpoint, as an ordinary exception."""


def run_dcp(fn: Callable[[], object]) -> object:
    """Call DCP without its warnings, turning its CheckpointException into DcpError.

    DCP's CheckpointException derives from BaseException, so `except Exception` (the
    retry loop, the restore fallback) would let it through and kill the calling thread.
    DCP also warns that torch.distributed is not initialised: that is what no_dist asks for.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        try:
            return fn()
        except CheckpointException as e:
            raise DcpError(str(e).splitlines()[-1] if str(e) else "checkpoint failed") from e


def write_part(storage: Storage, step: int, part: int, tensors: Mapping[str, torch.Tensor],
               entries: list[layout.Entry], structure: object | None) -> list[layout.Entry]:
    """Write `tensors` as part `part` of `step`, then its done file: the part's entries with
    their checksums, and `structure` (the shard's skeleton, from the shard's first writer)."""
    directory = layout.part_dir(part)
    step_name = layout.step_dir(step)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="transom-crc") as pool:
        # Checksums of the host copy, computed while DCP writes it.
        futures = {k: pool.submit(crc32, t) for k, t in tensors.items()}
        if tensors:
            writer = FsspecWriter(storage.url(step_name, directory), sync_files=True)
            run_dcp(lambda: dcp.save(dict(tensors), storage_writer=writer, no_dist=True))
        done = [dataclasses.replace(e, crc32=futures[e.key].result()) for e in entries]
    record: dict = {"entries": [dataclasses.asdict(e) for e in done]}
    if structure is not None:
        record["structure"] = structure
    storage.write_atomic(json.dumps(record, sort_keys=True).encode(), step_name, directory, layout.PART_DONE)
    return done


def mark_skipped(storage: Storage, step: int, part: int) -> None:
    """Tell the committer of `step` that part `part` will not come (its writer was busy)."""
    storage.write_atomic(b"busy\n", layout.step_dir(step), layout.part_dir(part), layout.PART_SKIPPED)


def commit(storage: Storage, step: int, slot: layout.Slot, wait_s: float, stopped: Callable[[], bool],
           poll_s: float = 0.2) -> bool:
    """Merge the parts and write the manifest; False if some part did not finish in wait_s
    or its writer skipped this checkpoint."""
    step_name = layout.step_dir(step)
    deadline = time.monotonic() + wait_s
    for k in range(slot.num_parts):
        while not storage.exists(step_name, layout.part_dir(k), layout.PART_DONE):
            if storage.exists(step_name, layout.part_dir(k), layout.PART_SKIPPED):
                log.warning("step %d not committed: the writer of part %d skipped it", step, k)
                return False
            if time.monotonic() > deadline or stopped():
                return False
            time.sleep(poll_s)
    entries: list[layout.Entry] = []
    structures: list = [None] * slot.shards
    for k in range(slot.num_parts):
        record = json.loads(storage.read_text(step_name, layout.part_dir(k), layout.PART_DONE))
        entries += [layout.Entry(**e) for e in record["entries"]]
        if "structure" in record:
            structures[k // slot.writers] = record["structure"]
    if any(s is None for s in structures):
        raise RuntimeError(f"step {step}: a shard's structure is missing from its first part")
    parts_with_data = sorted({e.part for e in entries})
    merged = None
    state_dict_metadata: dict = {}
    storage_data: dict = {}
    for k in parts_with_data:
        meta = FsspecReader(storage.url(step_name, layout.part_dir(k))).read_metadata()
        state_dict_metadata.update(meta.state_dict_metadata)
        for index, info in (meta.storage_data or {}).items():
            storage_data[index] = dataclasses.replace(info, relative_path=f"{layout.part_dir(k)}/{info.relative_path}")
        merged = meta
    if merged is not None:
        merged = dataclasses.replace(merged, state_dict_metadata=state_dict_metadata, storage_data=storage_data,
                                     planner_data=None, storage_meta=None)
        buf = io.BytesIO()
        pickle.dump(merged, buf)
        storage.write_atomic(buf.getvalue(), step_name, layout.DCP_METADATA)
    manifest = layout.Manifest(step=step, num_parts=slot.num_parts, entries=entries, structures=structures,
                               created=time.time(), num_shards=slot.shards)
    manifest.files = storage.sizes(step_name)
    manifest.files.pop(layout.MANIFEST, None)
    storage.write_atomic(manifest.to_json().encode(), step_name, layout.MANIFEST)
    return True
