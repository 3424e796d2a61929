"""The checkpoint's view of storage: fsspec URLs, atomic small writes, listing, retries.

`file://` (or a plain path) serves NFS and PVC mounts, `s3://` goes through s3fs; anything
else fsspec knows works too. S3 settings come from the usual AWS variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for S3-compatible servers),
which the operator passes in from `checkpoint.credentialsSecret`. Transom's own retry
(`retry`: backoff, the engine's `trouble` said at the first failure) is the only retry
policy: the S3 client makes one attempt per request, with a short connect timeout
(`s3_options`), so an outage is seen at its first failed write, not after the client's own
retries and backoffs (botocore's and s3fs's took 8 s for a 1 KB put to a stopped server).

A small file that marks completion (a part's checksums, the manifest) must never be seen
half written: on a local file system it is written to a temporary name, fsynced and
renamed; an S3 PUT is atomic by itself. `create` writes one only where there is none yet
(the location's job record, owner.py): a hard link on a local file system, a conditional
PUT on S3.

Every write and delete first asks `guard` (the path under the root, and whether it deletes),
which raises to keep it from happening: a training replica's checkpoint engine asks the
coordinator whether its incarnation is still current (ft/fencing.py). Reads ask nothing.

What storage holds is not trusted to be a file: a FIFO, a device or a directory where a
checkpoint's file belongs is refused before it is opened (opening a FIFO waits for a writer
that never comes). Reading a file's bytes is bounded in time (`read_text` by a deadline,
`read_files` by READ_STALL_S without progress), so a bad checkpoint or a hung mount fails
the read instead of stalling a restore.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import io
import logging
import mmap
import os
import random
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO, TypeVar

import fsspec
import numpy
from fsspec.implementations.local import LocalFileSystem

from transom.errors import Fenced, StorageStalled

log = logging.getLogger("transom.checkpoint")
T = TypeVar("T")
READ_PART_BYTES = 32 << 20
READ_STREAMS = 8  # ranges read at once by a restore (s3fs: one connection each)
# On a local file system the reads are copies out of the page cache (or a disk's queue):
# a few at once beat one (measured: 2 streams 0.40 s, 1 stream 0.74-0.97 s for 512 MiB on
# 2 cores), more than the cores only add overhead.
LOCAL_READ_STREAMS = min(4, max(2, os.cpu_count() or 1))
# A restore gives up when no range of READ_PART_BYTES arrived for this long: storage that
# stopped answering (a hung mount, a stalled connection) fails the restore, which the
# launcher then retries, instead of waiting forever before the replica ever registered.
READ_STALL_S = 300.0
# An S3 range's body is received in pieces of this size, each copied once from aiohttp's
# buffer into its place (larger pieces make aiohttp join its chunks into a new bytes first:
# one more copy).
RECV_BYTES = 256 << 10
READ_ATTEMPTS = 3  # tries of one S3 range before the read fails (the S3 client tries each request once)
S3_CONNECT_TIMEOUT_S = 3.0  # a server that does not accept the connection is named as away after this
# Waiting for a response (a PUT's answer comes after its body): a stalled server, not a slow
# upload, runs into it.
S3_READ_TIMEOUT_S = 30.0


def s3_options(storage_options: dict) -> dict:
    """`storage_options` for an s3:// URI with one attempt per request and a short connect
    timeout, unless the caller set them (`config_kwargs`' retries and timeouts)."""
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    config.setdefault("connect_timeout", S3_CONNECT_TIMEOUT_S)
    config.setdefault("read_timeout", S3_READ_TIMEOUT_S)
    return {**storage_options, "config_kwargs": config}


class Storage:
    def __init__(self, uri: str, **storage_options) -> None:
        if not uri:
            raise ValueError("a checkpoint URI is required (TRANSOM_CHECKPOINT_URI, e.g. s3://bucket/job)")
        self.uri = uri.rstrip("/")
        if self.uri.startswith(("s3://", "s3a://")):
            storage_options = s3_options(storage_options)
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **storage_options)
        if hasattr(self.fs, "retries"):  # s3fs retries a request itself (5 tries by default): one
            self.fs.retries = 1
        self.local = isinstance(self.fs, LocalFileSystem)
        self.guard: Callable[[str, bool], None] | None = None
        """Called with (path under the root, deleting) before each write or delete; raises to stop it."""

    def _guarded(self, parts: tuple[str, ...], deleting: bool = False) -> str:
        """The full path of `parts`, once `guard` let the write or delete go ahead."""
        if self.guard is not None:
            self.guard("/".join(parts), deleting)
        return self.path(*parts)

    def url(self, *parts: str) -> str:
        """A full URL (for DCP's FsspecWriter/Reader) of a path under the root."""
        return "/".join([self.uri, *parts])

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def read_text(self, *parts: str, limit: int = 1 << 30, timeout_s: float = READ_STALL_S) -> str:
        """A small file's text; ValueError if it is larger than `limit` or not a regular file
        (it is not ours), StorageStalled if it did not arrive within `timeout_s`."""
        path = self.path(*parts)
        return _within(timeout_s, path, lambda: self._read_small(path, limit)).decode()

    def _read_small(self, path: str, limit: int) -> bytes:
        size = self._file_size(path)  # before anything is opened or fetched
        if size > limit:
            raise ValueError(f"{path} is {size} bytes, more than {limit}")
        with _open_regular(path) if self.local else self.fs.open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:  # it grew meanwhile
            raise ValueError(f"{path} is more than {limit} bytes")
        return data

    def size(self, *parts: str) -> int:
        """Bytes of one regular file as storage reports it (FileNotFoundError if absent,
        ValueError if it is something else: a directory, a FIFO, a device)."""
        return self._file_size(self.path(*parts))

    def _file_size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        info = self.fs.info(path)
        if info.get("type") != "file":
            raise ValueError(f"{path} is not a regular file ({info.get('type')})")
        return int(info["size"])

    def read_files(self, sizes: dict[str, int], streams: int | None = None, checksums: bool = True,
                   stall_s: float = READ_STALL_S) -> dict[str, tuple[memoryview, int | None]]:
        """Whole files (path under the root -> the size it must have) with each one's CRC-32,
        read as ranges of READ_PART_BYTES on `streams` connections at once: one stream of an
        object store reads at about a single connection's speed, several at its aggregate
        speed. Every range lands straight in the file's buffer: a local file system's read
        fills it (LOCAL_READ_STREAMS at once: the page cache, a mounted volume), and an S3
        response's body is received into it piece by piece on s3fs's event loop
        (READ_STREAMS requests at once; `_fetch_s3`), never gathered into a bytes object of
        its own first. Each range's CRC-32 is taken as it arrives, in any order (by the
        thread that read it from a local file system, in this thread for S3, whose event
        loop only receives; zlib releases the GIL), and the ranges' CRC-32s are joined into
        the file's (`_RangeCrc`), so the check costs no pass of its own after the last
        byte; None without `checksums`. ValueError
        if a file holds another number of bytes; StorageStalled if no range arrived for
        `stall_s` (the reads still in flight are then cancelled where they can be)."""
        streams = streams or (LOCAL_READ_STREAMS if self.local else READ_STREAMS)
        out = {path: _buffer(size) for path, size in sizes.items()}
        ranges = [(path, start, min(start + READ_PART_BYTES, size))
                  for path, size in sizes.items() for start in range(0, size, READ_PART_BYTES)]
        crc = _RangeCrc({path: out[path].data for path in sizes})
        if ranges:
            futures, stop = self._start_reads(ranges, out, sizes, streams, checksums)
            stalled = False
            try:
                for path, start, end, range_crc in _as_completed(futures, stall_s):
                    if checksums:
                        crc.arrived(path, start, end, range_crc)
            except StorageStalled:
                stalled = True
                raise
            finally:
                stop(not stalled)
        for path, size in sizes.items():
            if self.size(path) != size:  # longer than the manifest says: not the file it describes
                raise ValueError(f"{path} does not hold the {size} bytes the manifest says")
        return {path: (out[path].data, crc.value(path) if checksums else None) for path in sizes}

    def _start_reads(self, ranges: list[tuple[str, int, int]], out: dict[str, numpy.ndarray], sizes: dict[str, int],
                     streams: int, checksums: bool) -> tuple[list[concurrent.futures.Future], Callable[[bool], None]]:
        """Every range's read started, `streams` at a time: their futures (each one's result is
        its range, and its CRC-32 where the reading thread took it) and how to stop what is
        left (waiting for it, or not)."""
        if hasattr(self.fs, "_call_s3"):  # s3fs: requests on its event loop, bodies received in place
            limit = asyncio.Semaphore(streams)  # binds to s3fs's loop on first use
            futures = [asyncio.run_coroutine_threadsafe(
                self._fetch_s3(limit, path, start, end, out[path].data[start:end]), self.fs.loop)
                for path, start, end in ranges]

            def cancel(wait: bool) -> None:
                for future in futures:  # a cancelled future cancels its task on the loop
                    future.cancel()
            return futures, cancel

        def one(r: tuple[str, int, int]) -> tuple[str, int, int, int | None]:
            path, start, end = r
            target = out[path].data[start:end]
            if self._read_range(path, start, end, target) != end - start:
                raise ValueError(f"{path} does not hold the {sizes[path]} bytes the manifest says")
            # Hashed here, by the thread that read it: the reads of a local file system are
            # copies that take the CPU, and the threads' hashes run side by side (zlib releases
            # the GIL) instead of queueing behind one another in the caller's thread.
            return path, start, end, zlib.crc32(target) if checksums else None

        pool = concurrent.futures.ThreadPoolExecutor(max(1, min(streams, len(ranges))),
                                                     thread_name_prefix="transom-read")
        # A read stuck in storage cannot be interrupted: after a stall the pool is not waited
        # for, and its thread ends when the read does (or with the process).
        return [pool.submit(one, r) for r in ranges], lambda wait: pool.shutdown(wait=wait, cancel_futures=True)

    def _read_range(self, path: str, start: int, end: int, target: memoryview) -> int:
        """Bytes [start, end) of `path` into `target`: how many there were."""
        if self.local:  # straight into the buffer: no intermediate bytes object to fill and copy
            with _open_regular(self.path(path)) as f:
                f.seek(start)
                return f.readinto(target)
        data = self.fs.cat_file(self.path(path), start=start, end=end)
        if len(data) == end - start:
            target[:] = data
        return len(data)

    async def _fetch_s3(self, limit: asyncio.Semaphore, path: str, start: int, end: int,
                        target: memoryview) -> tuple[str, int, int, None]:
        """Bytes [start, end) of an S3 object received into `target` (a GET of that range,
        its body read in pieces of RECV_BYTES straight into place: each piece is copied
        once, from aiohttp's buffer). A failed request or a broken body is tried again from
        the start, up to READ_ATTEMPTS times; ValueError if the object is shorter."""
        bucket, key, version = self.fs.split_path(self.path(path))
        extra = {"VersionId": version} if version else {}
        async with limit:
            for attempt in range(1, READ_ATTEMPTS + 1):
                try:
                    resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                                  Range=f"bytes={start}-{end - 1}", **extra)
                    body, got = resp["Body"], 0
                    try:
                        while got < len(target):
                            n = await body.readinto(target[got:got + RECV_BYTES])
                            if not n:
                                break
                            got += n
                    finally:
                        body.close()
                    break
                except PERMANENT_ERRORS:
                    raise
                except Exception as e:
                    if attempt == READ_ATTEMPTS:
                        raise
                    log.warning("reading %s [%d, %d) failed (%s: %s); trying again", path, start, end,
                                type(e).__name__, e)
                    await asyncio.sleep(0.2 * attempt)
        if got != end - start or int(resp.get("ContentLength", got)) != got:
            raise ValueError(f"{path} does not hold the bytes the manifest says (range [{start}, {end}))")
        return path, start, end, None  # hashed by the caller: the event loop only receives

    @contextlib.contextmanager
    def open_write(self, *parts: str) -> Iterator[BinaryIO]:
        """A new file for streaming writes; on a local file system fsynced before it is closed."""
        target = self._guarded(parts)
        if self.local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        else:
            with self.fs.open(target, "wb") as f:
                yield f

    def write_atomic(self, data: bytes, *parts: str) -> None:
        target = self._guarded(parts)
        if self.local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp-{os.getpid()}-{random.randrange(1 << 30)}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            dir_fd = os.open(os.path.dirname(target), os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        else:
            self.fs.pipe_file(target, data)

    def create(self, data: bytes, *parts: str) -> bool:
        """Write a small file only where there is none yet: True if this call wrote it, False
        if a file was there already (whoever wrote it). Never seen half written.

        Local: written to a temporary name, fsynced, and hard-linked to its name, which fails
        if the name exists (one atomic step); a file system without hard links gets an
        exclusive create instead. Object store: a PUT with `If-None-Match: *` (s3fs's
        mode="create"); a server that does not take the condition gets a plain PUT after a
        look that there is no file yet, so two writers within that moment may both write,
        the later one winning: the caller reads the file back (owner.py)."""
        target = self._guarded(parts)
        return _create_local(target, data) if self.local else _create_remote(self.fs, target, data)

    def list_dirs(self) -> list[str]:
        """Names directly under the root (no error when the root does not exist yet)."""
        self.fs.invalidate_cache()
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []

    def sizes(self, *parts: str) -> dict[str, int]:
        """Every file under a directory, relative path -> size."""
        base = self.path(*parts).rstrip("/")
        self.fs.invalidate_cache()
        out = {}
        for path, info in self.fs.find(base, detail=True).items():
            if info.get("type", "file") == "file":
                out[path[len(base):].lstrip("/")] = int(info["size"])
        return out

    def remove(self, *parts: str) -> None:
        target = self._guarded(parts, deleting=True)
        try:
            self.fs.rm(target, recursive=True)
        except FileNotFoundError:
            pass


# Errors that say the code or the data is wrong, not that storage is away: waiting cannot
# fix them, so they fail at once with their message.
PERMANENT_ERRORS = (TypeError, ValueError, AttributeError, LookupError, NotImplementedError, ImportError)


def _buffer(size: int) -> numpy.ndarray:
    """`size` bytes, uninitialised (not bytearray(size), which writes zeros over every page
    first), page-aligned, so aligned for any dtype (a restore's tensors are views of them,
    blob.decode), in ordinary pages: an anonymous mapping of its own, released with the
    last view. Not numpy.empty: numpy asks for transparent huge pages on a large array
    (madvise), and their faults stalled reads into it for seconds at a time on a loaded
    2-core machine (a 512 MiB restore: 2-5 s outliers in 6 of 15 reads, none in ordinary pages)."""
    if size == 0:
        return numpy.empty(0, dtype=numpy.uint8)
    return numpy.frombuffer(mmap.mmap(-1, size), dtype=numpy.uint8)


def _create_local(target: str, data: bytes) -> bool:
    """Storage.create on a local file system: the whole file under a temporary name, then
    linked to `target` unless that exists (False)."""
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}-{random.randrange(1 << 30)}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    except OSError as e:  # no hard links (some FUSE mounts): an exclusive create, written at once
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.ENOSYS):
            raise
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    finally:
        os.unlink(tmp)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return True


