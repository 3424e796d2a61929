"""Polling with a deadline, for tests that watch real processes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    """Poll `predicate` until it is true; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval_s)
