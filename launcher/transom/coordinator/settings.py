"""The coordinator's settings: its timers and the job's shape, checked where they are made.

The defaults come from transom/defaults.py (LOCAL: what `transom run` and a bare `transom
coordinator` use; the operator passes the spec's values as flags).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transom.defaults import LOCAL
from transom.defaults import heartbeat_interval_s as interval_for


@dataclass(frozen=True)
class Settings:
    job: str = "local"
    num_replicas: int = 1
    min_replicas: int = 1
    heartbeat_interval_s: float = interval_for(LOCAL.heartbeat_timeout_s)
    heartbeat_timeout_s: float = LOCAL.heartbeat_timeout_s
    # How long a round with a reported failure waits for members that did not ask again
    # before deciding without them. Short: a live member asks within milliseconds of its
    # failed collective; a dead one never does.
    failed_grace_s: float = LOCAL.failed_grace_s
    # A member of the current quorum that does not ask for its next quorum this long after
    # another member did is declared hung (a stuck training thread keeps heartbeating).
    round_timeout_s: float = LOCAL.round_timeout_s
    # The first quorum waits for all replicas this long, then starts with minReplicas:
    # otherwise the first replica to start would train alone and the others would only
    # copy its state.
    startup_wait_s: float = LOCAL.startup_wait_s

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "failed_grace_s", "round_timeout_s",
                     "startup_wait_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number of seconds, got {getattr(self, name)}")
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be at least 1")
        if not 1 <= self.min_replicas <= self.num_replicas:
            raise ValueError("min_replicas must be between 1 and num_replicas")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be positive")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must be larger than heartbeat_interval_s")
        if self.failed_grace_s < 0 or self.startup_wait_s < 0:
            raise ValueError("failed_grace_s and startup_wait_s must not be negative")
        if self.round_timeout_s <= self.failed_grace_s:
            raise ValueError("round_timeout_s must be larger than failed_grace_s")
