"""`Recovery`: the stage of a step that moves state between peers, as a source and as a joiner.

ft/catchup.py does the work (the background fetch, the shadow, the replay); this is the
step's side of it, which the trainer (ft/trainer.py) calls at three points:

- **after the quorum, before the all-reduce** (`serve`): as a source in a round that serves
  a joiner, publish the small state (kilobytes: what a joiner needs to train in step at
  once) and keep the snapshot the joiner fetches in the background (`Source`, served by
  ft/state_server.py);
- **after the exchange** (`round`): a recovering replica's part of the round. In its first,
  every rank takes the small state from a source and starts a `Joiner`, or none does and
  the step fails for all (a replica half caught up would fork); the trainer moves its step
  to the small state's. In every later round the joiner learns which sources are alive.
- **before the apply** (`before_apply`): once every rank's shadow has reached the step being
  committed, the shadow is swapped in and the replica contributes from the next round; and
  a source's snapshot copy is complete before the optimizer changes the state in place.
  While it catches up, the apply hands each committed update here (`defer`) to replay on
  the shadow later; after the apply, a source snapshots what a joiner will fetch
  (`after_commit`).

A background fetch yields the link while the step's gradients move (the services' `gate`).
"""

from __future__ import annotations

import concurrent.futures
import logging

from transom.checkpoint import sharding
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.models import QuorumResponse
from transom.errors import MustRestart
from transom.ft import wire
from transom.ft.catchup import Joiner, Source, apply_small, record_of, small_part
from transom.ft.guard import state_tensors
from transom.ft.snapshot_check import SnapshotCheck
from transom.ft.state import ReplicaState
from transom.ft.state_server import StateServer, take_small
from transom.ft.step_services import StepServices
from transom.ft.step_values import QuorumOutcome

log = logging.getLogger("transom.ft")


class Recovery:
    def __init__(self, services: StepServices, state: ReplicaState, client: CoordinatorClient):
        """With anomaly detection on, a joiner checks a snapshot against its source's
        fingerprint before using it (ft/snapshot_check.py)."""
        self.services, self.state = services, state
        ctx, config, hooks = services.ctx, services.config, services.hooks
        self.server = StateServer(ctx.env.peer_token, ctx.bind_host, ctx.env.advertise_addr,
                                  on_chunk=hooks.serve, bytes_per_s=config.recovery_bytes_per_s,
                                  refusal=services.fence.refusal)
        self.source = Source(self.server, sharding.localize, config.recovery_chunk_bytes)
        self.verify = SnapshotCheck(client, ctx.rank, services.guard is not None)
        self.joiner: Joiner | None = None

    @property
    def active(self) -> bool:
        """Catching up: no state of its own to step yet."""
        return self.joiner is not None

    @property
    def need_from(self) -> int | None:
        """The step the snapshot it waits for must have reached (the quorum request says it)."""
        return self.joiner.need_from if self.joiner is not None else None

    # --- after the quorum, before the all-reduce ------------------------------------------------
    def serve(self, q: QuorumResponse, step: int) -> None:
        """Publish what this round's joiners need, as a source."""
        if q.serve_recovery:
            self.server.publish_small(q.round, wire.encode(small_part(self.state.capture(step))))
        self.source.on_round(q.serve_recovery, q.snapshot_from)

    # --- after the exchange -------------------------------------------------------------------
    def round(self, outcome: QuorumOutcome) -> int | None:
        """A recovering replica's part of a round: in its first, load the small state from a
        source and start catching up in the background; returns the step the small state is
        at (None: not its first round, not recovering, or the step failed)."""
        if not outcome.recovering:
            if self.joiner is not None:  # a coordinator that forgot us would say so: be safe
                raise MustRestart(f"replica {self.services.ctx.replica_id} was catching up, but the quorum counts "
                                  "it caught up")
            return None
        ctx, config, q, ftar = self.services.ctx, self.services.config, outcome.quorum, outcome.ftar
        mine = [s.endpoints[ctx.rank] for s in q.sources if len(s.endpoints) > ctx.rank]
        if not mine:
            raise MustRestart(f"replica {ctx.replica_id} is behind and no replica holds the state to catch up from")
        if self.joiner is not None:
            self.joiner.set_sources(mine)
            return None
        small, error = None, ftar.error
        if not ftar.failed:
            small, error = take_small(mine[ctx.replica_id % len(mine)], q.round, ctx.env.peer_token,
                                      config.recovery_timeout_s)
        # Every rank of the replica starts catching up, or none does (the step again).
        if not ctx.all_ok(small is not None) or small is None:  # all_ok first: every rank calls it
            ftar.fail(error or "another rank of this replica could not take its source's state")
            return None
        model, optimizer = self.services.model, self.services.optimizer
        step = apply_small(small, optimizer, self.state.apply_small)
        rebuild = sharding.rebuilder(sharding.mesh_of(model))
        self.joiner = Joiner(model, optimizer, ctx.env.peer_token, self.services.device, rebuild, q.max_step, mine,
                             config.recovery_timeout_s, config.catchup_buffer_bytes, self.services.gate,
                             verify=self.verify)
        log.info("replica %d rank %d catching up from step %d", ctx.replica_id, ctx.rank, step)
        return step

    # --- around the apply ---------------------------------------------------------------------
    def before_apply(self, step: int) -> None:
        """Before committing `step` (the live state's readers are done: the trainer waited for
        a checkpoint's copy): a caught-up joiner swaps its shadow in, and a source's copy for a
        joiner is complete before the optimizer changes the state in place."""
        self._take_if_ready(step)
        self.source.before_update()

    def _take_if_ready(self, step: int) -> None:
        if self.joiner is None:
            return
        ctx = self.services.ctx
        if self.joiner.error is not None:
            raise MustRestart(f"replica {ctx.replica_id} could not catch up: {self.joiner.error}")
        if not ctx.all_ok(self.joiner.ready_at(step)):  # every rank's shadow, or none is swapped in
            return
        self.joiner.take()
        self.joiner = None
        log.info("replica %d rank %d caught up at step %d", ctx.replica_id, ctx.rank, step)

    def defer(self, step: int, update: bool) -> int:
        """A committed update this replica cannot apply yet (it catches up): replayed on the
        shadow later. Returns how many are recorded."""
        assert self.joiner is not None
        self.joiner.record(record_of(step, self.services.optimizer, update))
        recorded = len(self.joiner.recorded)
        self.services.hooks.catchup(recorded)
        return recorded

    def after_commit(self, step: int) -> None:
        """As a source: keep the snapshot of the committed state that a joiner fetches."""
        s = self.services
        self.source.after_commit(step, self.state.capture, lambda: state_tensors(s.model.parameters(), s.optimizer))

    def snapshot_print(self, step: int) -> concurrent.futures.Future[int] | None:
        return self.source.snapshot_print(step)

    def close(self) -> None:
        if self.joiner is not None:
            self.joiner.close()
        self.source.close()
        self.server.close()
