"""What the coordinator's parts share: one job's membership and detection, the lock that
guards them, who may call, and the clock. `CoordinatorServer` makes one and hands it to the
route groups beside its own (lookups.py, owner.py) and to the metrics (metrics.py), which
read it and never the server itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from transom.coordinator.access import Access
from transom.coordinator.detection import Detection, SignalGate
from transom.coordinator.fencing import Refusals
from transom.coordinator.membership import Membership


@dataclass(frozen=True)
class Shared:
    membership: Membership
    detection: Detection
    access: Access
    refusals: Refusals  # the calls refused to incarnations that are no longer current
    signal_gate: SignalGate
    lock: asyncio.Lock  # guards membership and detection across awaits
    clock: Callable[[], float]
    ticking: Callable[[], bool]  # whether the server's round ticker runs (readiness)