def _create_remote(fs, target: str, data: bytes) -> bool:
    """Storage.create on an object store: a conditional PUT, or a look and a plain PUT.

    Any failure of the conditional PUT but "it exists" falls back: a server that does not
    take the condition (s3fs: ENOSYS for a 501, EINVAL for an unknown header), an s3fs or
    fsspec too old for mode="create" (TypeError, or botocore's ParamValidationError), or
    a passing error, after which the look finds our own file if the PUT did land, and the
    plain PUT fails again (for the caller's retry) if storage is away."""
    try:
        fs.pipe_file(target, data, mode="create")
        return True
    except FileExistsError:
        return False
    except Exception as e:  # noqa: BLE001 - every other failure: the look and plain PUT below
        log.warning("a conditional write of %s failed (%s: %s); writing it after a look", target, type(e).__name__, e)
    fs.invalidate_cache(target)
    if fs.exists(target):
        return False
    fs.pipe_file(target, data)
    return True


def _open_regular(path: str) -> io.BufferedReader:
    """A local regular file open for reading; ValueError for anything else. Checked before
    the open (opening a device can act on it) and again on what was opened, which is opened
    non-blocking so that a FIFO swapped in meanwhile cannot hold the open either."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path} is not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        os.set_blocking(fd, True)  # a regular file: reads as usual (a FUSE file system may honour the flag)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _within(timeout_s: float, what: str, fn: Callable[[], T]) -> T:
    """fn()'s result (or its exception); StorageStalled once it has taken `timeout_s`. A read
    stuck in storage (a hung mount, a stalled connection) cannot be interrupted: it is left
    to a daemon thread, which ends when the read does or with the process, never holding
    the process's exit."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller as is
            future.set_exception(e)

    threading.Thread(target=run, name="transom-read", daemon=True).start()
    try:
        future.exception(timeout=timeout_s)  # waits; raises TimeoutError only if fn has not finished
    except concurrent.futures.TimeoutError:
        raise StorageStalled(f"storage did not return {what} in {timeout_s:g}s") from None
    return future.result()


