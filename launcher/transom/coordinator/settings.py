"""The coordinator's settings: its timers and the job's shape, checked where they are made.

The defaults come from transom/defaults.py (LOCAL: what `transom run` and a bare `transom
coordinator` use; the operator passes the spec's values as flags).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from transom import contract
from transom.arguments import MAX_SECONDS
from transom.coordinator.lease import MAX_LEASE_S
from transom.coordinator.models import MAX_REPLICAS
from transom.defaults import LOCAL, QUORUM_LEASE_S
from transom.defaults import heartbeat_interval_s as interval_for
from transom.flags import seconds


class Settings(BaseModel):
    """The coordinator's settings; `transom coordinator`'s flags are these fields' (flags.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str = "local"
    num_replicas: int = Field(1, ge=1, le=MAX_REPLICAS, description="spec.replicas of the job")
    min_replicas: int = Field(1, ge=1, le=MAX_REPLICAS, description="training pauses below this many")
    heartbeat_interval_s: float = seconds(interval_for(LOCAL.heartbeat_timeout_s), MAX_SECONDS,
                                          "between a replica's heartbeats (default: min(1, timeout/3))")
    heartbeat_timeout_s: float = seconds(LOCAL.heartbeat_timeout_s, contract.MAX_WAIT_SECONDS,
                                         "a replica not heard from this long is failed")
    # How long a round with a reported failure waits for members that did not ask again
    # before deciding without them. Short: a live member asks within milliseconds of its
    # failed collective; a dead one never does.
    failed_grace_s: float = seconds(LOCAL.failed_grace_s, MAX_SECONDS, "a round with a failed step waits this long "
                                    "for the members that did not ask again", zero=True)
    # A member of the current quorum that does not ask for its next quorum this long after
    # another member did is declared hung (a stuck training thread keeps heartbeating).
    round_timeout_s: float = seconds(LOCAL.round_timeout_s, MAX_SECONDS, "a member that does not ask for its next "
                                     "quorum this long after another did is hung")
    # The first quorum waits for all replicas this long, then starts with minReplicas:
    # otherwise the first replica to start would train alone and the others would only
    # copy its state.
    startup_wait_s: float = seconds(LOCAL.startup_wait_s, MAX_SECONDS, "the first round waits this long for every "
                                    "replica", zero=True)

    # A quiet round answers for the steps of about this long after it, so that a job in which
    # nothing changes does not ask the coordinator at every step (lease.py); 0: every step asks.
    quorum_lease_s: float = seconds(QUORUM_LEASE_S, MAX_LEASE_S, "a quiet round answers for the steps of about "
                                    "this long after it (0: every step asks)", zero=True)

    @model_validator(mode="before")
    @classmethod
    def _interval_follows_the_timeout(cls, data: Any) -> Any:
        """No interval given: min(1, timeout / 3), so any timeout the CRD allows works."""
        if isinstance(data, dict) and data.get("heartbeat_interval_s") is None and "heartbeat_timeout_s" in data:
            try:
                timeout = float(data["heartbeat_timeout_s"])
            except (TypeError, ValueError):
                return data  # the timeout's own refusal says what is wrong
            if math.isfinite(timeout) and timeout > 0:
                data = {**data, "heartbeat_interval_s": interval_for(timeout)}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.min_replicas > self.num_replicas:
            raise ValueError("min_replicas must be between 1 and num_replicas")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must be larger than heartbeat_interval_s")
        if self.round_timeout_s <= self.failed_grace_s:
            raise ValueError("round_timeout_s must be larger than failed_grace_s")
        return self
