"""Storage reads of what is not a file (a FIFO, a directory) and of storage that does not answer."""

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