class _RangeCrc:
    """Each file's CRC-32, from the CRC-32s of its ranges taken as they arrive, in any order,
    and joined at the end (`crc32_combine`): no range waits for the ones before it, so the
    last byte to arrive leaves one range to hash, not a backlog of the ranges behind a slow one."""

    def __init__(self, buffers: dict[str, memoryview]) -> None:
        self.buffers = buffers
        self.parts: dict[str, dict[int, tuple[int, int]]] = {path: {} for path in buffers}  # start -> (end, crc)

    def arrived(self, path: str, start: int, end: int, crc: int | None = None) -> None:
        """Range [start, end) of `path` is in its buffer; `crc`: its CRC-32 if taken already."""
        self.parts[path][start] = (end, zlib.crc32(self.buffers[path][start:end]) if crc is None else crc)

    def value(self, path: str) -> int:
        crc, at = 0, 0
        for start in sorted(self.parts[path]):
            end, part = self.parts[path][start]
            if start != at:
                raise ValueError(f"{path}: bytes [{at}, {start}) were not read")
            crc, at = crc32_combine(crc, part, end - start), end
        if at != len(self.buffers[path]):
            raise ValueError(f"{path}: bytes [{at}, {len(self.buffers[path])}) were not read")
        return crc


_CRC_POLY = 0xEDB88320  # CRC-32 (zlib's), reflected


