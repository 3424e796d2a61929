"""`StepCheckpoint`: the checkpoint stage of a step: who writes the checkpoint of a committed
step, and when it starts.

The members of the round that committed a step and hold its state (not those catching up)
write its checkpoint together (`Writers`, ft/checkpointing.py); the first of them is the job's
writer replica (`trainer.is_writer`), with or without checkpoints configured. A checkpoint
that is due starts when the next step begins (`start_if_due`), not at the commit: the
script's own end of a step (its `scheduler.step()` after `optimizer.step()`) has run by
then, so the checkpoint holds the state the next step starts from and a resumed run goes on
exactly where this one was. The last step's is started at close.
"""

from __future__ import annotations

from transom.coordinator.models import QuorumResponse
from transom.ft.checkpointing import Checkpoints, Writers


class StepCheckpoint:
    def __init__(self, checkpoints: Checkpoints | None, replica_id: int):
        """`checkpoints` None: no checkpoint location configured (the writers are still named)."""
        self.checkpoints, self.replica_id = checkpoints, replica_id
        self.writers: Writers | None = None  # of a checkpoint of the last committed step
        self.due: int | None = None  # a committed step whose checkpoint starts with the next step

    def check_quorum(self, max_step: int) -> None:
        """A replica that skipped its restore for a peer that held newer state goes on only
        while the quorum is not behind that checkpoint (Checkpoints.check_skipped_restore)."""
        if self.checkpoints is not None:
            self.checkpoints.check_skipped_restore(max_step)

    def wait_snapshot(self) -> None:
        """Before anything changes the state in place: the last checkpoint's copy is complete."""
        if self.checkpoints is not None:
            self.checkpoints.wait_snapshot()

    def after_commit(self, q: QuorumResponse, step: int, holds_state: bool) -> None:
        """`step` was committed by round `q`: name its writers and mark its checkpoint due."""
        holders = [m for m in q.members if m not in q.recovering]
        mine = holds_state and self.replica_id in holders
        self.writers = Writers(holders.index(self.replica_id), len(holders),
                               f"{q.store_prefix}/round{q.round}") if mine else None
        if self.writers is not None and self.checkpoints is not None and self.checkpoints.due(step):
            self.due = step

    def start_if_due(self, step: int) -> None:
        """Start the checkpoint due at `step`, the last committed step (the next one begins)."""
        if self.due is not None and self.due == step and self.writers is not None and self.checkpoints is not None:
            self.checkpoints.save(step, self.writers)
        self.due = None

    def close(self, step: int, completed: bool, failed: bool) -> None:
        """The replica leaves at `step`: a completion starts a due checkpoint of it and saves
        the final checkpoint, every rank's part written before this returns; a failure saves
        nothing, nor waits for a checkpoint in flight (an evicted replica waits until the
        fence refuses it)."""
        if completed:
            self.start_if_due(step)
        if self.checkpoints is not None:
            self.checkpoints.close(step if completed else None, self.writers, wait=not failed)
