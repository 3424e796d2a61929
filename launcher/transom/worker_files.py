"""Reading a file a worker controls, without letting the worker stop the reader.

The launcher reads files its workers write: their step rows, collective counts, waiting
byte and stacks in the signals directory (launch/signal_forwarder.py), the ScriptError a
worker records (script_errors.py), and, for `transom run`, the step records, final digests
and the podinfo labels under its stats directory. The worker's script can put anything at
those paths: a FIFO (a plain `open()` of it waits for a writer, forever, and with it the
supervisor's only loop thread: no failure is reported, no worker restarted), a directory,
a symbolic link (to `/dev/zero`, to another worker's file), gigabytes of bytes.

So every such read goes through `read`: the file is opened with O_NONBLOCK (opening a FIFO
returns at once) and O_NOFOLLOW (a symbolic link is refused, not followed), `fstat` decides
(only a regular file is read: its reads never wait), and at most `limit` bytes are read. A
refused path is skipped with one warning, the first time it is seen; the caller gets None,
as for a file that is not there (yet). The downward API's podinfo files are symbolic links
made by the kubelet: `follow_symlinks=True` reads through them, still refusing anything
but a regular file at the end.

Stdlib only: the launcher imports it without torch.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("transom.launch")
MAX_WARNED = 4096  # refused paths remembered as warned about; past that the set starts again

_warned: set[str] = set()


def kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, why: str) -> None:
    """Warn about `path` once: the launcher polls it many times a second."""
    key = str(path)
    if key in _warned:
        return
    if len(_warned) >= MAX_WARNED:
        _warned.clear()
    _warned.add(key)
    log.warning("skipped %s: %s, not a regular file a worker writes (the launcher reads only those)", path, why)


def open_regular(path: Path, follow_symlinks: bool = False) -> int | None:
    """A descriptor of `path` opened for reading if it is a regular file; None if it is not
    there, or is anything else (warned about once). The caller closes it."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None  # not written yet: the usual case, nothing to say
    except OSError as e:
        # ELOOP: the last component is a symbolic link (O_NOFOLLOW); ENXIO: a socket.
        _refuse(path, "a symbolic link" if e.errno == errno.ELOOP else os.strerror(e.errno or 0))
        return None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        _refuse(path, os.strerror(e.errno or 0))
        return None
    if not stat.S_ISREG(mode):
        os.close(fd)
        _refuse(path, kind(mode))
        return None
    return fd


def read(path: Path, limit: int, offset: int = 0, follow_symlinks: bool = False) -> bytes | None:
    """At most `limit` bytes of regular file `path` from `offset`; None if it is not there or
    is not a regular file (`open_regular`). Never waits on the worker."""
    fd = open_regular(path, follow_symlinks)
    if fd is None:
        return None
    try:
        # No more than is there: a file that does not grow costs no buffer of `limit` bytes.
        size = os.fstat(fd).st_size
        return os.pread(fd, max(0, min(limit, size - offset)), offset) if offset < size else b""
    except OSError as e:
        _refuse(path, os.strerror(e.errno or 0))
        return None
    finally:
        os.close(fd)
