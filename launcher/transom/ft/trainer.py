"""`FaultTolerant`, the training-script API: a few lines around an existing loop make it fault tolerant.

    ctx = ft.init()                                  # the replica's own world, if any
    loader = DataLoader(ds, batch_size=32, sampler=ft.ReplicaSampler(ds, ctx))
    model = build_model().to(ctx.device)             # identical init on every replica (seed)
    if ctx.world_size > 1: model = DDP(model)        # or FSDP2, inside the replica
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    with ft.FaultTolerant(model, opt, ctx) as trainer:
        optimizer = trainer.optimizer                # the same optimizer, wrapped
        for step, (x, y) in trainer.batches(loader, num_steps):   # asks for the step's quorum
            loss = loss_fn(model(x), y)
            loss.backward()                          # at its end: FTAR across replicas
            optimizer.step()                         # the vote; steps only a committed step
            optimizer.zero_grad()

`FaultTolerant` is a thin facade that names the stages of a step in order; each is a
module of its own that returns a typed value (ft/step_values.py), and none calls another.
What they share (context, settings, model, optimizer, guard, clock, batch shares, link
gate, fence) is one `StepServices` (ft/step_services.py):

    begin_step      checkpoint.start_if_due   the last step's checkpoint (ft/step_checkpoint.py)
                    exchange.begin            the quorum request, sent with the first forward pass
    backward()      exchange.quorum           the quorum; a changed one rebuilds the group (ft/exchange.py)
                    recovery.serve            a source publishes a joiner's small state (ft/recovery.py)
                    exchange.start/finish     the all-reduce of the gradients -> QuorumOutcome
                    recovery.round            a joiner takes a source's small state; the step moves there
    step()          commit.vote               every rank's vote (ft/commit.py) -> StepVote
                    recovery.before_apply     a caught-up joiner swaps in; a source's copy is complete
                    commit.apply              LR scaling, optimizer step (or recovery.defer), step += 1
                    checkpoint.after_commit   who writes this step's checkpoint, and whether it is due
                    commit.record             -> StepRecord, which the next request reports

The script-facing aids (`steps()`, `batches()`, `aside()`, `no_sync()`, `generator()`,
`is_writer`, ...) are a `LoopAids` (ft/loop_aids.py) that the trainer holds and names below.

Fault injection (TRANSOM_FAULT) reaches the step only through `hooks` (ft/hooks.py), a
no-op in production.

One step, as the replica's leader sees it: the quorum request leaves with the step's first
forward pass (and overlaps it) and is awaited at the end of the backward pass
(ft/backward.py), where a changed quorum rebuilds the cross-replica group and the
gradients are averaged over the participants. A replica that joins sends zeros, takes a
source's small state and catches up in the background while it trains in step; nobody
waits for it (ft/catchup.py). Whatever the
script does next (clipping, `GradScaler.unscale_`) sees the averaged gradients. Then
`optimizer.step()` (ft/optimizer.py), or the lower-level `finish_step()`, ends the step:
every rank of the replica votes, and the optimizer steps only if all succeeded. A failed
step is discarded and the same step runs again under the next quorum; `max_failed_steps`
failures in a row raise. Both ends share `_finish`.

The replica's state (ft/state.py: model, optimizer, GradScaler, sampler, extra state, RNG)
is one dict for peer recovery and checkpoints. With a checkpoint URI
(TRANSOM_CHECKPOINT_URI, or `checkpoint=CheckpointConfig(...)`), the trainer restores the
newest checkpoint when it starts, snapshots the state of every `interval_steps`-th
committed step when the next step begins, after the script's own end of the step (its
`scheduler.step()`), so a checkpoint of step N holds what step N+1 starts from (the host
copy overlaps the next forward/backward and is awaited before the next optimizer step), and
saves the final step in `close()` (ft/checkpointing.py).

An incarnation the coordinator no longer counts (superseded, declared failed) commits no
step, writes no checkpoint object and serves no state (ft/fencing.py).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from transom import script_errors
from transom.checkpoint.engine import CheckpointConfig
from transom.contract import ENV_DETECTION, ENV_STATS_DIR
from transom.coordinator.client import CoordinatorClient, credential
from transom.coordinator.models import Identity
from transom.detect.step_rows import DetectionSettings
from transom.errors import UsageError
from transom.ft import backend as placement
from transom.ft import hooks, inner_reduction
from transom.ft.backward import GradientsReady
from transom.ft.checkpointing import Checkpoints
from transom.ft.commit import Commit
from transom.ft.config import FTConfig, Stateful, model_device, scales
from transom.ft.coordinator_link import coordinator_view, leave_request, register, report_close_failure, report_failure
from transom.ft.exchange import Exchange
from transom.ft.fencing import IncarnationFence
from transom.ft.guard import Guard, signals_dir
from transom.ft.input_digest import InputDigest
from transom.ft.loop_aids import LoopAids, LoopFlags
from transom.ft.optimizer import FTOptimizer
from transom.ft.process_group import QuorumGroups, ReplicaSlices
from transom.ft.recovery import Recovery
from transom.ft.replica import ReplicaContext, init
from transom.ft.script_state import bundle
from transom.ft.shared_values import SharedValues
from transom.ft.shares import BatchShares
from transom.ft.state import ReplicaState
from transom.ft.stats import StatsWriter
from transom.ft.step_checkpoint import StepCheckpoint
from transom.ft.step_clock import StepClock
from transom.ft.step_services import StepServices
from transom.ft.step_values import QuorumOutcome
from transom.ft.transfer import LinkGate
from transom.ft.trouble_board import ReplicaTrouble

log = logging.getLogger("transom.ft")


def _placement(model: torch.nn.Module, config: FTConfig, ctx: ReplicaContext) -> tuple[torch.device, str]:
    """The device of the gradients and the cross-replica backend. The gradients live where
    the model's parameters are; that, not what the machine has, decides the backend. A
    forced nccl that cannot work is refused here, before anything starts (BackendError
    says what to change)."""
    device = model_device(model)
    backend = config.backend or ctx.backend
    placement.cross_replica(backend, tensor_device=device.type, member_gpus=[])
    return device, backend


def _aid(name: str) -> Any:
    """A member of the trainer that is its LoopAids' (ft/loop_aids.py), docstring and all."""
    member = getattr(LoopAids, name)
    if isinstance(member, property):
        return property(lambda self: getattr(self._aids, name), doc=member.__doc__)

    @functools.wraps(member)
    def call(self, *args, **kwargs):
        return getattr(self._aids, name)(*args, **kwargs)
    return call


