"""Loss spikes against a replica's own recent history, with robust statistics.

The median and the median absolute deviation (MAD) of the last `window` finite losses stand
for the loss's level and spread; unlike a mean and a standard deviation, one earlier spike
does not move them. A loss is a spike when it lies more than `z` robust standard deviations
(1.4826 MAD) above the median and is at least twice the median: a noisy but flat loss
curve, whose MAD is small, does not call every bump a spike. The trainer asks `is_spike`
before it applies a step (ft/guard.py), the coordinator the same for its verdicts.
"""

from __future__ import annotations

import collections
import math
import statistics

MIN_HISTORY = 10  # losses needed before anything is called a spike
SPIKE_MIN_RATIO = 2.0


class LossHistory:
    def __init__(self, window: int, z: float):
        self.z = z
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    def is_spike(self, loss: float) -> bool:
        if not math.isfinite(loss) or len(self._recent) < MIN_HISTORY:
            return False
        median = statistics.median(self._recent)
        mad = statistics.median(abs(v - median) for v in self._recent)
        spread = 1.4826 * mad + 1e-12 * max(abs(median), 1.0)
        return (loss - median) / spread > self.z and loss >= SPIKE_MIN_RATIO * median > 0

    def add(self, loss: float) -> None:
        """Record a loss that was not a spike (a spike must not raise the level it is judged by)."""
        if math.isfinite(loss):
            self._recent.append(loss)
