"""Data for an ordinary `DataLoader` loop: each replica's and each rank's own part of every
global batch, positioned by the committed step. (`trainer.batches()` also takes any other
iterable of batches, which cannot be positioned: ft/iterable.py.)

`ReplicaSampler` is a `torch.utils.data.Sampler` in the manner of `DistributedSampler`: an
epoch is a permutation of the dataset fixed by `seed` and the epoch number, and the
`num_replicas x world_size` ranks take every such rank's turn of it (global rank `g =
replica_id * world_size + rank` takes positions `g, g + W, g + 2W, ...`). The loader cuts
a rank's stream into batches of `batch_size`, so the global batch of step `s` is every
rank's `s`-th batch: disjoint, and the same whichever process computes it.

The position is not state of its own: a rank that has committed `s` steps has consumed
`s * batch_size` samples of its stream, so `set_step(s, batch_size)` puts the sampler where
the committed steps left off, for a replica that rejoins (its state came from a peer at
step `s`), a job restarted from a checkpoint, or a retried step (`FaultTolerant.batches`
calls it). What a failure skips: while a replica is missing, or its step is not committed,
its share of those global batches is trained by nobody; a rejoining replica goes on at the
step the others reached, so no sample is trained twice in committed steps. The epoch of
step `s` is `s // steps_per_epoch`: an epoch is `per_rank_samples // batch_size` whole
batches on every rank (a partial last batch is dropped, so that every step's global batch
is whole); `drop_last=False` wraps the permutation around to even out the ranks instead
of dropping the dataset's tail, as DistributedSampler does.

Under Rebalance (transom/detect/rebalance.py) the replicas' batches differ in size: the
global batch of step `s` is still the `s`-th block of `num_replicas x world_size x
batch_size` positions of the epoch's permutation, and each rank takes a contiguous slice of
it, sized by its replica's share (`counts`, samples per rank of each replica; the slices
of all ranks are disjoint and cover the block). `batches()` sets the counts in force at
each step and the loader's batch size with them (its own `BatchSampler`'s, which the
loader reads when an iteration starts), and starts a new iteration when they change.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from transom.errors import UsageError
from transom.ft import iterable


class ReplicaSampler(Sampler[int]):
    def __init__(self, dataset: Sized, ctx, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        self.size = len(dataset)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.ranks = ctx.num_replicas * ctx.world_size
        self._ctx = ctx  # a hot spare learns its replica id later: the rank is read when used
        if self.size < self.ranks:  # a UsageError: every incarnation would fail here again
            raise UsageError(f"ft.ReplicaSampler: a dataset of {self.size} samples cannot feed {self.ranks} ranks")
        # Every rank the same count, as DistributedSampler: drop the tail, or wrap around.
        self.per_rank = self.size // self.ranks if drop_last else math.ceil(self.size / self.ranks)
        self.epoch = 0
        self.offset = 0  # samples of this epoch this rank has already consumed
        self.limit = self.per_rank  # samples of an epoch that are used (whole batches only)
        self.counts: list[int] | None = None  # Rebalance: samples per rank of each replica, per step
        self._batch = 0  # the nominal batch size of set_step (block size under counts)

    @property
    def replica_id(self) -> int:
        return self._ctx.replica_id

    @property
    def global_rank(self) -> int:
        return self._ctx.replica_id * self._ctx.world_size + self._ctx.rank

    def __len__(self) -> int:
        if self.counts is not None:
            return (self.limit - self.offset) // self._batch * self.counts[self.replica_id]
        return self.limit - self.offset

    def set_epoch(self, epoch: int) -> None:
        """As DistributedSampler's: the epoch's permutation (the position goes to its start)."""
        self.epoch, self.offset = epoch, 0

    def steps_per_epoch(self, batch_size: int) -> int:
        """Whole batches of a rank per epoch (a partial last batch is dropped on every rank)."""
        if batch_size < 1 or batch_size > self.per_rank:
            raise ValueError(f"batch_size {batch_size} does not fit {self.per_rank} samples per rank and epoch")
        return self.per_rank // batch_size

    def set_step(self, step: int, batch_size: int) -> None:
        """Where a rank stands after `step` committed steps of `batch_size` samples each."""
        per_epoch = self.steps_per_epoch(batch_size)
        self.epoch, within = divmod(step, per_epoch)
        self.offset, self.limit = within * batch_size, per_epoch * batch_size
        self._batch = batch_size

    def _order(self, epoch: int) -> list[int]:
        """The epoch's permutation, `per_rank x ranks` long."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        total = self.per_rank * self.ranks
        if total > len(order):  # not drop_last: wrap around to even the ranks out
            order += order[: total - len(order)]
        return order[:total]

    def indices(self, epoch: int) -> list[int]:
        """This rank's samples of `epoch`, in order (nominal shares)."""
        return self._order(epoch)[self.global_rank::self.ranks]

    def __iter__(self) -> Iterator[int]:
        if self.counts is None:
            return iter(self.indices(self.epoch)[self.offset:self.limit])
        return iter(self._sliced())

    def _sliced(self) -> list[int]:
        """The rest of the epoch under `counts`: this rank's slice of each step's block."""
        counts, world, replica = self.counts, self._ctx.world_size, self.replica_id
        assert counts is not None and self._batch > 0
        block = self._batch * self.ranks
        start = world * sum(counts[:replica]) + self._ctx.rank * counts[replica]
        order = self._order(self.epoch)
        out: list[int] = []
        for k in range(self.offset // self._batch, self.limit // self._batch):
            out += order[k * block + start:k * block + start + counts[replica]]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "limit": self.limit, "seed": self.seed, "ranks": self.ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.seed or state.get("ranks") != self.ranks:
            raise ValueError(f"sampler state of seed {state.get('seed')} over {state.get('ranks')} ranks does not fit "
                             f"this sampler (seed {self.seed}, {self.ranks} ranks)")
        self.epoch, self.offset, self.limit = int(state["epoch"]), int(state["offset"]), int(state["limit"])


def batches(trainer, data, num_steps: int) -> Iterator[tuple[int, Any]]:
    """`(step, batch)` until `num_steps` steps are committed (FaultTolerant.batches). `data`
    is a DataLoader over a ReplicaSampler (positioned by the step, below), or any other
    iterable of batches (ft/iterable.py). What it cannot use is refused here, at the call:
    a UsageError, which ends the job instead of failing every retry the same way."""
    sampler = _replica_sampler(data)
    if sampler is None:
        return iterable.batches(trainer, iterable.Stream(data), num_steps)
    if data.batch_size is None or data.sampler is not sampler:
        raise UsageError("trainer.batches(): a DataLoader over an ft.ReplicaSampler needs batch_size= "
                         "(not batch_sampler=): the sampler is positioned in whole batches")
    try:
        sampler.steps_per_epoch(data.batch_size)
    except ValueError as e:
        raise UsageError(f"trainer.batches(): {e}") from None
    return _sampled(trainer, data, sampler, num_steps)


def _replica_sampler(data: Any) -> ReplicaSampler | None:
    """The ReplicaSampler a DataLoader draws from, as its sampler or inside its batch_sampler."""
    if not isinstance(data, DataLoader):
        return None
    for sampler in (data.sampler, getattr(data.batch_sampler, "sampler", None)):
        if isinstance(sampler, ReplicaSampler):
            return sampler
    return None


def _sampled(trainer, loader, sampler: ReplicaSampler, num_steps: int) -> Iterator[tuple[int, Any]]:
    """A new step takes the loader's next batch; a retried step (not committed) gets the same
    batch again; a step the replica jumped to (recovered from a peer, restored from a
    checkpoint) repositions the sampler at that step first. At the end of an epoch the
    loader starts the next one.
    """
    nominal = loader.batch_size  # with batch_size= (not batch_sampler=), the loader's own BatchSampler
    assert nominal is not None
    trainer.shares.follow(nominal)
    it, expected, current, batch = None, None, None, None
    for step in trainer.steps(num_steps):
        if step != current:
            counts = trainer.shares.counts(step)
            size = nominal if counts is None else counts[sampler.replica_id]
            if counts != sampler.counts:  # Rebalance: another batch size from this step
                sampler.counts = counts
                loader.batch_sampler.batch_size = size
                it = None
            if it is None or step != expected:
                sampler.set_step(step, loader.batch_size)
                it = iter(loader)
            try:
                batch = next(it)
            except StopIteration:  # the epoch is over: the next one from its start
                sampler.set_step(step, loader.batch_size)
                it = iter(loader)
                batch = next(it)
            current, expected = step, step + 1
            trainer.shares.took(size)
        yield step, batch
