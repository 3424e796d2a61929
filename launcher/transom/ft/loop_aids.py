"""What a training loop asks of its trainer besides the step itself: its iterators
(`steps()`, `batches()`, which begin each step), its data's coordinates,
random numbers that a retried step sees again, gradient accumulation, work outside the
steps, one writer for the script's own files, and which steps are worth a log line.

`FaultTolerant` (ft/trainer.py) holds one `LoopAids` and names each of its members it
offers the script; `LoopAids` is given what it reads: the step's services, the flags it
shares with the trainer (`LoopFlags`), and the stages whose read-outs it shows.

- **Data coordinates.** Each replica is a world of its own (`ctx.rank` runs 0..world_size-1
  in every replica), so a sampler seeded by `ctx.rank` alone gives every replica the same
  batches. `data_rank` / `data_world_size` number the ranks of all replicas together, as
  `DistributedSampler`'s rank and world size number torchrun's processes.
- **Random numbers of a step.** `generator(micro_step)` is a `torch.Generator` seeded from
  (seed, step, micro step, data rank): different on every rank of every replica, and the
  same when a failed step runs again, so random-offset batches (nanoGPT's `torch.randint`
  into a memmap) follow the step as rule 2 of training-api.md asks.
- **Work outside the steps** (`aside()`): an evaluation or a sample on one replica. The
  rounds go on without the replica meanwhile (the coordinator does not wait for it and
  does not take it for hung); when it asks for its next quorum it is behind, and catches up
  from a peer while it trains in step, like a replica that rejoins. Nobody waits for it.
  `ft.ScriptState` values it sets there reach every replica at its next step
  (ft/shared_values.py): its `best_val_loss` is the job's.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from transom.errors import UsageError
from transom.ft import data
from transom.ft.commit import Commit
from transom.ft.coordinator_link import CoordinatorLink
from transom.ft.exchange import Exchange
from transom.ft.input_digest import InputDigest
from transom.ft.shared_values import SharedValues
from transom.ft.state import ReplicaState
from transom.ft.step_checkpoint import StepCheckpoint
from transom.ft.step_services import StepServices


@dataclass
class LoopFlags:
    """Where the loop is, which the trainer and its aids both set and read."""

    in_step: bool = False  # between the step's beginning and its optimizer.step()
    aside: bool = False  # in trainer.aside()
    no_sync: bool = False  # in trainer.no_sync(): backward passes only accumulate
    loss: Any = None  # this step's, from report() or finish_step()
    num_steps: int | None = None  # the job's target, from steps()


def step_seed(seed: int, step: int, micro_step: int, data_rank: int) -> int:
    """A 63-bit seed from the four numbers, the same in every process and Python version
    (not `hash()`, which is salted per process)."""
    digest = hashlib.blake2b(struct.pack("<4q", seed, step, micro_step, data_rank), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextlib.contextmanager
def _fsdp2_no_sync(model: torch.nn.Module):
    """FSDP2's switch for accumulation (no reduce-scatter until the last micro batch), where
    the model has it; nothing otherwise."""
    switch = getattr(model, "set_requires_gradient_sync", None)
    if switch is None:
        yield
        return
    switch(False)
    try:
        yield
    finally:
        switch(True)


class LoopAids:
    """The script-facing aids of one trainer (see the module docstring)."""

    def __init__(self, services: StepServices, flags: LoopFlags, state: ReplicaState, commit: Commit,
                 exchange: Exchange, checkpoint: StepCheckpoint, link: CoordinatorLink | None, shared: SharedValues,
                 inputs: InputDigest, begin_step: Callable[[], None]):
        """`begin_step`: the trainer's, which each iteration of steps() calls."""
        self.services, self.ctx, self.model, self.flags = services, services.ctx, services.model, flags
        self.state, self.commit, self.exchange, self.checkpoint = state, commit, exchange, checkpoint
        self.link, self.shared, self.inputs, self.begin_step = link, shared, inputs, begin_step
        self.shares = services.shares  # data.batches() reads them

    @property
    def step(self) -> int:
        """Committed optimizer steps (the commit stage owns the count)."""
        return self.commit.step

    @property
    def replica_id(self) -> int:
        return self.ctx.replica_id

    @property
    def job_ended(self) -> bool:
        """The job ended before the target: without this replica, or by its owner at this
        replica's step (POST /v1/finish: completed here, as at the target)."""
        return self.exchange.completed_elsewhere or self.exchange.ended_by_owner

    @property
    def last_step_committed(self) -> bool:
        """The last step was committed: the optimizer stepped (or the scaler skipped it on every
        replica) and `step` advanced; an LR scheduler steps after such a step."""
        return self.commit.last_step_committed

    @property
    def last_batch_trained(self) -> bool:
        """This replica's batch went into the last committed step (not while it recovered)."""
        return self.commit.last_batch_trained

    @property
    def final_batch_trained(self) -> bool:
        """Once the job ended here (at the target, or where its owner ended it): this replica's
        batch went into the job's last step, so it holds the job's final weights."""
        return self.commit.last_batch_trained or self.commit.ended_trained

    # --- the loop ------------------------------------------------------------------------------
    def steps(self, num_steps: int) -> Iterator[int]:
        """Yield the index of the step to run until `num_steps` steps are committed.

        `num_steps` is the job's target: `close()` completes the job only once it is reached.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise UsageError(f"num_steps must be a non-negative integer, got {num_steps!r}")
        self.flags.num_steps = num_steps
        while self.step < num_steps and not self.job_ended:
            self.begin_step()
            yield self.step
            if self.flags.in_step:
                raise UsageError("end every iteration of steps() with trainer.optimizer.step() "
                                 "(or trainer.finish_step()), once")

    def batches(self, loader, num_steps: int) -> Iterator[tuple[int, Any]]:
        """`(step, batch)` until `num_steps` steps are committed; a retried step sees the same
        batch again. From a DataLoader over an `ft.ReplicaSampler`, positioned by the step
        (ft/data.py; the sampler becomes part of the replica state), or from any other
        iterable in its own order (ft/iterable.py). Anything else raises UsageError here."""
        batches = data.batches(self, loader, num_steps)  # refuses what it cannot use before anything changes
        if self.state.sampler is None and isinstance(getattr(loader, "sampler", None), data.ReplicaSampler):
            self.state.sampler = loader.sampler
        return batches

    # --- data ---------------------------------------------------------------------------------
    @property
    def data_rank(self) -> int:
        """This rank's place among the ranks of all replicas: replica_id * world_size + rank."""
        return self.ctx.replica_id * self.ctx.world_size + self.ctx.rank

    @property
    def data_world_size(self) -> int:
        """The ranks of all replicas: num_replicas * world_size (DistributedSampler's world size)."""
        return self.ctx.num_replicas * self.ctx.world_size

    def generator(self, micro_step: int = 0, *, seed: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator for the current step's `micro_step`-th batch on this rank, seeded from
        (seed, step, micro_step, data_rank): a retried step draws the same numbers, every
        rank of every replica different ones. Create it inside the step, before the batch."""
        for name, value in (("micro_step", micro_step), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
                raise UsageError(f"trainer.generator(): {name} must be a non-negative integer, got {value!r}")
        g = torch.Generator(device=device)
        g.manual_seed(step_seed(seed, self.step, micro_step, self.data_rank))
        return g

    # --- the step -----------------------------------------------------------------------------
    def report(self, loss: torch.Tensor | float | None = None, *, tokens: float | None = None,
               sum_len_sq: float | None = None) -> None:
        """The step's loss, for the anomaly detectors, the coordinator (status, metrics) and the
        step statistics; and its workload: `tokens` in this rank's batch and the sum of its
        sequences' squared lengths, which attention's cost follows (for packed sequences: the
        documents' lengths). The fail-slow detector predicts a step's time from them. Call it
        before `optimizer.step()`; optional."""
        if not self.flags.in_step:
            raise UsageError("report() belongs inside a step, before optimizer.step()")
        self.flags.loss = loss
        if self.services.guard is not None:
            self.services.guard.reported(loss, tokens, sum_len_sq)

    def fingerprint_input(self, data: Any) -> None:
        """This step's input (a tensor, or its sample indices) for the distinct-data check,
        where the model's first tensor argument is not the data (ft/input_digest.py)."""
        self.inputs.take(data)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside accumulate locally, without the
        cross-replica exchange (and without DDP's, if the model is a DDP module, or FSDP2's
        reduce-scatter, if it is an FSDP2 module); the step's last backward pass, outside,
        exchanges the sum. DDP's own switches (`model.no_sync()`,
        `model.require_backward_grad_sync = False`) do the same."""
        inner = self.model.no_sync() if hasattr(self.model, "no_sync") else _fsdp2_no_sync(self.model)
        self.flags.no_sync = True
        try:
            with inner:
                yield
        finally:
            self.flags.no_sync = False

    def exchanges_at_backward(self) -> bool:
        """Whether this backward pass ends with the cross-replica exchange: inside a step, and
        neither trainer.no_sync() nor DDP's switch says the pass only accumulates."""
        return self.flags.in_step and not self.flags.no_sync and getattr(self.model, "require_backward_grad_sync", True)

    # --- outside the steps --------------------------------------------------------------------
    @contextlib.contextmanager
    def aside(self):
        """Work outside the steps on this replica (evaluation, sampling, saving a file) for as
        long as it takes: the other replicas go on without it, and it catches up afterwards.
        Use it between steps, or in a step before its forward pass (nanoGPT evaluates at the
        top of the loop); every rank of the replica enters it."""
        if self.flags.in_step and self.exchange.asked:
            raise UsageError("trainer.aside() after the step's forward pass: the other replicas are waiting for "
                             "this step's gradients. Enter it before the forward pass, or after optimizer.step()")
        if self.flags.aside:
            raise UsageError("trainer.aside() inside trainer.aside()")
        self.flags.aside = True
        if self.link is not None:
            self.link.step_aside(self.step)
        self.exchange.end_lease()  # after the coordinator knows: the round the members ask for skips it
        if self.services.guard is not None:
            self.services.guard.waiting(True)  # the launcher's hang watchdog: this is no hang
        timed = self.services.clock.waiting() if self.flags.in_step else contextlib.nullcontext()
        before = self.shared.before_aside()
        try:
            with timed:  # not this step's busy time (the fail-slow detector would see a slow step)
                yield
            self.shared.after_aside(before)  # ScriptState values it set go to every replica
        finally:
            self.flags.aside = False
            if self.services.guard is not None:
                self.services.guard.waiting(False)

    # --- the script's own files and logs --------------------------------------------------------
    @property
    def is_writer_replica(self) -> bool:
        """True on every rank of one replica of the job: the first that holds the state of the
        step just committed (not one catching up); False everywhere before the first commit.
        Evaluate there (all of its ranks, in `trainer.aside()`); it can move to another
        replica after a failure."""
        return self.checkpoint.writers is not None and self.checkpoint.writers.replica_rank == 0

    @property
    def is_writer(self) -> bool:
        """True on one rank of the whole job: rank 0 of the writer replica. Write the script's
        own files (a `ckpt.pt`, a log of its own) and its log lines only where this is true."""
        return self.ctx.rank == 0 and self.is_writer_replica

    def log_due(self, every: int = 1) -> bool:
        """Whether the step just committed is worth a log line: it trained this replica's own
        batch on the job's weights (not a failed attempt that runs again, not a step of a
        replica catching up, whose loss came from stale weights), and `trainer.step` is a
        multiple of `every`. With `trainer.is_writer`, one line per step for the job."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UsageError(f"trainer.log_due(): every must be a positive integer, got {every!r}")
        return self.last_step_committed and self.last_batch_trained and self.step % every == 0
