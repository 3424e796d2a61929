"""A bounded wait on queued GPU work.

CUDA's own waits (`Event.synchronize`, `Stream.synchronize`) have no timeout: a copy or a
collective stuck behind a dead NCCL peer would hold the thread forever. Here an event
recorded after the work is polled until it completes or the deadline passes. The poll
starts at 0.1 ms and doubles to 1 ms, so a wait that was short stays short (the snapshot
copy is on the training loop's path) and a long one costs about a thousand cheap queries a
second. No torch import: anything with `query() -> bool` works, so the unit tests need no GPU.
"""

from __future__ import annotations

import time
from typing import Protocol

FIRST_POLL_S = 0.0001
LONGEST_POLL_S = 0.001


class Completes(Protocol):
    def query(self) -> bool: ...


def wait_for(event: Completes, timeout_s: float, what: str) -> None:
    """Return once `event` has completed; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = FIRST_POLL_S
    while not event.query():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not finished on the GPU after {timeout_s:g}s")
        time.sleep(delay)
        delay = min(2 * delay, LONGEST_POLL_S)
