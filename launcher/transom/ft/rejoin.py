"""A replica's catching up as the trainer drives it: start it, name its sources, swap it in.

ft/catchup.py does the work (the background fetch, the shadow, the replay); this is the
trainer's side of it, one step at a time. In a recovering replica's first round every rank
takes the small state from a source and starts a `Joiner`, or none does and the step fails
for all (a replica half caught up would fork). In every later round the joiner learns which
sources are alive. At each commit the update it cannot apply yet is recorded; once every
rank's shadow has reached the step being committed, the shadow is swapped in and the
replica contributes from the next round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from transom.checkpoint import sharding
from transom.coordinator.models import QuorumResponse
from transom.errors import MustRestart
from transom.ft.catchup import Joiner, apply_small, record_of
from transom.ft.config import FTConfig
from transom.ft.ftar import StepAllReduce
from transom.ft.replica import ReplicaContext
from transom.ft.state import ReplicaState
from transom.ft.state_server import take_small
from transom.ft.transfer import LinkGate

log = logging.getLogger("transom.ft")


class Rejoin:
    """The trainer's handle on this replica's catch-up; `active` while it catches up."""

    def __init__(self, ctx: ReplicaContext, replica_id: int, config: FTConfig, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, state: ReplicaState, device: torch.device, gate: LinkGate,
                 verify: Callable | None = None):
        """`verify`: the joiner's check of a snapshot before it is used (ft/snapshot_check.py)."""
        self.ctx, self.replica_id, self.config = ctx, replica_id, config
        self.model, self.optimizer, self.state, self.device, self.gate = model, optimizer, state, device, gate
        self.verify = verify
        self.joiner: Joiner | None = None

    @property
    def active(self) -> bool:
        return self.joiner is not None

    @property
    def need_from(self) -> int | None:
        """The step the snapshot it waits for must have reached (the quorum request says it)."""
        return self.joiner.need_from if self.joiner is not None else None

    def round(self, q: QuorumResponse, ftar: StepAllReduce) -> int | None:
        """A recovering replica's part of a round (after the exchange): in its first, load the
        small state from a source and start catching up in the background; returns the step
        the small state is at (None: not its first round, or the step failed)."""
        mine = [s.endpoints[self.ctx.rank] for s in q.sources if len(s.endpoints) > self.ctx.rank]
        if not mine:
            raise MustRestart(f"replica {self.replica_id} is behind and no replica holds the state to catch up from")
        if self.joiner is not None:
            self.joiner.set_sources(mine)
            return None
        small, error = None, ftar.error
        if not ftar.failed:
            small, error = take_small(mine[self.replica_id % len(mine)], q.round, self.ctx.env.peer_token,
                                      self.config.recovery_timeout_s)
        # Every rank of the replica starts catching up, or none does (the step again).
        if not self.ctx.all_ok(small is not None) or small is None:  # all_ok first: every rank calls it
            ftar.fail(error or "another rank of this replica could not take its source's state")
            return None
        step = apply_small(small, self.optimizer, self.state.apply_small)
        rebuild = sharding.rebuilder(sharding.mesh_of(self.model))
        self.joiner = Joiner(self.model, self.optimizer, self.ctx.env.peer_token, self.device, rebuild,
                             q.max_step, mine, self.config.recovery_timeout_s, self.config.catchup_buffer_bytes,
                             self.gate, verify=self.verify)
        log.info("replica %d rank %d catching up from step %d", self.replica_id, self.ctx.rank, step)
        return step

    def take_if_ready(self, step: int, before_swap: Callable[[], None] | None) -> None:
        """Before committing `step`: once every rank's shadow has reached it, swap it in.
        `before_swap` waits for whatever still reads the live tensors (a checkpoint's copy)."""
        if self.joiner is None:
            return
        if self.joiner.error is not None:
            raise MustRestart(f"replica {self.replica_id} could not catch up: {self.joiner.error}")
        if not self.ctx.all_ok(self.joiner.ready_at(step)):
            return
        if before_swap is not None:
            before_swap()
        self.joiner.take()
        self.joiner = None
        log.info("replica %d rank %d caught up at step %d", self.replica_id, self.ctx.rank, step)

    def record(self, step: int, update: bool) -> int:
        """At a commit while catching up: the update to replay later; returns how many are recorded."""
        assert self.joiner is not None
        self.joiner.record(record_of(step, self.optimizer, update))
        return len(self.joiner.recorded)

    def close(self) -> None:
        if self.joiner is not None:
            self.joiner.close()
