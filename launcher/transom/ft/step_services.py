"""`StepServices`: the collaborators that more than one stage of a step uses, in one object.

The trainer (ft/trainer.py) builds it once and passes it to each stage (the exchange, the
recovery, the commit); a stage takes from it what it needs and gets its own parts by
name. Nothing here is a stage: these are the replica's context and settings, the live
model and optimizer, and the shared instruments of a step:

- `hooks`: fault injection's points in the step (ft/hooks.py), no-ops in production;
- `guard`: the anomaly detection of this rank (ft/guard.py), None with detection off;
- `clock`: this step's busy time and its waits for others (ft/step_clock.py);
- `shares`: the shares of the global batch this replica follows (ft/shares.py);
- `gate`: whether the step's gradients use the network now, which a catch-up yields to
  (ft/transfer.py `LinkGate`);
- `fence`: whether the coordinator still counts this incarnation (ft/fencing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transom.ft.config import FTConfig
from transom.ft.fencing import IncarnationFence
from transom.ft.guard import Guard
from transom.ft.hooks import StepHooks
from transom.ft.replica import ReplicaContext
from transom.ft.shares import BatchShares
from transom.ft.step_clock import StepClock
from transom.ft.transfer import LinkGate


@dataclass(frozen=True)
class StepServices:
    ctx: ReplicaContext
    config: FTConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer  # the script's own (not the FTOptimizer wrapping it)
    device: torch.device  # where the gradients live
    hooks: StepHooks
    guard: Guard | None
    clock: StepClock
    shares: BatchShares
    gate: LinkGate
    fence: IncarnationFence
