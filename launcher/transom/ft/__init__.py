"""Fault tolerance across data-parallel replicas (needs torch): quorum client, FTAR, vote.

The public API is `init()`, `FaultTolerant` and `FTConfig`; see manager.py for a complete
example loop and docs/training-api.md for the guide.
"""

from transom.ft.manager import FaultTolerant, FTConfig, TooManyFailedSteps, lr_factor, state_digest
from transom.ft.replica import ReplicaContext, init

__all__ = ["FaultTolerant", "FTConfig", "ReplicaContext", "TooManyFailedSteps", "init", "lr_factor", "state_digest"]
