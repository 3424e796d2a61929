"""Checkpoints of a FaultTolerant training loop: what is saved, who writes what, and restore.

FaultTolerant owns one `Checkpoints` when a checkpoint URI is configured (the pod's
TRANSOM_CHECKPOINT_URI, or `CheckpointConfig(uri=...)` from the script). The saved state
is the replica's `ReplicaState` (ft/state.py: step, model, optimizer, GradScaler, sampler,
extra state, RNG), the same dict a peer serves a recovering replica.

Who writes: replica k of a quorum of R takes part of every checkpoint (layout.Slot): with
FSDP2 (DTensor state) rank r of each replica writes a share of shard r; otherwise every
rank of every replica writes a share of the one shard. The replica at quorum rank 0's
rank 0 commits and reports the step to the coordinator, once every part's writer reported the
same fingerprint of its parameters and optimizer state as the other writers of its shard:
replicas that diverged are never assembled into one checkpoint (checkpoint/persist.py). The writers of a checkpoint are
the members of the quorum round that committed its step, and that round names their
attempt (`Writers`), so parts of another round or another run are never mixed in.

Fencing: with the replica's fence (ft/fencing.py), every object the engine writes or
deletes is confirmed with the coordinator first, so an incarnation that was replaced writes
nothing more; a restore only reads and asks nothing.

One job per location: before anything is restored or written, the replica's leader makes
sure the location belongs to this job (checkpoint/owner.py: its job record names this job's
name and uid, or none did and now this job's does). Where it belongs to another job, every
rank raises CheckpointLocationTaken, which ends the job (a ScriptError).

Restore, at start: every rank of a replica tries the same committed steps, newest first,
and they agree (a vote on the replica's control group) on the newest one every rank could
verify. A replica that joins peers already past the newest checkpoint (a replacement while
the job trains) skips the restore: it recovers their newer state at its first quorum
anyway, and reading the checkpoint would only delay its rejoin.
Should those peers be gone by then, the trainer raises and the next incarnation restores.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transom.checkpoint import layout, owner, sharding
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine
from transom.checkpoint.restore import NoCheckpoint, committed_steps, load_newest
from transom.checkpoint.storage import Storage, retry
from transom.errors import CheckpointLocationTaken, MustRestart
from transom.ft.guard import fingerprint, state_tensors
from transom.ft.replica import ReplicaContext
from transom.ft.state import ReplicaState
from transom.job_identity import JobIdentity

log = logging.getLogger("transom.ft")


@dataclass(frozen=True)
class Writers:
    """Who writes a checkpoint: this replica's rank in the quorum round that committed the step,
    the round's size, and the attempt id every member of that round derives from it."""

    replica_rank: int
    num_members: int
    attempt: str


