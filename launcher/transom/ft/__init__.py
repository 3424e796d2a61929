"""Fault tolerance across data-parallel replicas (needs torch): quorum client, FTAR, vote.

The public API is `init()`, `FaultTolerant`, `FTConfig` and `CheckpointConfig`; see manager.py for a complete
example loop and docs/training-api.md for the guide.
"""

from transom.checkpoint.engine import CheckpointConfig
from transom.ft.manager import FaultTolerant, FTConfig, TooManyFailedSteps, lr_factor, state_digest
from transom.ft.replica import ReplicaContext, init

__all__ = ["CheckpointConfig", "FaultTolerant", "FTConfig", "ReplicaContext", "TooManyFailedSteps", "init", "lr_factor", "state_digest"]
