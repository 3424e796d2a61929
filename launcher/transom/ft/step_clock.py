"""A rank's clock of its own step: how long it was busy, that is the step less the time it
waited for others (its quorum, the exchange, the votes).

The busy time is what the fail-slow detector judges (a replica that waits for a slow peer
is not slow itself), and while a rank waits the step guard's waiting byte is set, so the
launcher's hang watchdog does not count a wait that has its own timeout (ft/guard.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from transom.ft.guard import Guard


class StepClock:
    def __init__(self, guard: Guard | None):
        self._guard = guard
        self._started = 0.0
        self._waited = 0.0

    def begin(self) -> None:
        self._started = time.monotonic()
        self._waited = 0.0
        if self._guard is not None:
            self._guard.begin()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time spent in here is not this rank's busy time, nor a hang."""
        started = time.monotonic()
        if self._guard is not None:
            self._guard.waiting(True)
        try:
            yield
        finally:
            if self._guard is not None:
                self._guard.waiting(False)
            self._waited += time.monotonic() - started

    def busy(self) -> float:
        return time.monotonic() - self._started - self._waited

    def elapsed(self) -> float:
        return time.monotonic() - self._started
