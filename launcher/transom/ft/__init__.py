"""Fault tolerance across data-parallel replicas (needs torch): quorum client, FTAR, vote.

The public API is `init()`, `FaultTolerant`, `ReplicaSampler`, `ScriptState`, `FTConfig` and
`CheckpointConfig`; see trainer.py for a complete
example loop and docs/training-api.md for the guide. The exceptions a script may catch are
transom.errors' (the ones a loop meets most are re-exported here).
"""

from transom.checkpoint.engine import CheckpointConfig
from transom.errors import Evicted, JobCompleted, NoQuorum, TooManyFailedSteps, TransomError
from transom.ft.config import FTConfig, lr_factor, state_digest
from transom.ft.data import ReplicaSampler
from transom.ft.replica import ReplicaContext, init
from transom.ft.script_state import ScriptState
from transom.ft.trainer import FaultTolerant

__all__ = ["CheckpointConfig", "Evicted", "FaultTolerant", "FTConfig", "JobCompleted", "NoQuorum", "ReplicaContext",
           "ReplicaSampler", "ScriptState", "TooManyFailedSteps", "TransomError", "init", "lr_factor", "state_digest"]
