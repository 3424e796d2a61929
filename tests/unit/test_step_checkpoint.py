"""The checkpoint stage of a step (ft/step_checkpoint.py): who writes a committed step's
checkpoint, and that it starts only when the next step begins."""

from __future__ import annotations

from transom.coordinator.models import QuorumResponse
from transom.ft.checkpointing import Writers
from transom.ft.step_checkpoint import StepCheckpoint


class Saves:
    """Checkpoints' calls the stage makes, recorded (every 10th step is due)."""

    def __init__(self):
        self.saved: list[tuple[int, Writers]] = []
        self.closed: list[tuple[int | None, Writers | None, bool]] = []

    def due(self, step: int) -> bool:
        return step % 10 == 0

    def save(self, step: int, writers: Writers) -> bool:
        self.saved.append((step, writers))
        return True

    def close(self, final_step: int | None, writers: Writers | None, wait: bool = True) -> None:
        self.closed.append((final_step, writers, wait))


def quorum(members: list[int], recovering: list[int], round_: int = 7) -> QuorumResponse:
    return QuorumResponse(round=round_, quorum_id=3, members=members, rank=0, store_addr="127.0.0.1:1",
                          store_prefix="job/q3", max_step=9, participants=len(members) - len(recovering),
                          recovering=recovering, serve_recovery=False)


def test_the_holders_of_the_state_write_and_the_checkpoint_starts_with_the_next_step():
    saves = Saves()
    stage = StepCheckpoint(saves, replica_id=2)
    stage.after_commit(quorum([0, 1, 2], recovering=[1]), 10, holds_state=True)
    assert stage.writers == Writers(replica_rank=1, num_members=2, attempt="job/q3/round7")  # 1 catches up
    assert saves.saved == []  # not at the commit: the script's scheduler.step() has not run yet
    stage.start_if_due(10)
    assert saves.saved == [(10, stage.writers)]
    stage.start_if_due(10)
    assert len(saves.saved) == 1  # once


def test_a_replica_catching_up_writes_nothing_and_a_step_not_due_is_not_saved():
    saves = Saves()
    stage = StepCheckpoint(saves, replica_id=1)
    stage.after_commit(quorum([0, 1], recovering=[1]), 10, holds_state=False)
    assert stage.writers is None
    stage.start_if_due(10)
    stage = StepCheckpoint(saves, replica_id=0)
    stage.after_commit(quorum([0, 1], recovering=[]), 11, holds_state=True)
    stage.start_if_due(11)
    assert saves.saved == [] and stage.writers is not None


def test_a_completion_starts_the_due_checkpoint_and_a_failure_does_not_wait():
    saves = Saves()
    stage = StepCheckpoint(saves, replica_id=0)
    stage.after_commit(quorum([0], recovering=[]), 20, holds_state=True)
    stage.close(20, completed=True, failed=False)
    assert saves.saved == [(20, stage.writers)] and saves.closed == [(20, stage.writers, True)]
    failing = Saves()
    stage = StepCheckpoint(failing, replica_id=0)
    stage.after_commit(quorum([0], recovering=[]), 30, holds_state=True)
    stage.close(30, completed=False, failed=True)
    assert failing.saved == [] and failing.closed == [(None, stage.writers, False)]


def test_without_a_checkpoint_location_the_writer_replica_is_still_named():
    stage = StepCheckpoint(None, replica_id=0)
    stage.after_commit(quorum([0, 1], recovering=[]), 10, holds_state=True)
    stage.start_if_due(10)
    stage.close(10, completed=True, failed=False)
    assert stage.writers is not None and stage.writers.replica_rank == 0  # trainer.is_writer_replica