class Checkpoints:
    def __init__(self, config: CheckpointConfig, ctx: ReplicaContext, state: ReplicaState,
                 on_commit: Callable[[int, str], None] | None = None, fence: Callable[[str, str], None] | None = None,
                 before_persist: Callable[[int], None] | None = None):
        """`fence(action, what)`: may this incarnation write now (IncarnationFence.confirm);
        `before_persist(step)`: the step hooks' `checkpoint` point, in the engine's thread (ft/hooks.py)."""
        self.config, self.ctx, self.replica_state = config, ctx, state
        self.model = state.model
        self.sharded = sharding.is_sharded(state.model.state_dict())
        self.engine = CheckpointEngine(config, on_commit=on_commit, fence=fence, before_persist=before_persist)
        self.last_saved: int | None = None
        self.skipped_restore_of: int | None = None  # newest checkpoint not restored: a peer was ahead

    def due(self, step: int) -> bool:
        return self.engine.due(step) and step != self.last_saved

    def save(self, step: int, writers: Writers) -> bool:
        """Start checkpoint `step` (returns at once; False if skipped because one is persisting)."""
        slot = layout.Slot.of(writers.replica_rank, writers.num_members, self.ctx.rank, self.ctx.world_size,
                              self.sharded)
        state = self.replica_state
        digest = fingerprint(state_tensors(state.model.parameters(), state.optimizer))
        started = self.engine.save(step, state.capture(step), slot, writers.attempt, digest)
        if started:  # a skipped step may still be saved by close()
            self.last_saved = step
        return started

    def wait_snapshot(self) -> None:
        """Before anything changes the state in place (optimizer.step, loading a peer's state)."""
        self.engine.wait_snapshot()

    def restore(self, coordinator: Callable[[], tuple[int | None, int | None]] | None = None) -> int | None:
        """Load the newest checkpoint every rank of this replica can verify; its step, or None.
        CheckpointLocationTaken, before anything is read, where the location is another job's.

        `coordinator` (the leader's): the newest step a live peer holds and the newest
        checkpoint the coordinator recorded committed, each None if unknown.
        """
        storage = self.engine.storage
        plan = None
        if self.ctx.is_leader:
            refused = self._claim_location()
            steps = self._list_committed() if refused is None else []
            ahead, recorded = coordinator() if coordinator is not None and steps else (None, None)
            if recorded is not None and recorded not in steps and (not steps or recorded > steps[0]):
                log.error("checkpoint step %d was committed (the coordinator recorded it) but %s has no manifest "
                          "for it: it is lost", recorded, storage.url(layout.step_dir(recorded)))
            # Strictly ahead: peers that restored the same step (a whole job starting again) do
            # not count, since recovering costs the first step this replica's gradients.
            plan = (refused, steps, ahead is not None and ahead > steps[0])
        refused, steps, peer_is_ahead = self.ctx.from_leader(plan)
        if refused is not None:  # every rank raises it: the job ends (a ScriptError), nothing is read or written
            self.engine.close(0.0)
            raise CheckpointLocationTaken(refused)
        if peer_is_ahead:
            self.skipped_restore_of = steps[0]
            log.warning("replica %d rank %d: a live peer is past step %d; recovering from it instead of "
                        "restoring the checkpoint", self.ctx.replica_id, self.ctx.rank, steps[0])
            return None
        num_shards = self.ctx.world_size if self.sharded else 1
        rebuild = sharding.rebuilder(sharding.mesh_of(self.model))
        try:
            restored = load_newest(storage, steps, self.ctx.device, self.ctx.rank, num_shards, rebuild,
                                   agree=self.ctx.all_ok, use=self._apply)
        except NoCheckpoint as e:
            if steps:
                log.error("replica %d rank %d: %s; starting from step 0", self.ctx.replica_id, self.ctx.rank, e)
            return None
        self.last_saved = restored.step
        log.info("replica %d rank %d restored checkpoint step %d", self.ctx.replica_id, self.ctx.rank, restored.step)
        return restored.step

    def check_skipped_restore(self, max_step: int) -> None:
        """A replica that skipped its restore for a peer that held newer state must not go on
        if that peer is gone and the quorum (at `max_step`) is behind the checkpoint."""
        newest = self.skipped_restore_of
        if newest is None:
            return
        if max_step < newest:  # the peer we counted on is gone: start over and restore
            raise MustRestart(f"replica {self.ctx.replica_id} skipped restoring checkpoint step {newest} for a "
                              f"peer that held it, but the quorum is at step {max_step}; restarting to restore")
        self.skipped_restore_of = None

    def _apply(self, state: Any) -> None:
        """Load a checkpoint's state into the live objects (raises if they do not take it)."""
        if isinstance(state, dict) and "step" not in state:  # saved by the engine directly
            state = {**state, "step": 0}
        self.replica_state.apply(state)

    def _claim_location(self) -> str | None:
        """Why this job may not use the checkpoint location (another job's, owner.py), or None
        once the location is recorded as this job's. A process without a job identity (run by
        hand, a test's replicas) claims nothing. Storage that is away is waited for, as for the
        listing. The record is not fenced: it is written before this incarnation registers,
        only where none is, and every incarnation of the job would write the same identity."""
        mine = JobIdentity.of(self.ctx.env)
        if mine is None:
            return None
        deadline = time.monotonic() + self.config.restore_timeout_s
        try:
            owner.claim(Storage(self.config.uri, **self.config.storage_options), mine,
                        stopped=lambda: time.monotonic() > deadline)
        except CheckpointLocationTaken as e:
            return str(e)
        return None

    def _list_committed(self) -> list[int]:
        """Committed steps, newest first. Storage that is away is waited for (restore_timeout_s):
        starting from step 0 beside a checkpoint that exists would throw its steps away."""
        deadline = time.monotonic() + self.config.restore_timeout_s
        return retry("listing checkpoints", lambda: committed_steps(self.engine.storage)[0],
                     stopped=lambda: time.monotonic() > deadline, first_s=0.5, max_s=5.0)

    def close(self, final_step: int | None, writers: Writers | None, wait: bool = True) -> None:
        """Save `final_step` if it is not saved yet (None: no final checkpoint; `writers` of the
        round that committed it), wait for the checkpoint in flight up to close_timeout_s (not
        at all without `wait`: a failing replica must not hold its restart back), and stop the
        engine's thread."""
        budget = self.config.close_timeout_s if wait else 0.0
        deadline = time.monotonic() + budget
        if final_step is not None and writers is not None and self.config.save_on_close \
                and final_step != self.last_saved:
            self.engine.wait_persisted(budget)
            self.save(final_step, writers)
        self.engine.close(max(0.0, deadline - time.monotonic()))  # one budget for both waits
