"""Storage reads of what is not a file (a FIFO, a directory) and of storage that does not answer;
S3 ranges received in place (an s3fs stand-in) and the CRC-32 of ranges joined."""

from __future__ import annotations

import os
import threading
import time

import pytest

from transom.checkpoint import storage as storage_module
from transom.checkpoint.storage import Storage
from transom.errors import StorageStalled

pytestmark = pytest.mark.timeout(20)  # today's failure is a read that never returns


@pytest.fixture
def store(tmp_path) -> Storage:
    os.mkfifo(tmp_path / "fifo")  # opening it for reading waits for a writer that never comes
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_bytes(b"ok")
    return Storage(str(tmp_path))


@pytest.mark.parametrize("name", ["fifo", "dir"])
def test_read_text_refuses_what_is_not_a_regular_file_at_once(store, name):
    start = time.monotonic()
    with pytest.raises(ValueError, match="not a regular file"):
        store.read_text(name)
    assert time.monotonic() - start < 2
    assert store.read_text("file") == "ok"


@pytest.mark.parametrize("name", ["fifo", "dir"])
@pytest.mark.parametrize("claimed", [0, 10])
def test_read_files_and_size_refuse_what_is_not_a_regular_file(store, name, claimed):
    with pytest.raises(ValueError, match="not a regular file"):
        store.size(name)
    with pytest.raises(ValueError, match="not a regular file"):
        store.read_files({name: claimed}, stall_s=5)


def test_a_read_that_does_not_return_in_time_fails_as_a_stall(store, monkeypatch):
    hung = threading.Event()  # a hung mount: the read returns only when the test ends
    monkeypatch.setattr(storage_module, "_open_regular", lambda path: (hung.wait(30), open(path, "rb"))[1])
    start = time.monotonic()
    try:
        with pytest.raises(StorageStalled, match="did not return"):
            store.read_text("file", timeout_s=0.3)
        assert time.monotonic() - start < 2
    finally:
        hung.set()


def test_crc32_combine_joins_ranges_like_one_pass():
    import random
    import zlib

    rng = random.Random(3)
    for la, lb in [(0, 0), (0, 5), (5, 0), (1, 1), (1000, 37), (70_000, 65_539)]:
        a, b = rng.randbytes(la), rng.randbytes(lb)
        assert storage_module.crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)


class _FakeBody:
    def __init__(self, data: bytes, hang: threading.Event | None) -> None:
        self.data, self.at, self.hang, self.closed = data, 0, hang, False

    async def readinto(self, b) -> int:
        import asyncio

        if self.hang is not None:
            while not self.hang.is_set():
                await asyncio.sleep(0.01)
        n = min(len(b), len(self.data) - self.at, 300)  # small pieces, as a socket gives them
        b[:n] = self.data[self.at:self.at + n]
        self.at += n
        return n

    def close(self) -> None:
        self.closed = True


class _FakeS3:
    """What Storage uses of s3fs: split_path, its event loop, and _call_s3("get_object")."""

    def __init__(self, objects: dict[str, bytes], hang: frozenset[str] = frozenset(),
                 broken_once: bool = False) -> None:
        from fsspec.asyn import get_loop

        self.loop, self.objects, self.hang = get_loop(), objects, hang
        self.released = threading.Event()
        self.bodies: list[_FakeBody] = []
        self.broken_once = broken_once

    def split_path(self, path: str) -> tuple[str, str, None]:
        bucket, key = path.split("/", 1)
        return bucket, key, None

    async def _call_s3(self, method: str, Bucket: str, Key: str, Range: str) -> dict:
        assert method == "get_object"
        if self.broken_once:
            self.broken_once = False
            raise ConnectionResetError("the connection broke")
        start, end = (int(x) for x in Range.removeprefix("bytes=").split("-"))
        data = self.objects[Key][start:end + 1]
        body = _FakeBody(data, self.released if Key in self.hang else None)
        self.bodies.append(body)
        return {"Body": body, "ContentLength": len(data)}

    def info(self, path: str) -> dict:
        return {"type": "file", "size": len(self.objects[self.split_path(path)[1]])}

    def invalidate_cache(self, path: str | None = None) -> None:
        pass


def _s3_store(monkeypatch, fake: _FakeS3) -> Storage:
    monkeypatch.setattr(storage_module, "READ_PART_BYTES", 1000)  # many ranges, finishing out of order
    store = Storage("memory://bucket")
    store.fs, store.root, store.local = fake, "bucket", False
    return store


def test_s3_ranges_are_received_in_place_and_checksummed(monkeypatch):
    import random
    import zlib

    rng = random.Random(5)
    objects = {"a": rng.randbytes(10_500), "b": rng.randbytes(999), "c": b""}
    fake = _FakeS3(objects, broken_once=True)  # the first request fails and is tried again
    store = _s3_store(monkeypatch, fake)
    got = store.read_files({k: len(v) for k, v in objects.items()}, streams=3)
    assert {k: (bytes(b), c) for k, (b, c) in got.items()} == {k: (v, zlib.crc32(v)) for k, v in objects.items()}
    assert all(body.closed for body in fake.bodies)
    with pytest.raises(ValueError, match="does not hold"):
        store.read_files({"b": 1200}, streams=2)


def test_an_s3_read_that_stops_answering_is_cancelled_after_the_stall_timeout(monkeypatch):
    fake = _FakeS3({"a": b"x" * 100, "stuck": b"y" * 3000}, hang=frozenset({"stuck"}))
    store = _s3_store(monkeypatch, fake)
    t0 = time.monotonic()
    with pytest.raises(StorageStalled):
        store.read_files({"a": 100, "stuck": 3000}, streams=2, stall_s=0.5)
    assert time.monotonic() - t0 < 5
    deadline = time.monotonic() + 5
    while not all(b.closed for b in fake.bodies) and time.monotonic() < deadline:  # cancelled on the loop
        time.sleep(0.01)
    assert all(b.closed for b in fake.bodies)
