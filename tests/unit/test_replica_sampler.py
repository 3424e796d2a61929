"""ft.ReplicaSampler and trainer.batches: each rank's own disjoint part of every global
batch, positioned by the committed step; a retried step sees the same batch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from transom.ft.data import ReplicaSampler, batches


@dataclass
class Ctx:
    replica_id: int
    num_replicas: int
    rank: int = 0
    world_size: int = 1


def _sampler(replica, replicas=3, rank=0, world=2, size=100, **kw):
    return ReplicaSampler(range(size), Ctx(replica, replicas, rank, world), **kw)


def test_ranks_of_all_replicas_split_every_epoch_disjointly():
    samplers = [_sampler(r, rank=k) for r in range(3) for k in range(2)]
    for epoch in (0, 1):
        parts = [s.indices(epoch) for s in samplers]
        seen = [i for part in parts for i in part]
        assert len(seen) == len(set(seen)) == 6 * (100 // 6)  # disjoint, the tail of 4 dropped
    assert samplers[0].indices(0) != samplers[0].indices(1)  # a new order every epoch
    assert samplers[0].indices(0) == _sampler(0, rank=0).indices(0)  # fixed by seed and epoch
    assert samplers[0].indices(0) != _sampler(0, rank=0, seed=1).indices(0)


def test_without_drop_last_every_sample_is_used_and_ranks_stay_even():
    parts = [_sampler(r, rank=k, drop_last=False).indices(0) for r in range(3) for k in range(2)]
    assert {len(p) for p in parts} == {17} and set().union(*parts) == set(range(100))


def test_set_step_puts_the_sampler_where_the_committed_steps_left_off():
    s = _sampler(1, size=96)  # 16 samples per rank: 4 steps of 4 per epoch
    stream = s.indices(0) + s.indices(1)
    for step in range(8):
        s.set_step(step, 4)
        assert list(s)[:4] == stream[4 * step:4 * step + 4]
    s.set_step(5, 4)
    assert (s.epoch, s.offset, len(s)) == (1, 4, 12)
    t = _sampler(1, size=96)
    t.load_state_dict(s.state_dict())
    assert list(t) == list(s)
    with pytest.raises(ValueError, match="does not fit"):
        _sampler(1, size=96, seed=7).load_state_dict(s.state_dict())


def test_a_partial_last_batch_is_dropped_on_every_rank():
    s = _sampler(0, size=60)  # 10 per rank, batches of 4: 2 steps per epoch, 2 samples dropped
    assert s.steps_per_epoch(4) == 2
    s.set_step(2, 4)
    assert (s.epoch, s.offset, len(s)) == (1, 0, 8)


class Shares:
    """FaultTolerant.shares (ft/shares.py) with the counts given per step."""

    def __init__(self, counts):
        self.by_step, self.nominal, self.took_samples = counts, None, []

    def follow(self, batch_size):
        self.nominal = batch_size

    def counts(self, step):
        return next((c for first, c in sorted(self.by_step.items(), reverse=True) if step >= first), None)

    def took(self, samples):
        self.took_samples.append(samples)


class Trainer:
    """steps() as FaultTolerant's: the step index until `n` are committed; a scripted
    sequence of outcomes (committed, retried) and jumps (recovered from a peer)."""

    def __init__(self, script, counts=None):
        """`counts`: {first step: samples per rank of each replica} (Rebalance)."""
        self.script, self.step, self.seen = list(script), 0, []
        self.shares = Shares(counts or {})

    def steps(self, n):
        while self.step < n and self.script:
            yield self.step
            what = self.script.pop(0)
            if what == "ok":
                self.step += 1
            elif isinstance(what, int):  # jumped to a peer's step
                self.step = what


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_repeats_a_retried_step_and_repositions_after_a_jump(workers):
    data = TensorDataset(torch.arange(96))
    ctx = Ctx(1, 3, 0, 2)
    loader = DataLoader(data, batch_size=4, sampler=ReplicaSampler(data, ctx, seed=3), num_workers=workers)
    reference = ReplicaSampler(data, ctx, seed=3)
    stream = reference.indices(0) + reference.indices(1) + reference.indices(2)
    trainer = Trainer(["ok", "retry", "ok", 6, "ok", "ok", "ok"])
    got = [(step, batch[0].tolist()) for step, batch in batches(trainer, loader, 9)]
    assert [s for s, _ in got] == [0, 1, 1, 2, 6, 7, 8]
    assert got[1][1] == got[2][1]  # the retry saw the same batch
    for step, batch in got:
        assert batch == stream[4 * step:4 * step + 4], step  # whatever happened before it


def _ranks(replicas=3, world=2, size=48, seed=4):
    return [ReplicaSampler(range(size), Ctx(r, replicas, k, world), seed=seed)
            for r in range(replicas) for k in range(world)]


def test_rebalanced_slices_of_each_step_partition_the_nominal_global_batch():
    nominal, counts = _ranks(), [3, 5, 4]  # samples per rank of each replica; they add up to 3 x 4
    for s in nominal:
        s.set_step(1, 4)  # step 1 of 2 per epoch (48 samples, 6 ranks, batch 4): the rest of epoch 0
    rebalanced = _ranks()
    for s in rebalanced:
        s.set_step(1, 4)
        s.counts = counts
    want = sorted(i for s in nominal for i in list(s))  # step 1's global batch, nominal
    got = [list(s) for s in rebalanced]
    assert [len(g) for g in got] == [3, 3, 5, 5, 4, 4] and [len(s) for s in rebalanced] == [3, 3, 5, 5, 4, 4]
    flat = [i for g in got for i in g]
    assert len(set(flat)) == len(flat) and sorted(flat) == want  # disjoint, and the same samples


def test_batches_follow_the_shares_from_the_step_they_apply_and_keep_a_retried_batch():
    data = TensorDataset(torch.arange(96))
    ctx = Ctx(1, 3, 0, 2)
    loader = DataLoader(data, batch_size=4, sampler=ReplicaSampler(data, ctx, seed=3))
    trainer = Trainer(["ok", "ok", "retry", "ok", "ok"], counts={2: [5, 3, 4]})
    got = [(step, batch[0].tolist()) for step, batch in batches(trainer, loader, 4)]
    assert trainer.shares.nominal == 4 and [len(b) for _, b in got] == [4, 4, 3, 3, 3]
    assert got[2] == got[3]  # the retry saw the same (rebalanced) batch
    assert trainer.shares.took_samples == [4, 4, 3, 3]  # one per new step
    reference = _ranks(size=96, seed=3)
    for s in reference:
        s.set_step(2, 4)
        s.counts = [5, 3, 4]
    assert got[2][1] == list(reference[2])[:3] and got[4][1] == list(reference[2])[3:6]

