"""Goodput: the fraction of a job's time spent on steps that were kept.

The coordinator sees every round (one per step attempt) and the committed step each
round starts from. Between two decided rounds the job either advanced (the step of the
earlier round was committed: productive time) or it did not (a failed step retried, a
recovery, a pause below minReplicas: lost time). One refinement keeps a long stall from
counting as productive when the step does advance after it (for example a replica waiting
out a collective timeout before the survivors commit): an interval counts as productive for
at most `stall_factor` times the median of recent productive intervals; the rest is lost.
Once the job has completed (`finish`), the clock stops: what replicas do after the last
step (a late joiner catching up, leaving) is no time of the job's, and a goodput that kept
falling while nothing was left to train would tell an admin the finished job was failing.

Pure and clock-agnostic: times are whatever monotonic seconds the caller passes.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field


@dataclass
class GoodputClock:
    stall_factor: float = 3.0
    window: int = 64  # productive intervals kept for the median
    _start: float | None = None
    _last_time: float | None = None
    _last_step: int | None = None
    _productive_s: float = 0.0
    _recent: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=64))
    _end: float | None = None  # when the job completed: the clock stops there

    def finish(self, now: float) -> None:
        """The job completed at `now` (the first completion; later calls change nothing)."""
        if self._end is None:
            self._end = now

    def observe(self, now: float, committed_step: int) -> None:
        """A round was decided at `now`, its members holding `committed_step` steps."""
        if self._end is not None:
            return  # completed: rounds after it are no part of the job's time
        if self._start is None:
            self._start = now
        elif self._last_time is not None and self._last_step is not None and committed_step > self._last_step:
            interval = max(0.0, now - self._last_time)
            if self._recent:
                interval = min(interval, self.stall_factor * statistics.median(self._recent))
            self._recent.append(interval)
            self._productive_s += interval
        self._last_time, self._last_step = now, committed_step

    def value(self, now: float) -> float | None:
        """Productive seconds over seconds since the first round; None before two rounds."""
        end = now if self._end is None else min(now, self._end)
        if self._start is None or self._last_time is None or end <= self._start or not self._recent:
            return None
        return max(0.0, min(1.0, self._productive_s / (end - self._start)))


def as_decimal(value: float) -> str:
    """The API's goodput string: three decimals, "0.000" to "1.000"."""
    return f"{max(0.0, min(1.0, value)):.3f}"
