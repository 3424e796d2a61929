"""Write one part of a checkpoint, and commit a step once every part is complete.

A part is written with torch.distributed.checkpoint's own writer (`FsspecWriter`,
`no_dist=True`: each replica writes its part alone, no collective), so the bytes on
storage are DCP's format and DCP reads them. Why DCP's format: users can open a Transom
checkpoint with the standard `dcp.load` (the step directory carries a merged `.metadata`),
and DCP already streams tensors to any fsspec file system. What Transom adds around it:
the split of the work between replicas, the checksums, and the commit.

The commit (by part 0's writer) waits for every part's `checksums.json`, merges the
parts' DCP metadata into the step's `.metadata` (each entry's file path prefixed with its
part directory), and writes `manifest.json` last. A writer killed at any point leaves no
manifest, and a directory without one is never read.
"""

from __future__ import annotations

import dataclasses
import io
import json
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


def write_part(storage: Storage, step: int, part: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Write `tensors` as part `part` of `step`; returns their checksums (also stored)."""
    directory = layout.part_dir(part)
    step_name = layout.step_dir(step)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="transom-crc") as pool:
        # Checksums of the host copy, computed while DCP writes it.
        futures = {k: pool.submit(crc32, t) for k, t in tensors.items()}
        if tensors:
            writer = FsspecWriter(storage.url(step_name, directory), sync_files=True)
            run_dcp(lambda: dcp.save(dict(tensors), storage_writer=writer, no_dist=True))
        checksums = {k: f.result() for k, f in futures.items()}
    storage.write_atomic(json.dumps(checksums, sort_keys=True).encode(), step_name, directory, layout.PART_DONE)
    return checksums


def commit(storage: Storage, manifest: layout.Manifest, wait_s: float, stopped: Callable[[], bool],
           poll_s: float = 0.2) -> bool:
    """Merge the parts and write the manifest; False if some part did not finish in wait_s."""
    step_name = layout.step_dir(manifest.step)
    deadline = time.monotonic() + wait_s
    parts_with_data = sorted({e.part for e in manifest.entries})
    for k in range(manifest.num_parts):
        while not storage.exists(step_name, layout.part_dir(k), layout.PART_DONE):
            if time.monotonic() > deadline or stopped():
                return False
            time.sleep(poll_s)
    checksums: dict[str, int] = {}
    for k in range(manifest.num_parts):
        checksums.update(json.loads(storage.read_text(step_name, layout.part_dir(k), layout.PART_DONE)))
    missing = [e.key for e in manifest.entries if e.key not in checksums]
    if missing:
        raise RuntimeError(f"the parts of step {manifest.step} lack {len(missing)} entries, e.g. {missing[0]}")
    # Each writer checksummed its own share; the manifest carries them all.
    manifest.entries = [dataclasses.replace(e, crc32=checksums[e.key]) for e in manifest.entries]
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
    manifest.files = storage.sizes(step_name)
    manifest.files.pop(layout.MANIFEST, None)
    storage.write_atomic(manifest.to_json().encode(), step_name, layout.MANIFEST)
    return True
