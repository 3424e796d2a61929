"""Write one part of a checkpoint, and commit a step once every part is complete.

A part's tensors go into one file in DCP's format (`attempt-<a>/part-<k>/__0_0.distcp`):
each tensor is the blob `torch.save` writes (blob.py), one after another at 64-byte
boundaries, which is what DCP's own writer produces but for the padding, and DCP reads
by offset, so `dcp.load` reads a Transom checkpoint (dcp_index.py).
Writing it here rather than through `dcp.save` gives Transom what it checks on the way
back: every blob's offset and length, the file's size and CRC-32 (computed as it streams
out, no second read), and each tensor's CRC-32 (of the host copy, on a helper thread while
the file is written). It also needs nothing from DCP that older torch lacks.

Each writer ends its part with `checksums.json` (a `layout.PartRecord`: the attempt, its
entries and file, and from a shard's first writer the shard's JSON skeleton). The commit
(by part 0's writer) waits for every part of *its own attempt*, validates what the parts
say, writes DCP's index `.metadata`, and writes `manifest.json` last. A writer killed at any
point leaves no manifest, and a directory without one is never read. A writer that skips a
checkpoint (busy with the previous one) leaves a `skipped` marker in its attempt's part, so
the committer gives up at once instead of waiting out its timeout.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from transom.checkpoint import blob, dcp_index, layout
from transom.checkpoint.storage import Storage
from transom.errors import Diverged

BLOB_ALIGN = 64


class _Tally:
    """A write-only stream that counts and checksums what passes through to `sink`."""

    def __init__(self, sink):
        self.sink, self.size, self.crc32 = sink, 0, 0
        self.error: BaseException | None = None  # what the sink raised: torch.save reports it as a bad position

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            self.sink.write(view)
        except BaseException as e:
            self.error = e
            raise
        self.size += len(view)
        self.crc32 = zlib.crc32(view, self.crc32)
        return len(view)

    def flush(self) -> None:
        self.sink.flush()


def write_part(storage: Storage, step: int, attempt: str, part: int, tensors: Mapping[str, torch.Tensor],
               entries: list[layout.Entry], structure: object | None,
               state_digest: int | None = None) -> list[layout.Entry]:
    """Write `tensors` as part `part` of `attempt` at `step`, then its done file: the part's
    entries with their checksums and offsets, `structure` (the shard's skeleton, from the
    shard's first writer) and `state_digest` (the fingerprint of the state the writer
    holds). Returns the entries as recorded."""
    step_name, rel = layout.step_dir(step), layout.data_path(attempt, part)
    done: list[layout.Entry] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="transom-crc") as pool:
        # Checksums of the host copy, computed while the file is written.
        crcs = {e.key: pool.submit(blob.crc32, tensors[e.key]) for e in entries}
        with storage.open_write(step_name, rel) as f:
            out = _Tally(f)
            for e in entries:
                # Each blob starts at a multiple of 64 bytes (torch.save aligns its data to 64
                # within the blob), so a restore can use the tensors in the read buffer as
                # they are, without a copy; DCP reads by offset and does not mind the gaps.
                out.write(bytes(-out.size % BLOB_ALIGN))
                offset = out.size
                try:
                    blob.write(tensors[e.key], out)
                except RuntimeError:  # "unexpected pos": torch's word for a write that raised
                    if out.error is not None:
                        raise out.error from None
                    raise
                done.append(e.model_copy(update={"file": rel, "offset": offset, "length": out.size - offset}))
        done = [e.model_copy(update={"crc32": crcs[e.key].result()}) for e in done]
    record = layout.PartRecord(attempt=attempt, entries=done, files={rel: layout.FileInfo(size=out.size,
                               crc32=out.crc32)}, structure=structure, state_digest=state_digest)
    storage.write_atomic(record.model_dump_json().encode(), step_name, layout.attempt_dir(attempt),
                         layout.part_dir(part), layout.PART_DONE)
    return done


def mark_skipped(storage: Storage, step: int, attempt: str, part: int) -> None:
    """Tell the committer of `attempt` at `step` that part `part` will not come (its writer was busy)."""
    storage.write_atomic(b"busy\n", layout.step_dir(step), layout.attempt_dir(attempt), layout.part_dir(part),
                         layout.PART_SKIPPED)


def _same_state(step: int, digests: Mapping[int, Mapping[int, int]]) -> None:
    """Diverged unless every writer of each shard reported the same state digest."""
    for shard, by_part in sorted(digests.items()):
        if len(set(by_part.values())) > 1:
            raise Diverged(f"checkpoint of step {step} not committed: the replicas that wrote shard {shard} hold "
                           f"different parameters or optimizer state (state digests by part: {dict(by_part)})")


def commit(storage: Storage, step: int, attempt: str, slot: layout.Slot, wait_s: float,
           stopped: Callable[[], bool], poll_s: float = 0.2) -> bool:
    """Merge the parts of `attempt` and write the manifest; False if some part did not finish
    in wait_s or its writer skipped this checkpoint. ValueError if a part's record is not
    one a writer of this attempt could have written; Diverged if the writers of one shard
    held different states (the manifest is not written: no checkpoint mixes them)."""
    step_name, attempt_name = layout.step_dir(step), layout.attempt_dir(attempt)
    deadline = time.monotonic() + wait_s
    for k in range(slot.num_parts):
        while not storage.exists(step_name, attempt_name, layout.part_dir(k), layout.PART_DONE):
            if storage.exists(step_name, attempt_name, layout.part_dir(k), layout.PART_SKIPPED):
                return False
            if time.monotonic() > deadline or stopped():
                return False
            time.sleep(poll_s)
    entries: list[layout.Entry] = []
    files: dict[str, layout.FileInfo] = {}
    structures: list = [None] * slot.shards
    digests: dict[int, dict[int, int]] = {}  # shard -> part -> its writer's state digest
    for k in range(slot.num_parts):
        text = storage.read_text(step_name, attempt_name, layout.part_dir(k), layout.PART_DONE,
                                 limit=layout.MAX_MANIFEST_BYTES)
        record = layout.PartRecord.model_validate_json(text)
        if record.attempt != attempt or any(e.part != k for e in record.entries):
            raise ValueError(f"step {step}: part {k}'s record belongs to another attempt or part")
        entries += record.entries
        files.update(record.files)
        if record.structure is not None:
            structures[k // slot.writers] = record.structure
        if record.state_digest is not None:
            digests.setdefault(k // slot.writers, {})[k] = record.state_digest
    _same_state(step, digests)
    if any(s is None for s in structures):
        raise ValueError(f"step {step}: a shard's structure is missing from its first part")
    index = dcp_index.build(entries)
    storage.write_atomic(index, step_name, layout.DCP_METADATA)
    files[layout.DCP_METADATA] = layout.FileInfo(size=len(index), crc32=zlib.crc32(index))
    manifest = layout.Manifest(step=step, attempt=attempt, num_parts=slot.num_parts, num_shards=slot.shards,
                               entries=entries, structures=structures, files=files, created=time.time())
    storage.write_atomic(manifest.to_json().encode(), step_name, layout.MANIFEST)
    return True
