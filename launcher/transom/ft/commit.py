"""`Commit`: the end of a step, which every rank of the replica decides the same way.

Given the exchange's `QuorumOutcome` (ft/step_values.py), the ranks vote: the step
counts only if every rank's gradients arrived (and, with anomaly detection, the guard
may judge it bad on every replica: it counts without an update, ft/guard.py). A counted
step steps the optimizer with its learning rate scaled for the replicas missing from the
quorum (or records the update, while the replica catches up: ft/recovery.py), advances
`step`, and marks the checkpoint that is due, written by the members that hold the state;
it starts when the next step begins (`save_if_due`), once the script's end of the step
(its LR scheduler) has run, or at close for the last step. A failed step is discarded and
runs again under the next quorum; `max_failed_steps` failures in a row raise.

The commit owns the committed step count and is the only caller of the wrapped
optimizer's own `step()`: a direct call by the script is refused, since it would fork
the replicas.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from transom.coordinator.models import QuorumResponse, StepReport
from transom.errors import TooManyFailedSteps, UsageError
from transom.ft.checkpointing import Checkpoints, Writers
from transom.ft.config import FTConfig, lr_factor, state_digest
from transom.ft.guard import Guard
from transom.ft.hooks import StepHooks
from transom.ft.input_digest import InputDigest
from transom.ft.recovery import Recovery
from transom.ft.replica import ReplicaContext
from transom.ft.shares import BatchShares
from transom.ft.stats import StatsWriter
from transom.ft.step_clock import StepClock
from transom.ft.step_values import QuorumOutcome, StepRecord, StepVote

log = logging.getLogger("transom.ft")


class Commit:
    def __init__(self, ctx: ReplicaContext, config: FTConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, step: int, recovery: Recovery, checkpoints: Checkpoints | None,
                 guard: Guard | None, clock: StepClock, shares: BatchShares, inputs: InputDigest,
                 stats: StatsWriter, hooks: StepHooks):
        """`step`: the step of the state the replica starts from."""
        self.ctx, self.config, self.model, self.optimizer, self.device = ctx, config, model, optimizer, device
        self.recovery, self.checkpoints, self.guard, self.clock = recovery, checkpoints, guard, clock
        self.shares, self.inputs, self.stats, self.hooks = shares, inputs, stats, hooks
        self.step = step  # committed optimizer steps
        self.last = StepRecord()  # what the next quorum request reports
        self.failed_in_a_row = 0
        self.writers: Writers | None = None  # of a checkpoint of the last committed step
        self.save_due: int | None = None  # a committed step whose checkpoint starts with the next step
        self.target: int | None = None  # the job's last step (steps()): always fingerprinted
        self.last_step_committed = False
        self.last_batch_trained = False
        self.ended_trained = False  # the job's owner ended it after a step this replica's batch went into
        self._stepping = False
        self._step_guard = optimizer.register_step_pre_hook(self._refuse_direct_step)

    def finish(self, outcome: QuorumOutcome, loss: Any, before_optimizer: Callable[[], None] | None,
               update: bool) -> bool:
        """Vote on the step and apply it if it counts; True if committed. `update` False:
        count a committed step without stepping the optimizer (the AMP scaler found inf/NaN)."""
        q, attempted = outcome.quorum, self.step
        self.hooks.end(attempted, self.clock.busy())
        verdict = self._vote(outcome, loss)
        if self.checkpoints is not None:
            self.checkpoints.check_skipped_restore(q.max_step)
        if verdict.committed:
            self.recovery.take_if_ready(self.step, self.checkpoints.wait_snapshot if self.checkpoints else None)
            if verdict.skip:
                log.warning("replica %d rank %d: step %d applied on no replica: a replica's loss or gradients were "
                            "not finite, or its loss spiked", self.ctx.replica_id, self.ctx.rank, attempted)
            self._apply(q, before_optimizer, update and not verdict.skip)
            self._signal(attempted, verdict, outcome.recovering, q.serve_recovery)
        else:
            self.failed_in_a_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._record(outcome, loss, verdict)
        if self.failed_in_a_row >= self.config.max_failed_steps:
            raise TooManyFailedSteps(f"{self.failed_in_a_row} failed steps in a row, last: {outcome.ftar.error}")
        return verdict.committed

    def not_committed(self, ended_by_owner: bool) -> None:
        """The job ended before this step could count (completed elsewhere, or ended by its
        owner at the step before it): nothing of it was committed or trained on. Ended by its
        owner, the job's last step is the one before, which this replica trained or not."""
        self.optimizer.zero_grad(set_to_none=True)
        self.ended_trained = ended_by_owner and self.last_batch_trained
        self.last_step_committed = self.last_batch_trained = False

    def _vote(self, outcome: QuorumOutcome, loss: Any) -> StepVote:
        skip, loss_value, norm = False, None, None
        with self.clock.waiting():
            if self.guard is not None:  # a bad step is applied on no replica (ft/guard.py)
                skip, loss_value, norm = self.guard.decide(loss, outcome.ftar, self.ctx, not outcome.recovering,
                                                           self.device)
            committed = self.ctx.all_ok(not outcome.ftar.failed)  # the vote of the replica's ranks
        return StepVote(committed=committed, skip=skip, loss=loss_value, norm=norm)

    def _apply(self, q: QuorumResponse, before_optimizer: Callable[[], None] | None, update: bool) -> None:
        """Step the optimizer (its learning rate scaled for missing replicas) unless `update`
        is False, count the step, and start the checkpoint that is due."""
        if self.checkpoints is not None:
            self.checkpoints.wait_snapshot()  # the last checkpoint's copy must be complete
        self.recovery.before_update()  # and the copy a joiner will fetch
        factor = lr_factor(self.config.lr_scaling, q.participants, self.ctx.num_replicas)
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * factor
        try:
            if update and before_optimizer is not None:
                before_optimizer()
            if self.recovery.active:  # no state to step yet: the update is replayed later
                self.recovery.record(self.step, update)
            else:
                if update:
                    self._stepping = True
                    self.optimizer.step()
                self.hooks.update(self.step, next(self.model.parameters()))
        finally:
            self._stepping = False
            for g, lr in zip(groups, saved):
                g["lr"] = lr
        if not update:
            log.debug("replica %d: step %d committed without an update (inf/NaN gradients)", self.ctx.replica_id,
                      self.step)
        self.step += 1
        self.failed_in_a_row = 0
        self.recovery.after_commit(self.step)
        self._checkpoint(q)

    def _checkpoint(self, q: QuorumResponse) -> None:
        # The members that hold the state of this step (not those catching up) write its
        # checkpoint together.
        holders = [m for m in q.members if m not in q.recovering]
        mine = not self.recovery.active and self.ctx.replica_id in holders
        self.writers = Writers(holders.index(self.ctx.replica_id), len(holders),
                               f"{q.store_prefix}/round{q.round}") if mine else None
        if self.writers is not None and self.checkpoints is not None and self.checkpoints.due(self.step):
            self.save_due = self.step  # taken when the next step begins (save_if_due)

    def save_if_due(self) -> None:
        """Start the checkpoint due at the last committed step. Called when the next step
        begins, not at the commit: the script's own end of a step (its `scheduler.step()`
        after `optimizer.step()`) has run by then, so the checkpoint holds the state the next
        step starts from and a resumed run goes on exactly where this one was."""
        if self.save_due is not None and self.save_due == self.step and self.writers is not None \
                and self.checkpoints is not None:
            self.checkpoints.save(self.step, self.writers)
        self.save_due = None

    def _signal(self, step: int, verdict: StepVote, recovering: bool, serving: bool) -> None:
        """This rank's row for the detectors: a committed step's busy time, workload, loss, norm,
        and every `fingerprint_interval` steps its parameters' fingerprint (ft/guard.py)."""
        if self.guard is not None:
            self.guard.committed(step, self.clock.busy(), verdict.loss, verdict.norm, recovering, serving,
                                 verdict.skip, None if self.recovery.active else (self.model, self.optimizer),
                                 self.shares.batch_share(),
                                 snapshot=self.recovery.snapshot_taken_at(step + 1) or step + 1 == self.target,
                                 input_digest=self.inputs.value(step))

    def _record(self, outcome: QuorumOutcome, loss: Any, verdict: StepVote) -> None:
        """What the next quorum request reports, and the step's statistics."""
        q, recovering, committed = outcome.quorum, outcome.recovering, verdict.committed
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else loss
        seconds = self.clock.elapsed()
        report = StepReport(loss=loss_value, seconds=seconds, grad_norm=verdict.norm) \
            if committed and not recovering else None
        self.last = StepRecord(failed=not committed, report=report,
                               commit_quorum_id=q.quorum_id if committed else self.last.commit_quorum_id)
        # Whether this replica's batch went into a committed step: not while it recovers
        # (it contributes zeros) nor when the step failed (the batch comes again).
        self.last_step_committed = committed
        self.last_batch_trained = committed and not recovering
        self.stats.step(
            step=self.step, committed=committed, seconds=round(seconds, 6), quorum_id=q.quorum_id,
            quorum_changed=outcome.changed, recovering=recovering, participants=q.participants, members=len(q.members),
            loss=report.loss if report else None, error=outcome.ftar.error, t=time.time(),
        )

    def _refuse_direct_step(self, _optimizer, _args, _kwargs) -> None:
        if not self._stepping:
            raise UsageError("the optimizer given to FaultTolerant was stepped directly; step trainer.optimizer "
                             "(or call trainer.finish_step()), which steps it only for a committed step")

    def close(self, completed: bool, failed: bool) -> None:
        """The replica leaves: a completion records the final state's digest and saves the
        final checkpoint, every rank's part of it written before this returns; a failure
        saves nothing, nor waits for a checkpoint in flight."""
        if completed and self.recovery.active:
            log.warning("replica %d ends the job before it caught up: its state is not the job's", self.ctx.replica_id)
        elif completed:
            self.stats.final(self.step, state_digest(self.model))
        self.stats.close()
        if self.guard is not None:
            self.guard.close()
        if completed:  # a due checkpoint of the last step (a failure's state is not saved)
            self.save_if_due()
        if self.checkpoints is not None:  # before leaving: the commit is reported as this replica
            # An evicted replica waits until the fence refuses it.
            self.checkpoints.close(self.step if completed else None, self.writers, wait=not failed)
        if completed:  # the leader leaves once every rank's part is written: a left replica's writes are fenced
            self.ctx.all_ok(True)
        self._step_guard.remove()
