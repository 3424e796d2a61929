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
newest checkpoint when it starts, snapshots the state after every `interval_steps`-th
committed step (the host copy overlaps the next forward/backward and is awaited before the
next optimizer step), and saves the final step in `close()` (ft/checkpointing.py).

An incarnation the coordinator no longer counts (superseded, declared failed) commits no
step, writes no checkpoint object and serves no state (ft/fencing.py).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from transom.checkpoint.engine import CheckpointConfig
from transom.contract import ENV_DETECTION, ENV_STATS_DIR
from transom.detect.step_rows import DetectionSettings
from transom.coordinator.client import CoordinatorClient, credential
from transom.coordinator.models import Identity, LeaveRequest, QuorumRequest, QuorumResponse, RegisterRequest
from transom import inject, script_errors
from transom.checkpoint import sharding
from transom.ft import backend as placement
from transom.ft import data, wire
from transom.ft.backward import GradientsReady
from transom.ft.guard import Guard, signals_dir
from transom.ft.input_digest import InputDigest
from transom.ft.catchup import Source, small_part
from transom.ft.checkpointing import Checkpoints, Writers
from transom.ft.fencing import IncarnationFence
from transom.ft.ftar import StepAllReduce, bucket_params
from transom.ft.process_group import QuorumGroups
from transom.ft.shares import BatchShares
from transom.ft.step_clock import StepClock
from transom.errors import MustRestart, NoQuorum, TooManyFailedSteps, UsageError
from transom.ft.loop_aids import LoopAids
from transom.ft.script_state import bundle
from transom.ft.shared_values import SharedValues
from transom.ft.leader import CoordinatorLink, coordinator_view, hand_outcome, report_close_failure, report_failure
from transom.ft.replica import ReplicaContext, init
from transom.ft.rejoin import Rejoin
from transom.ft.snapshot_check import SnapshotCheck
from transom.ft.state_server import StateServer
from transom.ft.transfer import LinkGate
from transom.ft.stats import StatsWriter
from transom.ft.config import FTConfig, Stateful, lr_factor, model_device, scales, state_digest
from transom.ft.optimizer import FTOptimizer
from transom.ft.state import ReplicaState

log = logging.getLogger("transom.ft")


@dataclass
class _Exchanged:
    """The cross-replica half of a step, done at the end of backward() (or in _finish)."""

    q: QuorumResponse | None  # None: the job completed without this replica
    recovering: bool = False
    changed: bool = False
    ftar: StepAllReduce | None = None


