"""Reading a file a worker controls (transom/worker_files.py): a regular file is read, up to
a bound; anything else at the path (a FIFO, a directory, a symbolic link, a socket) is
refused at once, with one warning, never waited on."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from transom import worker_files


def make(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        (path.parent / "target").write_bytes(b"1")
        path.symlink_to(path.parent / "target")
    elif kind == "dangling-symlink":
        path.symlink_to(path.parent / "nowhere")
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()


def test_a_regular_file_is_read_from_an_offset_up_to_the_bound(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    assert worker_files.read(path, 4) == b"0123"
    assert worker_files.read(path, 4, offset=8) == b"89"
    assert worker_files.read(path, 4, offset=20) == b""
    assert worker_files.read(tmp_path / "missing", 4) is None


def test_a_huge_file_costs_the_bound_only(tmp_path):
    path = tmp_path / "huge"
    with open(path, "wb") as f:
        f.truncate(1 << 36)  # sparse: 64 GiB the reader must not try to take in
    assert len(worker_files.read(path, 1 << 20) or b"") == 1 << 20


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink", "dangling-symlink", "socket"])
def test_anything_but_a_regular_file_is_refused_at_once_and_warned_about_once(tmp_path, caplog, kind):
    path = tmp_path / f"signals-{kind}.csv"
    make(kind, path)
    with caplog.at_level("WARNING", logger="transom.launch"):
        assert worker_files.read(path, 100) is None
        assert worker_files.read(path, 100) is None
    warned = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(warned) == 1, warned


def test_a_symbolic_link_is_followed_only_when_asked_and_then_only_to_a_regular_file(tmp_path):
    (tmp_path / "target").write_bytes(b"replica=1")
    (tmp_path / "labels").symlink_to(tmp_path / "target")  # the downward API's layout
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    assert worker_files.read(tmp_path / "labels", 100, follow_symlinks=True) == b"replica=1"
    assert worker_files.read(tmp_path / "to-fifo", 100, follow_symlinks=True) is None
