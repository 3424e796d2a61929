"""`Commit`: the end of a step, which every rank of the replica decides the same way.

The trainer (ft/trainer.py) calls its parts in order, with the recovery's between them:

- `vote`: given the exchange's `QuorumOutcome` (ft/step_values.py), the ranks vote: the
  step counts only if every rank's gradients arrived (and, with anomaly detection, the guard
  may judge it bad on every replica: it counts without an update, ft/guard.py) -> `StepVote`;
- `apply`: a counted step steps the optimizer with its learning rate scaled for the
  replicas missing from the quorum (or hands the update to the recovery to replay later,
  while the replica catches up) and advances `step`;
- `signal`: this rank's row for the detectors;
- `record`: what the next quorum request reports (`StepRecord`) and the step's statistics;
  a failed step is discarded and runs again under the next quorum; `max_failed_steps`
  failures in a row raise.

The commit owns the committed step count and is the only caller of the wrapped
optimizer's own `step()`: a direct call by the script is refused, since it would fork
the replicas.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from transom.coordinator.models import QuorumResponse, StepReport
from transom.errors import TooManyFailedSteps, UsageError
from transom.ft.config import lr_factor, state_digest
from transom.ft.input_digest import InputDigest
from transom.ft.stats import StatsWriter
from transom.ft.step_services import StepServices
from transom.ft.step_values import QuorumOutcome, StepRecord, StepVote

log = logging.getLogger("transom.ft")


class Commit:
    def __init__(self, services: StepServices, step: int, inputs: InputDigest, stats: StatsWriter):
        """`step`: the step of the state the replica starts from."""
        self.services, self.inputs, self.stats = services, inputs, stats
        self.step = step  # committed optimizer steps
        self.last = StepRecord()  # what the next quorum request reports
        self.failed_in_a_row = 0
        self.last_step_committed = False
        self.last_batch_trained = False
        self.ended_trained = False  # the job's owner ended it after a step this replica's batch went into
        self._stepping = False
        self._step_guard = services.optimizer.register_step_pre_hook(self._refuse_direct_step)

    def start_at(self, step: int) -> None:
        """A joiner's first round took a source's small state: it trains on from that step."""
        self.step = step

    def vote(self, outcome: QuorumOutcome, loss: Any) -> StepVote:
        """The vote of the replica's ranks on the step, the same on every rank."""
        s = self.services
        s.hooks.end(self.step, s.clock.busy())
        bad, loss_value, norm = False, None, None
        with s.clock.waiting():
            if s.guard is not None:  # a bad step is applied on no replica (ft/guard.py)
                bad, loss_value, norm = s.guard.decide(loss, outcome.ftar, not outcome.recovering, s.device)
            # One collective of the replica's ranks for both: each is a wait for its slowest rank.
            committed, good = s.ctx.all_ok_each(not outcome.ftar.failed, not bad)
            skip = not good
        if committed and skip:
            log.warning("replica %d rank %d: step %d applied on no replica: a replica's loss or gradients were "
                        "not finite, or its loss spiked", s.ctx.replica_id, s.ctx.rank, self.step)
        return StepVote(committed=committed, skip=skip, loss=loss_value, norm=norm)

    def apply(self, q: QuorumResponse, before_optimizer: Callable[[], None] | None, update: bool,
              defer: Callable[[int, bool], Any] | None) -> None:
        """Step the optimizer (its learning rate scaled for missing replicas) unless `update` is
        False, and count the step. `defer(step, update)`: while the replica catches up it has no
        state to step yet: the update goes there to be replayed later (Recovery.defer)."""
        s = self.services
        factor = lr_factor(s.config.lr_scaling, q.participants, s.ctx.num_replicas)
        groups = s.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * factor
        try:
            if update and before_optimizer is not None:
                before_optimizer()
            if defer is not None:
                defer(self.step, update)
            else:
                if update:
                    self._stepping = True
                    s.optimizer.step()
                s.hooks.update(self.step, s.model)
        finally:
            self._stepping = False
            for g, lr in zip(groups, saved):
                g["lr"] = lr
        if not update:
            log.debug("replica %d: step %d committed without an update (inf/NaN gradients)", s.ctx.replica_id,
                      self.step)
        self.step += 1
        self.failed_in_a_row = 0

    def signal(self, step: int, vote: StepVote, outcome: QuorumOutcome, holds_state: bool, last: bool,
               snapshot: concurrent.futures.Future[int] | None) -> None:
        """This rank's row for the detectors: committed step `step`'s busy time, workload, loss,
        norm, and every `fingerprint_interval` steps (or at the job's `last` step) its state's
        fingerprint (ft/guard.py); where a joiner's snapshot was taken, the fingerprint that
        `snapshot` sums in the background (ft/state_print.py)."""
        s = self.services
        if s.guard is not None:
            s.guard.committed(step, s.clock.busy(), vote.loss, vote.norm, outcome.recovering,
                              outcome.quorum.serve_recovery, vote.skip,
                              (s.model, s.optimizer) if holds_state else None, s.shares.batch_share(),
                              last=last, print_later=snapshot, input_digest=self.inputs.value(step))

    def record(self, outcome: QuorumOutcome, loss: Any, vote: StepVote) -> StepRecord:
        """What the next quorum request reports, and the step's statistics; a failed step
        counts towards `max_failed_steps`."""
        q, recovering, committed = outcome.quorum, outcome.recovering, vote.committed
        s = self.services
        s.optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else loss
        seconds = s.clock.elapsed()
        report = StepReport(loss=loss_value, seconds=seconds, grad_norm=vote.norm) \
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
        if not committed:
            self.failed_in_a_row += 1
            if self.failed_in_a_row >= s.config.max_failed_steps:
                raise TooManyFailedSteps(f"{self.failed_in_a_row} failed steps in a row, last: {outcome.ftar.error}")
        return self.last

    def not_committed(self, ended_by_owner: bool) -> None:
        """The job ended before this step could count (completed elsewhere, or ended by its
        owner at the step before it): nothing of it was committed or trained on. Ended by its
        owner, the job's last step is the one before, which this replica trained or not."""
        self.services.optimizer.zero_grad(set_to_none=True)
        self.ended_trained = ended_by_owner and self.last_batch_trained
        self.last_step_committed = self.last_batch_trained = False

    def _refuse_direct_step(self, _optimizer, _args, _kwargs) -> None:
        if not self._stepping:
            raise UsageError("the optimizer given to FaultTolerant was stepped directly; step trainer.optimizer "
                             "(or call trainer.finish_step()), which steps it only for a committed step")

    def close(self, completed: bool, caught_up: bool) -> None:
        """The replica leaves: a completion records the final state's digest (not of a replica
        that has not caught up: its state is not the job's)."""
        if completed and not caught_up:
            log.warning("replica %d ends the job before it caught up: its state is not the job's",
                        self.services.ctx.replica_id)
        elif completed:
            self.stats.final(self.step, state_digest(self.services.model))
        self.stats.close()
        self._step_guard.remove()