class FaultTolerant(LoopAids):
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        ctx: ReplicaContext | None = None,
        *,
        scaler: Stateful | None = None,
        sampler: Stateful | None = None,
        extra_state: Stateful | None = None,
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
        self._optimizer = optimizer
        self.optimizer = FTOptimizer(optimizer, self._finish)
        """The script's optimizer, wrapped: its step() ends the fault-tolerant step (ft/optimizer.py)."""
        self.config = config or FTConfig.from_environ()
        # The gradients live where the model's parameters are; that, not what the machine
        # has, decides the cross-replica backend. A forced nccl that cannot work is refused
        # here, before anything starts (BackendError says what to change).
        self.device = model_device(model)
        self._backend = self.config.backend or self.ctx.backend
        placement.cross_replica(self._backend, tensor_device=self.device.type, member_gpus=[])
        # A hot spare waits here, loaded, until it is given a replica to take over.
        spare_id = self.ctx.env.spare_id
        self.ctx.wait_for_promotion()
        promoted_at = time.monotonic()
        env = self.ctx.env
        self.identity = Identity(replica_id=env.replica_id, generation=env.generation, attempt=env.attempt)
        self.client = CoordinatorClient(env.coordinator_url, credential(env.identity_token_file, env.coordinator_token))
        self.fault = inject.from_environ(env.attempt, replica=env.replica_id)
        self.fence = IncarnationFence(self.client, self.identity)  # may this incarnation still act?
        self.stats = StatsWriter(os.environ.get(ENV_STATS_DIR), env.replica_id, env.generation, env.attempt, self.ctx.rank)
        self.state = ReplicaState(model, optimizer, self.device, scaler=scaler, sampler=sampler, extra=self.extra_state)
        self._shared = SharedValues(self.extra_state)  # script values set aside, for every replica
        self.state.on_applied = self._shared.reapply
        # Anomaly detection (spec.detection): the step guard and this rank's signals (ft/guard.py).
        self.detection = DetectionSettings.from_spec(os.environ.get(ENV_DETECTION))
        self._guard = Guard(self.detection, signals_dir(), env.replica_id, env.generation, env.attempt,
                            self.ctx.rank, gradients_judged=not scales(scaler)) if self.detection.enabled else None
        self._clock = StepClock(self._guard)  # this step's busy time, and its waits for others
        self.shares = BatchShares(self.ctx.num_replicas)
        """Rebalance: the shares of the global batch that batches() follows (ft/shares.py)."""

        self.step = 0  # committed optimizer steps
        self._commit_quorum_id = -1
        self._last_round = -1
        self._last_failed = False
        self._last_loss: float | None = None
        self.last_step_committed = False
        """The last step was committed: the optimizer stepped (or the scaler skipped it on every
        replica) and `step` advanced; an LR scheduler steps after such a step."""
        self.last_batch_trained = False
        """This replica's batch went into the last committed step (not while it recovered)."""
        self._last_seconds: float | None = None
        self._failed_in_a_row = 0
        self._groups = QuorumGroups(self._backend, self.ctx.rank, self.config.collective_timeout_s, self.device)
        self._future: concurrent.futures.Future | None = None
        self._in_step = False
        self._request: QuorumRequest | None = None  # this step's, until the forward pass sends it
        self._asked = False  # this step's quorum request left (on the leader; the flag on every rank)
        self._aside = False  # in trainer.aside()
        self._opened: _Exchanged | None = None  # this step's, once its quorum is in
        self._exchanged: _Exchanged | None = None  # this step's, once the gradients are averaged
        self._loss: Any = None  # this step's, from report() or finish_step()
        self._no_sync = False
        self._closed = False
        self.num_steps: int | None = None  # the job's target, from steps()
        self.completed_elsewhere = False  # the job finished without this replica
        self._writers: Writers | None = None  # of a checkpoint of the last committed step
        self.restored_step: int | None = None  # the checkpoint this incarnation started from
        self.checkpoints: Checkpoints | None = None
        checkpoint = checkpoint or CheckpointConfig.from_environ()
        if checkpoint is not None:
            self.checkpoints = Checkpoints(checkpoint, self.ctx, self.state, self._report_checkpoint,
                                           self.fence.confirm, self.fault)
            self.restored_step = self.checkpoints.restore(lambda: coordinator_view(self.client, self.replica_id))
        self.step = self.restored_step if self.restored_step is not None else start_step

        bind = "0.0.0.0" if env.advertise_addr != "127.0.0.1" else "127.0.0.1"
        on_chunk = (lambda n: self.fault.maybe_fire(n, self.ctx.rank, "serve")) if self.fault else None
        self._state_server = StateServer(env.peer_token, bind, env.advertise_addr, on_chunk=on_chunk,
                                         bytes_per_s=self.config.recovery_bytes_per_s, refusal=self.fence.refusal)
        self._source = Source(self._state_server, sharding.localize, self.config.recovery_chunk_bytes)
        self._exchange_gate = LinkGate(self.config.recovery_yields)  # busy while gradients move
        self._rejoin = Rejoin(self.ctx, self.replica_id, self.config, model, optimizer, self.state, self.device,
                              self._exchange_gate, SnapshotCheck(self.client, self.ctx.rank, self.detection.enabled))
        endpoints = self.ctx.gather(self._state_server.url)
        self._store: dist.TCPStore | None = None
        self._link: CoordinatorLink | None = None
        self._evicted: str | None = None
        if self.ctx.is_leader:
            # This replica's store: the coordinator points a quorum at one member's store.
            self._store = dist.TCPStore(
                bind, 0, is_master=True, wait_for_workers=False, use_libuv=True,
                timeout=datetime.timedelta(seconds=self.config.collective_timeout_s),
            )
            registration = RegisterRequest(identity=self.identity, state_endpoints=endpoints, step=self.step,
                                           store_addr=f"{env.advertise_addr}:{self._store.port}")
            self._link = CoordinatorLink(self.client, registration, self.config.quorum_timeout_s, lambda: self.step,
                                         self.fence)
        self._backward = GradientsReady(model, self._exchange_at_backward_end, self._exchanges_at_backward)
        # The step's quorum request leaves with its first forward pass (so trainer.aside() before it is allowed).
        self._forward_hook = model.register_forward_pre_hook(self._on_forward)
        self._inputs = InputDigest(model, self._guard is not None, lambda: self.step if self._in_step else None)
        # Buckets in the order backward produces gradients (roughly the reverse of the
        # parameters'); each is exchanged as soon as it is ready, except under DDP, whose own
        # reduction follows our hooks: there the exchange waits for the end of the pass.
        self._buckets = bucket_params(list(reversed(list(model.parameters()))), self.config.bucket_bytes)
        if self._backward.covered and not isinstance(model, DistributedDataParallel):
            self._backward.track(self._buckets, self._bucket_ready)
        # The optimizer steps only a committed step: a direct call would fork the replicas.
        self._stepping = False
        self._step_guard = optimizer.register_step_pre_hook(self._refuse_direct_step)
        # An uncaught exception ends this worker, but interpreter teardown can take seconds
        # while peers sit in a collective with us: report and close our sockets first.
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._on_uncaught
        log.info("replica %d rank %d joined (generation %d attempt %d)", env.replica_id, self.ctx.rank, env.generation, env.attempt)
        if spare_id is not None:
            log.info("spare %d took over replica %d: registered %.2fs after its promotion", spare_id, env.replica_id,
                     time.monotonic() - promoted_at)

    # --- public ---------------------------------------------------------------------------
    @property
    def replica_id(self) -> int:
        return self.ctx.replica_id

    @property
    def num_replicas(self) -> int:
        return self.ctx.num_replicas

    def steps(self, num_steps: int) -> Iterator[int]:
        """Yield the index of the step to run until `num_steps` steps are committed.

        `num_steps` is the job's target: `close()` completes the job only once it is reached.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(f"num_steps must be a non-negative integer, got {num_steps!r}")
        self.num_steps = num_steps
        while self.step < num_steps and not self.completed_elsewhere:
            self.begin_step()
            yield self.step
            if self._in_step:
                raise UsageError("end every iteration of steps() with trainer.optimizer.step() "
                                 "(or trainer.finish_step()), once")

    def batches(self, loader, num_steps: int) -> Iterator[tuple[int, Any]]:
        """`(step, batch)` from a DataLoader over an `ft.ReplicaSampler` until `num_steps` steps
        are committed; a retried step sees the same batch again (ft/data.py). The loader's
        sampler becomes part of the replica state."""
        if self.state.sampler is None and isinstance(getattr(loader, "sampler", None), data.ReplicaSampler):
            self.state.sampler = loader.sampler
        return data.batches(self, loader, num_steps)

    def begin_step(self) -> None:
        self._evicted = self._evicted or (self._link.evicted if self._link is not None else None)
        if self._evicted:
            raise self.fence.evicted(self._evicted, None, f"step {self.step} not committed")
        self._in_step = True
        self._opened, self._exchanged, self._loss = None, None, None
        self._backward.reset()
        self._clock.begin()
        if self.fault:
            self.fault.maybe_fire(self.step, self.ctx.rank, "forward")
        if self._link is not None:
            req = QuorumRequest(
                identity=self.identity,
                step=self.step,
                commit_quorum_id=self._commit_quorum_id,
                last_round=self._last_round,
                failed=self._last_failed,
                last_loss=self._last_loss,
                last_step_seconds=self._last_seconds,
                catching_up_from=self._rejoin.need_from,
                follows_shares=self.shares.following,
                shares_held=self.shares.schedule.pending,
                shares_held_from=self.shares.schedule.pending_from,
                shared=self._shared.take(),
            )
            self._request = req
        self._asked = False

    def _on_forward(self, _module, _args) -> None:
        if self._in_step and not self._asked and not self._aside and torch.is_grad_enabled():
            self._ask()

    def _ask(self) -> None:
        """Send the step's quorum request (once); the leader alone talks to the coordinator."""
        self._asked = True
        if self._request is not None and self._link is not None:
            self._future, self._request = self._link.ask(self._request), None

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
            self._loss = loss
        return self._finish(before_optimizer, True)

    def _finish(self, before_optimizer: Callable[[], None] | None, update: bool) -> bool:
        """The end of every step; `update` False: count a committed step without stepping
        the optimizer (the AMP scaler found inf/NaN in the averaged gradients)."""
        if not self._in_step:
            raise UsageError("optimizer.step() outside a step: iterate over trainer.steps() or trainer.batches()")
        done = self._exchange_now()
        if done.q is None:  # the job completed without us: nothing to commit
            self._in_step = False
            self._optimizer.zero_grad(set_to_none=True)
            return False
        q, ftar = done.q, done.ftar
        attempted = self.step
        if self.fault:
            self.fault.maybe_fire(attempted, self.ctx.rank, "end", elapsed_s=self._clock.busy())
        skip, loss_value, norm = False, None, None
        with self._clock.waiting():
            if self._guard is not None:  # a bad step is applied on no replica (ft/guard.py)
                skip, loss_value, norm = self._guard.decide(self._loss, ftar, self.ctx, not done.recovering,
                                                            self.device)
            committed = self.ctx.all_ok(not ftar.failed)  # the vote of the replica's ranks
        if self.checkpoints is not None:
            self.checkpoints.check_skipped_restore(q.max_step)
        if committed:
            self._rejoin.take_if_ready(self.step, self.checkpoints.wait_snapshot if self.checkpoints else None)
            if skip:
                log.warning("replica %d rank %d: step %d applied on no replica: a replica's loss or gradients were "
                            "not finite, or its loss spiked", self.replica_id, self.ctx.rank, attempted)
            self._commit(q, before_optimizer, update and not skip)
            self._signal(attempted, loss_value, norm, done.recovering, q.serve_recovery, skip)
        else:
            self._failed_in_a_row += 1
        self._optimizer.zero_grad(set_to_none=True)
        self._record(q, self._loss, committed, done.recovering, done.changed, ftar.error)
        if self._failed_in_a_row >= self.config.max_failed_steps:
            raise TooManyFailedSteps(f"{self._failed_in_a_row} failed steps in a row, last: {ftar.error}")
        return committed

    # --- the stages of a step -------------------------------------------------------------------
    def _exchange_now(self) -> _Exchanged:
        """The step's gradient exchange, once per step: at the end of backward() (GradientsReady)
        or, if no backward pass ran it, when the step ends. Buckets the backward pass did not
        start already (ft/backward.py) start now; then all are awaited."""
        if self._exchanged is not None:
            return self._exchanged
        ex = self._open_exchange()
        if ex.q is not None:
            assert ex.ftar is not None
            for bucket in self._buckets[self._backward.started:]:
                ex.ftar.start(bucket)
            with self._clock.waiting():
                ex.ftar.finish()
            self._exchange_gate.free()
            if ex.ftar.failed:
                self._groups.drop()
            if ex.recovering:
                small_step = self._rejoin.round(ex.q, ex.ftar)
                self.step = self.step if small_step is None else small_step
            elif self._rejoin.active:  # a coordinator that forgot us would say so: be safe
                raise MustRestart(f"replica {self.replica_id} was catching up, but the quorum counts it caught up")
        self._exchanged = ex
        return ex

    def _exchange_at_backward_end(self) -> None:
        if self._exchanged is not None:  # the gradients of this step were averaged already
            raise UsageError("a second backward pass in one step: wrap all but the step's last one in "
                             "`with trainer.no_sync():` (gradient accumulation), or set DDP's "
                             "`model.require_backward_grad_sync = False` for them")
        self._exchange_now()

    def _bucket_ready(self, index: int) -> None:
        """A bucket's gradients are final (mid-backward): its exchange starts now."""
        ex = self._open_exchange()
        if ex.ftar is not None:
            ex.ftar.start(self._buckets[index])

    def _open_exchange(self) -> _Exchanged:
        """The cross-replica part before any gradient moves, once per step: wait for the quorum,
        rebuild the group for a changed one, serve the small state to joiners, and set up the
        step's all-reduce."""
        if self._opened is not None:
            return self._opened
        with self._clock.waiting():
            q = self._await_quorum()
        if q is None:
            self._opened = _Exchanged(q=None)
            return self._opened
        self._last_round = q.round
        self._shared.apply(q.shared)  # before anything of this step is served or captured
        # The prefix names a quorum uniquely, across coordinator restarts too.
        changed = self._groups.changed(q.store_prefix)
        error = self._groups.rebuild(q.store_addr, q.store_prefix, q.rank, len(q.members), q.quorum_id) \
            if changed else None
        if q.serve_recovery:  # kilobytes: what a joiner needs to train in step at once
            self._state_server.publish_small(q.round, wire.encode(small_part(self.state.capture(self.step))))
        self._source.on_round(q.serve_recovery, q.snapshot_from)
        if self.fault:
            self.fault.maybe_fire(self.step, self.ctx.rank, "allreduce")
        recovering = self.replica_id in q.recovering
        if self.fault and self._buckets:
            self.fault.maybe_fire(self.step, self.ctx.rank, "gradients", target=self._buckets[0][0].grad)
        self.shares.update(q)
        ftar = StepAllReduce(self._groups.group, q.participants, contribute=not recovering,
                             own=self._guard.own_bucket if self._guard is not None else None,
                             weight=self.shares.weight(q, self.replica_id))
        self._exchange_gate.busy()  # a catch-up in the background leaves the link to the buckets
        if error:
            ftar.fail(error)
        self._opened = _Exchanged(q=q, recovering=recovering, changed=changed, ftar=ftar)
        return self._opened

    def _commit(self, q: QuorumResponse, before_optimizer: Callable[[], None] | None, update: bool) -> None:
        """Step the optimizer (its learning rate scaled for missing replicas) unless `update`
        is False, count the step, and start the checkpoint that is due."""
        if self.checkpoints is not None:
            self.checkpoints.wait_snapshot()  # the last checkpoint's copy must be complete
        self._source.before_update()  # and the copy a joiner will fetch
        factor = lr_factor(self.config.lr_scaling, q.participants, self.num_replicas)
        groups = self._optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * factor
        try:
            if update and before_optimizer is not None:
                before_optimizer()
            if self._rejoin.active:  # no state to step yet: the update is replayed later
                recorded = self._rejoin.record(self.step, update)
                if self.fault:
                    self.fault.maybe_fire(recorded, self.ctx.rank, "catchup")
            elif update:
                self._stepping = True
                self._optimizer.step()
            if self.fault and not self._rejoin.active:
                self.fault.maybe_fire(self.step, self.ctx.rank, "update", target=next(self.model.parameters()))
        finally:
            self._stepping = False
            for g, lr in zip(groups, saved):
                g["lr"] = lr
        if not update:
            log.debug("replica %d: step %d committed without an update (inf/NaN gradients)", self.replica_id, self.step)
        self.step += 1
        self._commit_quorum_id = q.quorum_id
        self._failed_in_a_row = 0
        self._source.after_commit(self.step, self.state.capture)
        # The members that hold the state of this step (not those catching up) write its
        # checkpoint together.
        holders = [m for m in q.members if m not in q.recovering]
        mine = not self._rejoin.active and self.replica_id in holders
        self._writers = Writers(holders.index(self.replica_id), len(holders),
                                f"{q.store_prefix}/round{q.round}") if mine else None
        if self._writers is not None and self.checkpoints is not None and self.checkpoints.due(self.step):
            self.checkpoints.save(self.step, self._writers)

    def _signal(self, step: int, loss: float | None, norm: float | None, recovering: bool, serving: bool,
                skipped: bool) -> None:
        """This rank's row for the detectors: a committed step's busy time, workload, loss, norm,
        and every `fingerprint_interval` steps its parameters' fingerprint (ft/guard.py)."""
        if self._guard is not None:
            self._guard.committed(step, self._clock.busy(), loss, norm, recovering, serving, skipped,
                                  self.model if not self._rejoin.active else None, self.shares.batch_share(),
                                  snapshot=self._source.snapshot_taken_at(step + 1), input_digest=self._inputs.value(step))

    def _record(self, q: QuorumResponse, loss, committed: bool, recovering: bool, changed: bool,
                error: str | None) -> None:
        """What the next quorum request reports, and the step's statistics."""
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else loss
        self._last_failed = not committed
        self._last_loss = loss_value if committed and not recovering else None
        # Whether this replica's batch went into a committed step: not while it recovers
        # (it contributes zeros) nor when the step failed (the batch comes again).
        self.last_step_committed = committed
        self.last_batch_trained = committed and not recovering
        self._last_seconds = self._clock.elapsed()
        self._in_step = False
        self.stats.step(
            step=self.step, committed=committed, seconds=round(self._last_seconds, 6), quorum_id=q.quorum_id,
            quorum_changed=changed, recovering=recovering, participants=q.participants, members=len(q.members),
            loss=self._last_loss, error=error, t=time.time(),
        )

    def __enter__(self) -> "FaultTolerant":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """`with ft.FaultTolerant(...) as trainer:` closes on the way out: a normal exit ends
        the job where it is (completed: the loop ran to its target, or the script left it
        on purpose, e.g. early stopping); an exception is this replica's failure, reported
        at once, and the exception goes on."""
        self.close(end_job=exc_type is None)

    def close(self, end_job: bool = False) -> None:
        """Leave the job and stop every thread this object started. Call it once training ends,
        also when it ends with an exception (`try: ... finally: trainer.close()`).

        Closing completes the job once this replica has committed the `num_steps` that
        `steps()` was given, or with `end_job=True`: the script ends the job at the current
        step on purpose (early stopping), and every replica still training stops at its next
        step. Closing before that (an exception, a `break`) is a failure: the coordinator drops
        this replica from the next quorum at once, and its launcher restarts it.
        """
        if self._closed:
            return
        self._closed = True
        if self._guard is not None:
            self._guard.waiting(True)  # a final checkpoint may take long: that is not a hang
        if sys.excepthook == self._on_uncaught:
            sys.excepthook = self._previous_excepthook
        done = end_job or (self.num_steps is not None and self.step >= self.num_steps)
        completed = done and not self.completed_elsewhere and not self._evicted
        failed = not done and not self.completed_elsewhere and not self._evicted
        if failed:  # before anything slow: the other replicas stop waiting for this one now
            script_errors.record_escaping()  # before the report, which the launcher may act on first
            if self.ctx.is_leader:  # it talks for the replica
                report_close_failure(self.client, self.identity, self.step, self.num_steps)
        if completed and self._rejoin.active:
            log.warning("replica %d ends the job before it caught up: its state is not the job's", self.replica_id)
        elif completed:
            self.stats.final(self.step, state_digest(self.model))
        self.stats.close()
        if self._guard is not None:
            self._guard.close()
        if self.checkpoints is not None:  # before leaving: the commit is reported as this replica
            # A failing replica saves nothing, nor waits; an evicted one waits until the fence refuses it.
            self.checkpoints.close(self.step if completed else None, self._writers, wait=not failed)
        if self._link is not None:
            if completed and self._last_round < 0:  # e.g. restored at the target: no round answered it yet
                self._link.take_one_round(self.step, self._commit_quorum_id)
            leave = None
            if completed or self.completed_elsewhere:
                reason = "job completed elsewhere" if self.completed_elsewhere else \
                    "ended the job" if end_job and self.step < (self.num_steps or 0) else "completed"
                leave = LeaveRequest(identity=self.identity, step=self.step, completed=completed, reason=reason)
            self._link.close(leave)
        self._rejoin.close()
        self._source.close()
        self._backward.remove()
        self._forward_hook.remove()
        self._inputs.close()
        self._step_guard.remove()
        self._groups.drop()
        self._state_server.close()
        self._store = None

    # --- internals ------------------------------------------------------------------------------
    def _refuse_direct_step(self, _optimizer, _args, _kwargs) -> None:
        if not self._stepping:
            raise UsageError("the optimizer given to FaultTolerant was stepped directly; step trainer.optimizer "
                             "(or call trainer.finish_step()), which steps it only for a committed step")

    def _report_checkpoint(self, step: int, uri: str) -> None:
        """on_commit of the checkpoint engine (its thread): status.training.lastCheckpoint. One
        checkpoint persists at a time, so the engine's last stall is this one's."""
        if self._link is not None and self.checkpoints is not None:
            self._link.report_checkpoint(step, uri, self.checkpoints.engine.last_stall_s)

    def _await_quorum(self) -> QuorumResponse | None:
        # Only the leader asked; it tells the other ranks.
        self._ask()  # no forward pass went through the model (e.g. it called a submodule)
        answer = hand_outcome(self.ctx.from_leader, self._future, self.config.quorum_timeout_s + 30)
        self._future = None
        if isinstance(answer, dict):
            if "evicted" in answer:  # refused: this incarnation's update is discarded, on every rank
                self._evicted = answer["evicted"]
                raise self.fence.evicted(answer["evicted"], answer.get("state"), f"step {self.step} not committed")
            if "completed" in answer:
                log.warning("replica %d stops at step %d: %s", self.replica_id, self.step, answer["completed"])
                self.completed_elsewhere = True
                return None
            raise NoQuorum(f"replica {self.replica_id}: no quorum: {answer['error']}")
        return QuorumResponse.model_validate_json(answer)

    def _on_uncaught(self, exc_type, exc, tb) -> None:
        try:
            script_errors.record_escaping(exc)  # before the report (see close())
            self._groups.drop()
            if not self._evicted and not self._closed:
                reason = f"uncaught {exc_type.__name__} in rank {self.ctx.rank}: {exc}"
                report_failure(self.client, self.identity, reason, timeout_s=1.0)
        finally:
            self._previous_excepthook(exc_type, exc, tb)