class FaultTolerant:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        ctx: ReplicaContext | None = None,
        *,
        scaler: Stateful | None = None,
        sampler: Stateful | None = None,
        extra_state: Stateful | Mapping[str, Stateful] | None = None,
        config: FTConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        start_step: int = 0,
    ):
        """`scaler`: the AMP GradScaler, if the script uses one (its scale is replica state);
        `sampler`: the ft.ReplicaSampler (`batches()` adds its loader's); `extra_state`:
        anything else with state_dict()/load_state_dict() (an LR scheduler), or a dict of
        such objects and `ft.ScriptState`s. `checkpoint` None: from the pod environment (no
        checkpoints without a URI there). `start_step`: the step of the state the script
        loaded itself (its own checkpoint), where the job starts if no Transom checkpoint is
        restored."""
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise UsageError(f"start_step must be a non-negative integer, got {start_step!r}")
        self.ctx = ctx or init()
        self.model, self.extra_state = model, bundle(extra_state)
        self.optimizer = FTOptimizer(optimizer, self._finish)
        """The script's optimizer, wrapped: its step() ends the fault-tolerant step (ft/optimizer.py)."""
        self.config = config or FTConfig.from_environ()
        self.device, backend = _placement(model, self.config, self.ctx)
        # A hot spare waits here, loaded, until it is given a replica to take over.
        spare_id = self.ctx.env.spare_id
        self.ctx.wait_for_promotion()
        promoted_at = time.monotonic()
        env = self.ctx.env
        self.identity = Identity(replica_id=env.replica_id, generation=env.generation, attempt=env.attempt)
        self.client = CoordinatorClient(env.coordinator_url, credential(env.identity_token_file, env.coordinator_token))
        self.fence = IncarnationFence(self.client, self.identity)  # may this incarnation still act?
        self.state = ReplicaState(model, optimizer, self.device, scaler=scaler, sampler=sampler, extra=self.extra_state)
        self._shared = SharedValues(self.extra_state)  # script values set aside, for every replica
        self.state.on_applied = self._shared.reapply
        self._flags = LoopFlags()
        # Before anything can fail: an incarnation refused at its restore still leaves its record.
        self.stats = StatsWriter(os.environ.get(ENV_STATS_DIR), env.replica_id, env.generation, env.attempt,
                                 self.ctx.rank)
        self._closed = False
        self._services = self._build_services(optimizer, gradients_judged=not scales(scaler))
        self._build_stages(checkpoint, start_step, backend)
        # An uncaught exception ends this worker, but interpreter teardown can take seconds
        # while peers sit in a collective with us: report and close our sockets first.
        self._uncaught = _ReportUncaught(self)
        log.info("replica %d rank %d joined (generation %d attempt %d)", env.replica_id, self.ctx.rank,
                 env.generation, env.attempt)
        if spare_id is not None:
            log.info("spare %d took over replica %d: registered %.2fs after its promotion", spare_id, env.replica_id,
                     time.monotonic() - promoted_at)

    def _build_services(self, optimizer: torch.optim.Optimizer, gradients_judged: bool) -> StepServices:
        """What the stages share. Anomaly detection (spec.detection): the step guard and this
        rank's signals (ft/guard.py); fault injection (TRANSOM_FAULT): the step hooks."""
        env = self.ctx.env
        self.detection = DetectionSettings.from_spec(os.environ.get(ENV_DETECTION))
        guard = Guard(self.detection, signals_dir(), env.replica_id, env.generation, env.attempt, self.ctx.rank,
                      gradients_judged=gradients_judged) if self.detection.enabled else None
        return StepServices(ctx=self.ctx, config=self.config, model=self.model, optimizer=optimizer,
                            device=self.device, hooks=hooks.for_replica(env, self.ctx.rank), guard=guard,
                            clock=StepClock(guard), shares=BatchShares(self.ctx.num_replicas),
                            gate=LinkGate(self.config.recovery_yields), fence=self.fence)

    def _build_stages(self, checkpoint: CheckpointConfig | None, start_step: int, backend: str) -> None:
        """Restore a checkpoint, then build the stages, registering with the coordinator (the
        leader) with the step this replica starts at."""
        s, env = self._services, self.ctx.env
        self.checkpoints: Checkpoints | None = None
        self.restored_step: int | None = None  # the checkpoint this incarnation started from
        checkpoint = checkpoint or CheckpointConfig.from_environ()
        if checkpoint is not None:
            self.checkpoints = Checkpoints(checkpoint, self.ctx, self.state, self._report_checkpoint,
                                           self.fence.confirm, s.hooks.checkpoint)
            self.restored_step = self.checkpoints.restore(lambda: coordinator_view(self.client, self.replica_id))
        self._checkpoint = StepCheckpoint(self.checkpoints, env.replica_id)
        self._recovery = Recovery(s, self.state, self.client)
        self._inputs = InputDigest(self.model, s.guard is not None, lambda: self.step if self._flags.in_step else None)
        self._commit = Commit(s, self.restored_step if self.restored_step is not None else start_step, self._inputs,
                              self.stats)
        self._trouble = ReplicaTrouble(self.checkpoints.engine if self.checkpoints is not None else None)
        self._store, self._link = register(self.ctx, self.client, self.identity, self.config, self.fence,
                                           self.ctx.gather(self._recovery.server.url), lambda: self.step,
                                           self._trouble)
        self._trouble.connect(self.ctx, self._store)  # every rank's writer heard through the leader
        timeout_s = self.config.collective_timeout_s
        ddp_how = inner_reduction.ddp_exchange(self.model, self.config.ddp_exchange)  # every rank: groups made below
        self._groups = QuorumGroups(backend, self.ctx.rank, timeout_s, self.device,
                                    slices=ReplicaSlices(timeout_s) if ddp_how == "slices" else None,
                                    width=self.ctx.world_size if ddp_how == "wide" else 1)
        self._exchange = Exchange(s, self.identity, self._groups, self._link, self._shared)
        self._aids = LoopAids(s, self._flags, self.state, self._commit, self._exchange, self._checkpoint, self._link,
                              self._shared, self._inputs, self.begin_step)
        self._backward = GradientsReady(self.model, self._on_backward_end, self._aids.exchanges_at_backward)
        # The step's quorum request leaves with its first forward pass (so trainer.aside() before it is allowed).
        self._forward_hook = self.model.register_forward_pre_hook(self._on_forward)
        # Each bucket (or FSDP2 shard) is exchanged as soon as it is final, behind the rest of backward.
        overlap = inner_reduction.attach(self.model, self._backward, self._exchange.buckets, self._bucket_ready,
                                         self._shard_ready, self._open, ddp_how)
        log.info("replica %d rank %d: the exchange overlaps backward by %s", env.replica_id, self.ctx.rank, overlap)

    # --- public ---------------------------------------------------------------------------
    @property
    def replica_id(self) -> int:
        return self.ctx.replica_id

    @property
    def num_replicas(self) -> int:
        return self.ctx.num_replicas

    @property
    def step(self) -> int:
        """Committed optimizer steps (ft/commit.py owns the count)."""
        return self._commit.step

    @property
    def num_steps(self) -> int | None:
        """The job's target, once steps() or batches() was given it."""
        return self._flags.num_steps

    @property
    def completed_elsewhere(self) -> bool:
        """The job finished without this replica."""
        return self._exchange.completed_elsewhere

    # The script's aids (ft/loop_aids.py), named one by one.
    job_ended = _aid("job_ended")
    last_step_committed = _aid("last_step_committed")
    last_batch_trained = _aid("last_batch_trained")
    final_batch_trained = _aid("final_batch_trained")
    steps = _aid("steps")
    batches = _aid("batches")
    data_rank = _aid("data_rank")
    data_world_size = _aid("data_world_size")
    generator = _aid("generator")
    report = _aid("report")
    fingerprint_input = _aid("fingerprint_input")
    no_sync = _aid("no_sync")
    aside = _aid("aside")
    is_writer_replica = _aid("is_writer_replica")
    is_writer = _aid("is_writer")
    log_due = _aid("log_due")

    def begin_step(self) -> None:
        self._checkpoint.start_if_due(self.step)  # the last step's, now that the script's end of it ran
        self._exchange.begin(self.step, self._commit.last, self._recovery.need_from)
        self._flags.in_step, self._flags.loss = True, None
        self._backward.reset()
        self._services.clock.begin()
        self._services.hooks.forward(self.step)

    def finish_step(
        self, loss: torch.Tensor | float | None = None, before_optimizer: Callable[[], None] | None = None
    ) -> bool:
        """End the step (the lower-level form of `trainer.optimizer.step()`): exchange the
        gradients if backward() has not, vote, and step the optimizer if every rank
        succeeded. True if the step was committed.

        `before_optimizer` runs on the averaged gradients just before `optimizer.step()`
        of a committed step (gradient clipping, an AMP scaler's unscale_).
        """
        if loss is not None:
            self._flags.loss = loss
        return self._finish(before_optimizer, True)

    # --- the sequence of a step -------------------------------------------------------------------
    def _on_forward(self, _module, _args) -> None:
        f = self._flags
        if f.in_step and not self._exchange.asked and not f.aside and torch.is_grad_enabled():
            self._exchange.ask()

    def _open(self) -> QuorumOutcome | None:
        """The part of the exchange before any gradient moves, once per step: the quorum, a
        source's serving of this round's joiners, the all-reduce set up."""
        if self._exchange.awaited:
            return self._exchange.opened
        q = self._exchange.quorum()
        if q is None:
            return None
        self._recovery.serve(q, self.step)
        return self._exchange.start(q)

    def _bucket_ready(self, index: int) -> None:
        """A bucket's gradients are final (mid-backward): its exchange starts now."""
        if self._open() is not None:
            self._exchange.send(index, self._backward.final_grads(index))

    def _shard_ready(self, shard: torch.Tensor) -> None:
        """FSDP2 reduce-scattered a group's gradients inside the replica: the shard's exchange."""
        if self._open() is not None:
            self._exchange.reduce_shard(shard)

    def _on_backward_end(self) -> None:
        if self._exchange.finished:  # the gradients of this step were averaged already
            raise UsageError("a second backward pass in one step: wrap all but the step's last one in "
                             "`with trainer.no_sync():` (gradient accumulation), or set DDP's "
                             "`model.require_backward_grad_sync = False` for them")
        self._exchange_now()

    def _exchange_now(self) -> QuorumOutcome | None:
        """The exchange, then a recovering replica's round: once per step, at the end of
        backward() or, if no backward pass ran it, when the step ends."""
        if self._exchange.finished:
            return self._exchange.opened
        self._open()
        outcome = self._exchange.finish(self._backward.started)
        if outcome is not None:
            small_step = self._recovery.round(outcome)
            if small_step is not None:  # a joiner's first round: it trains on from its source's step
                self._commit.start_at(small_step)
        return outcome

    def _finish(self, before_optimizer: Callable[[], None] | None, update: bool) -> bool:
        """The end of every step; `update` False: count a committed step without stepping
        the optimizer (the AMP scaler found inf/NaN in the averaged gradients)."""
        if not self._flags.in_step:
            raise UsageError("optimizer.step() outside a step: iterate over trainer.steps() or trainer.batches()")
        try:
            outcome = self._exchange_now()
            if outcome is None:  # the job ended (without us, or here): nothing to commit
                self._commit.not_committed(self._exchange.ended_by_owner)
                return False
            return self._commit_step(outcome, before_optimizer, update)
        finally:
            self._flags.in_step = False

    def _commit_step(self, outcome: QuorumOutcome, before_optimizer: Callable[[], None] | None,
                     update: bool) -> bool:
        """The stages after the exchange, in order; True if the step was committed."""
        attempted, recovery = self.step, self._recovery
        vote = self._commit.vote(outcome, self._flags.loss)
        self._checkpoint.check_quorum(outcome.quorum.max_step)  # every rank raises, or none
        if vote.committed:
            self._checkpoint.wait_snapshot()  # the last checkpoint's copy is complete before the state changes
            recovery.before_apply(attempted)
            self._commit.apply(outcome.quorum, before_optimizer, update and not vote.skip,
                               defer=recovery.defer if recovery.active else None)
            recovery.after_commit(self.step)
            self._checkpoint.after_commit(outcome.quorum, self.step, holds_state=not recovery.active)
            self._commit.signal(attempted, vote, outcome, holds_state=not recovery.active,
                                last=self.step == self.num_steps, snapshot=recovery.snapshot_print(self.step))
        else:
            self._exchange.not_committed()
        self._commit.record(outcome, self._flags.loss, vote)
        return vote.committed

    # --- the end --------------------------------------------------------------------------------
    def __enter__(self) -> FaultTolerant:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """`with ft.FaultTolerant(...) as trainer:` closes on the way out: a normal exit ends
        the job where it is (its target, or left on purpose: early stopping); an exception is
        this replica's failure, reported at once, and the exception goes on."""
        self.close(end_job=exc_type is None)

    def close(self, end_job: bool = False) -> None:
        """Leave the job and stop every thread this object started. Call it once training ends,
        also when it ends with an exception (`try: ... finally: trainer.close()`).

        Closing completes the job once this replica has committed the `num_steps` that
        `steps()` was given, or the job's owner ended it here (`job_ended`), or with
        `end_job=True`: the script ends the job at the current step on purpose (early
        stopping), and every replica still training stops at its next step. Closing before
        that (an exception, a `break`) is a failure: the coordinator drops this replica from
        the next quorum at once, and its launcher restarts it.
        """
        if self._closed:
            return
        self._closed = True
        guard = self._services.guard
        if guard is not None:
            guard.waiting(True)  # a final checkpoint may take long: that is not a hang
        self._uncaught.uninstall()
        ended = end_job or self._exchange.ended_by_owner
        done = ended or (self.num_steps is not None and self.step >= self.num_steps)
        gone = self.completed_elsewhere or bool(self._exchange.evicted)
        completed, failed = done and not gone, not done and not gone
        if failed:  # before anything slow: the other replicas stop waiting for this one now
            script_errors.record_escaping()  # before the report, which the launcher may act on first
            if self.ctx.is_leader:  # it talks for the replica
                report_close_failure(self.client, self.identity, self.step, self.num_steps)
        self._commit.close(completed, caught_up=not self._recovery.active)
        if guard is not None:
            guard.close()
        # The final checkpoint, before leaving: its commit is reported as this replica.
        self._checkpoint.close(self.step, completed, failed)
        if completed:  # the leader leaves once every rank's part is written: a left replica's writes are fenced
            self.ctx.all_ok(True)
        if self._link is not None:
            if completed and self._exchange.last_round < 0:  # e.g. restored at the target: no round answered it yet
                self._link.take_one_round(self.step, self._commit.last.commit_quorum_id)
            self._link.close(leave_request(self.identity, self.step, self.num_steps, completed,
                                           self.completed_elsewhere, ended))
        self._recovery.close()
        self._backward.remove()
        self._forward_hook.remove()
        self._inputs.close()
        self._groups.drop()
        self._trouble.board = None  # its connection to the leader's store, on the other ranks
        self._store = None

    def _report_checkpoint(self, step: int, uri: str) -> None:
        """on_commit of the checkpoint engine (its thread): status.training.lastCheckpoint. One
        checkpoint persists at a time, so the engine's last stall is this one's."""
        if self._link is not None and self.checkpoints is not None:
            self._link.report_checkpoint(step, uri, self.checkpoints.engine.last_stall_s)


class _ReportUncaught:
    """`sys.excepthook` while a trainer is open: an exception that escapes the script reports
    its replica's failure at once, before the interpreter prints it and exits, so the other
    replicas stop waiting for this one; then the previous hook runs."""

    def __init__(self, trainer: FaultTolerant):
        self.trainer, self.previous = trainer, sys.excepthook
        sys.excepthook = self

    def uninstall(self) -> None:
        if sys.excepthook is self:
            sys.excepthook = self.previous

    def __call__(self, exc_type, exc, tb) -> None:
        t = self.trainer
        try:
            script_errors.record_escaping(exc)  # before the report (see FaultTolerant.close)
            t._groups.drop()
            if not t._exchange.evicted and not t._closed:
                reason = f"uncaught {exc_type.__name__} in rank {t.ctx.rank}: {exc}"
                report_failure(t.client, t.identity, reason, timeout_s=1.0, exc=exc)  # a peer's echo waits
        finally:
            self.previous(exc_type, exc, tb)
