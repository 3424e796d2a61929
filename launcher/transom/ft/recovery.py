"""`Recovery`: a replica's part in moving state between peers, as a source and as a joiner.

As a source it runs the state server (ft/state_server.py) and its `Source` (ft/catchup.py):
in a round that serves a joiner it publishes the small state before the all-reduce, and
after every commit it keeps the snapshot a joiner fetches. As a joiner it drives `Rejoin`
(ft/rejoin.py): after the exchange of a round it is recovering in, it takes a source's
small state (the trainer moves its step there), catches up in the background, records
each committed update it cannot apply yet, and swaps the caught-up state in once every
rank's shadow has reached the step being committed.

The link gate is shared with the exchange: a background fetch yields the link while the
step's gradients move.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from transom.checkpoint import sharding
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.models import QuorumResponse
from transom.errors import MustRestart
from transom.ft import wire
from transom.ft.catchup import Source, small_part
from transom.ft.config import FTConfig
from transom.ft.fencing import IncarnationFence
from transom.ft.hooks import StepHooks
from transom.ft.rejoin import Rejoin
from transom.ft.replica import ReplicaContext
from transom.ft.snapshot_check import SnapshotCheck
from transom.ft.state import ReplicaState
from transom.ft.state_server import StateServer
from transom.ft.step_values import QuorumOutcome
from transom.ft.transfer import LinkGate


class Recovery:
    def __init__(self, ctx: ReplicaContext, config: FTConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: ReplicaState, device: torch.device, fence: IncarnationFence, client: CoordinatorClient,
                 check_snapshots: bool, hooks: StepHooks):
        """`check_snapshots`: a joiner checks a snapshot against its source's fingerprint before
        using it (ft/snapshot_check.py; with anomaly detection on)."""
        env = ctx.env
        self.ctx, self.state, self.hooks = ctx, state, hooks
        self.server = StateServer(env.peer_token, ctx.bind_host, env.advertise_addr,
                                  on_chunk=hooks.serve, bytes_per_s=config.recovery_bytes_per_s,
                                  refusal=fence.refusal)
        self.source = Source(self.server, sharding.localize, config.recovery_chunk_bytes)
        self.gate = LinkGate(config.recovery_yields)  # busy while gradients move
        self.rejoin = Rejoin(ctx, ctx.replica_id, config, model, optimizer, state, device, self.gate,
                             SnapshotCheck(client, ctx.rank, check_snapshots))

    @property
    def active(self) -> bool:
        """Catching up: no state of its own to step yet."""
        return self.rejoin.active

    @property
    def need_from(self) -> int | None:
        return self.rejoin.need_from

    # --- as a source ------------------------------------------------------------------------------
    def serve(self, q: QuorumResponse, step: int) -> None:
        """A round's quorum is in (before its all-reduce): publish what its joiners need."""
        if q.serve_recovery:  # kilobytes: what a joiner needs to train in step at once
            self.server.publish_small(q.round, wire.encode(small_part(self.state.capture(step))))
        self.source.on_round(q.serve_recovery, q.snapshot_from)

    def before_update(self) -> None:
        """Before the optimizer changes the state in place: the copy a joiner fetches is complete."""
        self.source.before_update()

    def after_commit(self, step: int) -> None:
        self.source.after_commit(step, self.state.capture)

    def snapshot_taken_at(self, step: int) -> bool:
        return self.source.snapshot_taken_at(step)

    # --- as a joiner ------------------------------------------------------------------------------
    def round(self, outcome: QuorumOutcome) -> int | None:
        """After a round's exchange: the step of the small state taken in a recovering
        replica's first round (None otherwise, or if the step failed)."""
        if outcome.recovering:
            return self.rejoin.round(outcome.quorum, outcome.ftar)
        if self.rejoin.active:  # a coordinator that forgot us would say so: be safe
            raise MustRestart(f"replica {self.ctx.replica_id} was catching up, but the quorum counts it caught up")
        return None

    def take_if_ready(self, step: int, before_swap: Callable[[], None] | None) -> None:
        self.rejoin.take_if_ready(step, before_swap)

    def record(self, step: int, update: bool) -> None:
        """A committed update this replica cannot apply yet: replayed on the shadow later."""
        self.hooks.catchup(self.rejoin.record(step, update))

    def close(self) -> None:
        self.rejoin.close()
        self.source.close()
        self.server.close()
