"""Background threads yield the CPU to training: `yield_cpu()` lowers the calling thread's priority.

Transom's background work (a snapshot's host copy and checksums, serving and fetching a
catch-up's chunks, replaying its updates) runs beside the training loop. Where the
machine has idle cores it costs the loop nothing; where it has none (a replica's CPU
share fully used, or several replicas sharing a small machine), every second it takes
from a training thread is a second the replicas, which step in lockstep, wait. On Linux
each thread is a task with its own nice value, so a background thread can ask to be
scheduled only when the training threads do not need the core. Raising one's own nice
value needs no privilege; where it is not possible, nothing changes.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 19


def yield_cpu() -> None:
    """Give the calling thread the lowest CPU priority (Linux; elsewhere a no-op)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass
