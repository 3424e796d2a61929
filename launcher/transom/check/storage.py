"""The storage check: can this node write, read back and delete at the checkpoint location?

Through the checkpoint's own Storage (checkpoint/storage.py: a directory, file:// or
s3://, with the same credentials a checkpoint uses), a small random object is written under
`<checkpoint_uri>/.transom-preflight/<uuid>`, read back, compared byte for byte and
deleted; the object is deleted whatever happened (the directory too, on a file system,
when no other node's probe is in it). The value is the seconds the round trip took. A
checkpoint location that refuses a write, returns other bytes or takes MAX_SECONDS for a
few kilobytes fails the check here instead of the job's first checkpoint. Skipped without
a checkpoint location. The prefix's leading dot keeps it out of the checkpoint's own
listing (checkpoint/layout.py takes only step directories).
"""

from __future__ import annotations

import os
import secrets
import time
import uuid

from transom.check.context import Budget, CheckContext
from transom.check.result import CheckResult, failed, measured, skipped

NAME = "storage"
PREFIX = ".transom-preflight"
OBJECT_BYTES = 4096
# A few kilobytes written, read and deleted: anything slower than this is storage that is
# failing (or throttled to where a checkpoint of gigabytes misses its interval).
MAX_SECONDS = 10.0


def check(context: CheckContext, budget: Budget) -> CheckResult:
    if context.checkpoint_uri is None:
        return skipped(NAME, "no checkpoint location")
    from transom.checkpoint.storage import Storage

    uri = context.checkpoint_uri if "://" in context.checkpoint_uri else os.path.abspath(context.checkpoint_uri)
    storage = Storage(uri)
    name = uuid.uuid4().hex
    data = secrets.token_hex(OBJECT_BYTES // 2)
    started = time.monotonic()
    try:
        storage.write_atomic(data.encode(), PREFIX, name)
        back = storage.read_text(PREFIX, name, limit=OBJECT_BYTES, timeout_s=max(0.001, budget.left()))
    finally:
        _clean(storage, name)
    seconds = time.monotonic() - started
    if back != data:
        return failed(NAME, f"{uri}: the object read back is not the one written", "the same bytes back")
    expected = f"<= {MAX_SECONDS:.0f} s"
    return measured(NAME, seconds, seconds <= MAX_SECONDS, expected,
                    f"wrote, read back and deleted {OBJECT_BYTES} bytes at {uri} in {seconds:.3f} s")


def _clean(storage, name: str) -> None:
    """The probe object deleted; on a file system its directory too, once empty (another
    node's probe may be in it; an object store has no directories to leave behind)."""
    storage.remove(PREFIX, name)
    if storage.local:
        try:
            os.rmdir(storage.path(PREFIX))
        except OSError:  # not empty (another probe), or already gone
            pass
