"""A committed snapshot as chunks with checksums: what a source serves and how a joiner fetches it.

A source replica keeps one snapshot of its state (host copies of its tensors, made in the
background, ft/catchup.py) while some replica is catching up. It serves it as

    GET /snapshot                      the manifest (JSON): step, tensors, skeleton, chunk digests
    GET /snapshot/<step>/chunk/<i>     bytes [i*chunk_bytes, (i+1)*chunk_bytes) of the tensors' raw
                                       bytes laid back to back; 404 once that step is replaced

Every tensor travels as its raw bytes (no container, nothing a receiver would execute); the
manifest says where each one lies, its dtype and shape, and the CRC32C of every chunk
(`checksum`: the algorithm's name, refused if unknown). The
replicas are bit-identical, so every source of one step serves the same bytes under the
same digests: the joiner fetches chunks from all of them in parallel, checks each against
the manifest, and when a source dies or serves a bad chunk it takes the remaining chunks
from the others (`fetch`). A snapshot replaced mid-transfer restarts the fetch on the new
one (`SnapshotChanged`). Which snapshot a joiner fetches, and from whom, ft/sources.py
decides: a manifest is checked against the joiner's own state and served by a majority.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import google_crc32c
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from transom.checkpoint import blob, structure
from transom.checkpoint.tensor_entry import TensorEntry
from transom.errors import SnapshotChanged, WireError

log = logging.getLogger("transom.ft")
CHUNK_BYTES = 4 << 20
MAX_MANIFEST_BYTES = 256 << 20
MAX_CHUNKS = 1 << 20
ALIGN = 64  # every tensor starts at a multiple: a tensor made over the received bytes is aligned
# The chunks' checksum, named in the manifest. CRC32C (Castagnoli) has a CPU instruction
# (SSE4.2, ARMv8): google_crc32c computes it at about 3x zlib.crc32's speed here, and that
# is CPU the sources and the joiner spend on every byte (benchmarks/catchup_bill.py). The
# stored checkpoints keep their CRC-32 (checkpoint/blob.py): this is the transient wire only.
CHECKSUM: Final = "crc32c"
DIGEST_SLICE = 1 << 20  # about 0.1 ms of google_crc32c under the GIL on the development box


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def digest(pieces: Sequence[memoryview], crc: int = 0) -> int:
    """The CRC32C of the pieces laid back to back, read where they lie. google_crc32c takes
    only buffers that need no release (not a memoryview): an ndarray over the view is one,
    and copies nothing. It holds the GIL while it runs, so it is fed DIGEST_SLICE bytes at a
    time: a large `recovery_chunk_bytes` must not keep the training thread out for long."""
    for piece in pieces:
        array = np.frombuffer(piece, np.uint8)
        for lo in range(0, len(array), DIGEST_SLICE):
            crc = google_crc32c.extend(crc, array[lo:lo + DIGEST_SLICE])
    return crc


class _Entry(TensorEntry):
    """A tensor of the snapshot: where it starts in the served bytes (they lie back to back)."""

    offset: int = Field(ge=0)


class SnapshotManifest(BaseModel):
    """What a joiner learns before it fetches a byte; checked before anything is allocated."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    step: int = Field(ge=0)
    chunk_bytes: int = Field(ge=1, le=1 << 30)
    total_bytes: int = Field(ge=0, le=1 << 44)
    entries: list[_Entry]
    skeleton: Any
    checksum: Literal["crc32c"]  # the digests' algorithm (CHECKSUM); another one is refused
    digests: list[int] = Field(max_length=MAX_CHUNKS)  # the CRC32C of each chunk

    @model_validator(mode="after")
    def _consistent(self) -> SnapshotManifest:
        end = 0
        for e in self.entries:
            if e.offset != _aligned(end):
                raise ValueError(f"{e.key}: offset {e.offset}, expected {_aligned(end)} (tensors lie back to back)")
            end = e.offset + e.size
        if end != self.total_bytes:
            raise ValueError(f"the tensors hold {end} bytes, the manifest says {self.total_bytes}")
        if len(self.digests) != -(-self.total_bytes // self.chunk_bytes):
            raise ValueError(f"{len(self.digests)} digests for {self.total_bytes} bytes "
                             f"in chunks of {self.chunk_bytes}")
        keys = [e.key for e in self.entries]
        if len(set(keys)) != len(keys) or not set(structure.tensor_keys(self.skeleton)) <= set(keys):
            raise ValueError("the entries and the skeleton disagree about the tensors")
        return self

    def chunk_range(self, i: int) -> tuple[int, int]:
        start = i * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)