def _multmodp(a: int, b: int) -> int:
    """a times b modulo the CRC-32 polynomial (zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A+B from crc1 = crc32(A), crc2 = crc32(B) and len(B) (zlib's crc32_combine,
    which Python's zlib module does not offer)."""
    p, k, n = 1 << 31, 3, len2  # x^(8 * len2): the bits A's CRC is shifted by
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def _as_completed(futures: list[concurrent.futures.Future[T]], stall_s: float) -> Iterator[T]:
    """Each future's result as it completes; StorageStalled when none completed for `stall_s`."""
    pending = set(futures)
    while pending:
        done, pending = concurrent.futures.wait(pending, timeout=stall_s,
                                                return_when=concurrent.futures.FIRST_COMPLETED)
        if not done:
            raise StorageStalled(f"storage returned none of {len(pending)} reads in {stall_s:.0f}s")
        for future in done:
            yield future.result()


def retry(what: str, fn: Callable[[], T], stopped: Callable[[], bool], first_s: float = 0.5,
          max_s: float = 30.0, sleep: Callable[[float], None] = time.sleep,
          on_failure: Callable[[str], None] | None = None,
          permanent: tuple[type[BaseException], ...] = ()) -> T:
    """Call `fn` until it succeeds, backing off exponentially (with jitter) between failures.

    Storage that is away does not fail the checkpoint: it waits for the storage to return.
    Raises the last error once `stopped()` (the engine is closing), and a PERMANENT_ERRORS
    one, `Fenced` (this incarnation may no longer write: no retry changes that) or one of
    `permanent` (what the caller knows no retry changes), at once.
    `on_failure` hears each failure that will be retried, as "WHAT: ErrorType" (the type
    only: an error's text may carry a URL with a signature, and this one goes to status).
    """
    delay = first_s
    final: tuple[type[BaseException], ...] = (*PERMANENT_ERRORS, Fenced, *permanent)
    while True:
        try:
            return fn()
        except final:
            raise
        except Exception as e:
            if stopped():
                raise
            log.warning("checkpoint: %s failed (%s: %s); retrying in %.1fs", what, type(e).__name__, e, delay)
            if on_failure is not None:
                on_failure(f"{what}: {type(e).__name__}")
            sleep(delay * random.uniform(0.8, 1.2))
            delay = min(max_s, delay * 2)