@dataclass
class Published:
    """A snapshot as a source serves it: the manifest and the tensors' bytes (views, no copy)."""

    manifest: SnapshotManifest
    manifest_json: bytes
    views: list[memoryview] = field(repr=False)

    def chunk(self, i: int) -> list[memoryview]:
        """The pieces of chunk `i`, in order: slices of the tensors' own memory, and zeros for
        the alignment padding between them."""
        start, end = self.manifest.chunk_range(i)
        pieces, at = [], start
        for e, view in zip(self.manifest.entries, self.views):
            lo, hi = max(start, e.offset), min(end, e.offset + len(view))
            if lo < hi:
                if lo > at:
                    pieces.append(memoryview(bytes(lo - at)))
                pieces.append(view[lo - e.offset:hi - e.offset])
                at = hi
        if at < end:  # the chunk ends inside the padding before the next tensor
            pieces.append(memoryview(bytes(end - at)))
        return pieces


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")  # ndarray.data: the array's own buffer


def publish(step: int, tensors: dict[str, torch.Tensor], skeleton: Any, chunk_bytes: int = CHUNK_BYTES) -> Published:
    """Host tensors (that nobody changes until the snapshot is dropped) and the skeleton that
    places them (checkpoint/structure.py), ready to serve.

    The CRC32Cs are the only pass over the bytes, read where they lie (`digest`)."""
    entries: list[dict[str, Any]] = []  # the manifest's, as it goes out
    placed: list[_Entry] = []  # the same, for the draft
    views: list[memoryview] = []
    offset = 0
    for key, t in tensors.items():
        if t.is_cuda or not t.is_contiguous():
            raise ValueError(f"{key}: a published tensor must be a contiguous host copy")
        offset = _aligned(offset)
        view = _raw(t)
        dtype, shape_of = blob.dtype_name(t.dtype), list(t.shape)
        entries.append({"key": key, "dtype": dtype, "shape": shape_of, "offset": offset})
        placed.append(_Entry.model_construct(key=key, dtype=dtype, shape=shape_of, offset=offset))
        views.append(view)
        offset += len(view)
    # A draft, unvalidated, to cut the chunks whose CRC32Cs the digests are: the manifest below is validated.
    shape = SnapshotManifest.model_construct(step=step, chunk_bytes=chunk_bytes, total_bytes=offset, entries=placed,
                                     skeleton=skeleton, checksum=CHECKSUM, digests=[])
    draft = Published(shape, b"", views)
    digests = [digest(draft.chunk(i)) for i in range(-(-offset // chunk_bytes))]
    body = {"step": step, "chunk_bytes": chunk_bytes, "total_bytes": offset, "entries": entries,
            "skeleton": skeleton, "checksum": CHECKSUM, "digests": digests}
    manifest = SnapshotManifest.model_validate(body)
    return Published(manifest, json.dumps(body, separators=(",", ":")).encode(), views)


def parse_manifest(data: bytes) -> SnapshotManifest:
    if len(data) > MAX_MANIFEST_BYTES:
        raise WireError(f"a manifest of {len(data)} bytes is too large")
    try:
        return SnapshotManifest.model_validate(json.loads(data))
    except ValidationError as e:
        raise WireError(f"bad manifest: {e.errors()[0]['msg']}") from None
    except (ValueError, RecursionError, blob.BlobError) as e:
        raise WireError(f"bad manifest: {e}") from None


def assemble(manifest: SnapshotManifest, data: bytearray | memoryview, device: torch.device | str = "cpu",
             rebuild: Callable[[torch.Tensor, dict], Any] | None = None) -> Any:
    """The state the manifest describes, its tensors made from `data` (checked bytes)."""
    if len(data) != manifest.total_bytes:
        raise WireError(f"{len(data)} bytes for a snapshot of {manifest.total_bytes}")
    tensors: dict[str, torch.Tensor] = {}
    for e in manifest.entries:
        dtype = blob.DTYPES[e.dtype]
        n = e.size
        if n == 0:
            t = torch.empty(e.shape, dtype=dtype)
        else:
            t = torch.frombuffer(data, dtype=dtype, count=n // dtype.itemsize, offset=e.offset).reshape(e.shape)
        tensors[e.key] = t.to(device) if str(device) != "cpu" else t
    return structure.unflatten(manifest.skeleton, tensors, rebuild)


# --- the joiner's side -----------------------------------------------------------------------------
def _connection(endpoint: str, timeout_s: float) -> http.client.HTTPConnection:
    url = urllib.parse.urlsplit(endpoint)
    if url.hostname is None:
        raise WireError(f"{endpoint!r} names no host")
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)


def http_get(endpoint: str, path: str, token: str, timeout_s: float,
             max_bytes: int | None = None) -> tuple[int, bytes]:
    """(status, body); WireError for a body longer than `max_bytes`, which is not read."""
    conn = _connection(endpoint, timeout_s)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        if max_bytes is None:
            return resp.status, resp.read()
        if (resp.length or 0) > max_bytes:
            raise WireError(f"{endpoint}{path}: an answer of {resp.length} bytes, more than the {max_bytes} expected")
        body = resp.read(max_bytes + 1)
        if len(body) > max_bytes:
            raise WireError(f"{endpoint}{path}: an answer of more than the {max_bytes} bytes expected")
        return resp.status, body
    finally:
        conn.close()


def manifest_of(endpoint: str, token: str, timeout_s: float,
                max_bytes: int = MAX_MANIFEST_BYTES) -> SnapshotManifest | None:
    """The snapshot `endpoint` serves now, None if it serves none (yet)."""
    status, body = http_get(endpoint, "/snapshot", token, timeout_s, max_bytes)
    if status == 404:
        return None
    if status != 200:
        raise WireError(f"{endpoint}/snapshot answered {status}: {body[:200]!r}")
    return parse_manifest(body)


class _Link:
    """One fetch worker's connection to a source, kept open from one chunk to the next
    (HTTP/1.1 keep-alive). A connection per chunk cost the source a thread, a handshake
    and a fresh TCP window for every chunk: a third of its serving CPU, and of the joiner's
    receiving, at 4 MiB chunks on loopback (benchmarks.md, "catchup_bill")."""

    def __init__(self, endpoint: str, token: str, timeout_s: float):
        self.endpoint, self.token, self.timeout_s = endpoint, token, timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def chunk_into(self, manifest: SnapshotManifest, i: int, view: memoryview) -> None:
        """Chunk `i` straight into `view` (no intermediate copy), checked against its CRC32C.
        A kept connection the source closed (its idle timeout: the request finds it gone) is
        opened again, once; any other failure, or a fresh connection's, is the source's."""
        reused = self._conn is not None
        try:
            self._get(manifest, i, view)
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            self.close()
            if not reused:
                raise
            self._get(manifest, i, view)
        if digest([view]) != manifest.digests[i]:
            raise WireError(f"chunk {i}: checksum mismatch")

    def _get(self, manifest: SnapshotManifest, i: int, view: memoryview) -> None:
        if self._conn is None:
            self._conn = _connection(self.endpoint, self.timeout_s)
        self._conn.request("GET", f"/snapshot/{manifest.step}/chunk/{i}",
                           headers={"Authorization": f"Bearer {self.token}"})
        resp = self._conn.getresponse()
        if resp.status == 404:
            raise SnapshotChanged(f"{self.endpoint} no longer serves step {manifest.step}")
        if resp.status != 200 or resp.length != len(view):
            raise WireError(f"chunk {i}: status {resp.status}, {resp.length} bytes")
        got = 0
        while got < len(view):
            n = resp.readinto(view[got:])
            if not n:
                raise WireError(f"chunk {i}: connection closed after {got} bytes")
            got += n

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _serves(ep: str, manifest: SnapshotManifest, token: str, timeout_s: float, give_up: Callable[[], bool],
            max_bytes: int) -> bool:
    """Wait until a source that had no snapshot yet serves this one (sources of one step
    publish within a moment of each other); False if it serves another or gives up. Only
    its chunks are taken, checked against `manifest`'s digests."""
    while not give_up():
        m = manifest_of(ep, token, timeout_s, max_bytes)
        if m is not None:
            return m.step == manifest.step and m.digests == manifest.digests
        time.sleep(0.05)
    return False


class LinkGate:
    """Whether the replica's own gradient exchange is using the network now. A catch-up
    transfer asks for its chunks only while it is not (the forward pass, the optimizer
    step), so the snapshot never competes with the all-reduce for the joiner's link, which
    the healthy replicas' all-reduce crosses too: the transfer takes longer, nobody waits.
    A chunk already in flight finishes; a gate closed for longer than `max_wait_s` (an
    exchange stuck until its collective timeout) lets the next chunk through anyway."""

    def __init__(self, enabled: bool = True, max_wait_s: float = 5.0):
        self.enabled, self.max_wait_s = enabled, max_wait_s
        self._free = threading.Event()
        self._free.set()

    def busy(self) -> None:
        if self.enabled:
            self._free.clear()

    def free(self) -> None:
        self._free.set()

    def wait_free(self) -> None:
        self._free.wait(self.max_wait_s)


def fetch(manifest: SnapshotManifest, endpoints: Sequence[str], token: str, timeout_s: float,
          stopped: Callable[[], bool] = lambda: False, per_source: int = 2,
          late: Sequence[str] = (), gate: LinkGate | None = None,
          max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> bytearray:
    """Every chunk of `manifest`, each from whichever source is free, checked against its digest.

    `late` sources had no snapshot yet: they join the transfer once they serve this one
    (a manifest of at most `max_manifest_bytes`). A
    source that fails (connection, status, digest) is dropped and its chunk goes back to
    the queue for the others. `gate`: each chunk is asked for only while the link is free.
    SnapshotChanged when the sources answer that the step is gone; TimeoutError when no
    chunk arrived for `timeout_s`; WireError when every source failed.
    """
    fetch_ = _Fetch(manifest, token, timeout_s, stopped, gate, max_manifest_bytes)
    if fetch_.remaining == 0:
        return fetch_.out
    threads = [threading.Thread(target=fetch_.worker, args=(ep, is_late), name="transom-fetch", daemon=True)
               for eps, is_late in ((endpoints, False), (late, True)) for ep in eps for _ in range(per_source)]
    for t in threads:
        t.start()
    try:
        fetch_.wait(threads)
    finally:
        fetch_.done.set()
        for t in threads:  # each ends after its request in flight; stopping waits for none
            t.join(timeout=1.0 if stopped() else timeout_s + 1)
    return fetch_.out


class _Fetch:
    """One `fetch`: its chunk queue, shared by one worker thread per source connection."""

    def __init__(self, manifest: SnapshotManifest, token: str, timeout_s: float, stopped: Callable[[], bool],
                 gate: LinkGate | None, max_manifest_bytes: int):
        self.manifest, self.token, self.timeout_s, self.stopped = manifest, token, timeout_s, stopped
        self.gate, self.max_manifest_bytes = gate, max_manifest_bytes
        self.out = bytearray(manifest.total_bytes)
        self.todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(manifest.digests)):
            self.todo.put(i)
        self.remaining = len(manifest.digests)
        self.lock = threading.Lock()
        self.progress = time.monotonic()
        self.errors: list[str] = []
        self.changed: list[str] = []
        self.done = threading.Event()

    def worker(self, ep: str, is_late: bool) -> None:
        """Take chunks from `ep` until all are in; a late source first waits to serve this snapshot."""
        m = self.manifest
        try:
            if is_late and not _serves(ep, m, self.token, self.timeout_s,
                                       lambda: self.done.is_set() or self.stopped(), self.max_manifest_bytes):
                return
        except (OSError, WireError, http.client.HTTPException) as e:
            log.warning("state transfer: source %s dropped before it served: %s", ep, e)
            return
        link = _Link(ep, self.token, self.timeout_s)
        try:
            self._take_chunks(link)
        finally:
            link.close()

    def _take_chunks(self, link: _Link) -> None:
        """Chunks from the queue over `link` until all are in or its source fails."""
        m, ep = self.manifest, link.endpoint
        while not self.done.is_set() and not self.stopped():
            try:
                i = self.todo.get(timeout=0.1)
            except queue.Empty:
                continue
            if self.gate is not None:
                self.gate.wait_free()
            start, end = m.chunk_range(i)
            try:
                link.chunk_into(m, i, memoryview(self.out)[start:end])
            except SnapshotChanged as e:
                self.todo.put(i)
                with self.lock:
                    self.changed.append(str(e))
                return
            except (OSError, WireError, http.client.HTTPException) as e:
                self.todo.put(i)  # back to the queue for the other sources
                log.warning("state transfer: source %s dropped: %s", ep, e)
                with self.lock:
                    self.errors.append(f"{ep}: {e}")
                return
            with self.lock:
                self.progress = time.monotonic()
                self.remaining -= 1
                if self.remaining == 0:
                    self.done.set()

    def wait(self, threads: list[threading.Thread]) -> None:
        """Until every chunk is in; raises as `fetch` says when that cannot happen."""
        while not self.done.wait(0.05):
            with self.lock:
                stalled = time.monotonic() - self.progress
                alive = any(t.is_alive() for t in threads)
                if self.changed and not alive:
                    raise SnapshotChanged(self.changed[0])
            if self.stopped():
                raise InterruptedError("stopped")
            if not alive:
                raise WireError(f"every source failed: {'; '.join(self.errors[-3:])}")
            if stalled > self.timeout_s:
                raise TimeoutError(f"no chunk arrived for {self.timeout_s:g}s")
