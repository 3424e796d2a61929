"""trainer.batches() over iterables that Transom cannot position (ft/iterable.py): a generator
of synthetic batches, a list, a DataLoader without an ft.ReplicaSampler. A retried step sees
the same batch; a jump goes on with the next batch; what cannot work is a UsageError (a
script error: the job ends instead of restarting), at the call where it can be told there."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

from transom.errors import ScriptError, UsageError
from transom.ft.data import ReplicaSampler, batches


class Trainer:
    """steps() as FaultTolerant's, scripted: "ok" commits, "retry" runs the step again, an
    int jumps to that step (the replica caught up with a peer)."""

    replica_id = 1

    def __init__(self, script, start=0):
        self.script, self.step = list(script), start

    def steps(self, n):
        while self.step < n and self.script:
            yield self.step
            what = self.script.pop(0)
            if what == "ok":
                self.step += 1
            elif isinstance(what, int):
                self.step = what


def synthetic():
    """The ported script's data: a generator of synthetic batches, each a new tensor."""
    k = 0
    while True:
        yield torch.full((2,), float(k))
        k += 1


def test_a_generator_of_synthetic_batches_feeds_the_loop_and_a_retried_step_sees_the_same_batch():
    got = list(batches(Trainer(["ok", "retry", "ok", "ok"]), synthetic(), 3))
    assert [s for s, _ in got] == [0, 1, 1, 2]
    assert got[1][1] is got[2][1]  # the same object: the step runs again on the data it failed on
    assert [b[0].item() for _, b in got] == [0.0, 1.0, 1.0, 2.0]


def test_a_jump_goes_on_with_the_next_batch_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="transom.ft"):
        got = list(batches(Trainer(["ok", 30, "ok", "ok"]), synthetic(), 32))
    assert [(s, b[0].item()) for s, b in got] == [(0, 0.0), (1, 1.0), (30, 2.0), (31, 3.0)]
    assert "jumped from step 1 to step 30" in caplog.text and "cannot be positioned" in caplog.text


def test_a_job_started_at_a_later_step_begins_with_the_first_batch():
    got = list(batches(Trainer(["ok", "ok"], start=10), [10, 11, 12], 12))
    assert got == [(10, 10), (11, 11)]


def test_an_iterable_that_can_start_again_does_at_its_end():
    got = list(batches(Trainer(["ok"] * 5), ["a", "b"], 5))
    assert [b for _, b in got] == ["a", "b", "a", "b", "a"]


def test_a_dataloader_without_a_replica_sampler_is_an_iterable_in_its_own_order():
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=2)
    got = [(s, b[0].tolist()) for s, b in batches(Trainer(["ok", "retry", "ok", "ok", "ok"]), loader, 4)]
    assert got == [(0, [0, 1]), (1, [2, 3]), (1, [2, 3]), (2, [4, 5]), (3, [0, 1])]


def test_a_generator_that_runs_out_before_the_target_is_a_script_error():
    loop = batches(Trainer(["ok"] * 5), (torch.zeros(1) for _ in range(2)), 5)
    with pytest.raises(UsageError, match="ran out after 2 batches, at step 2 of 5") as raised:
        list(loop)
    assert isinstance(raised.value, ScriptError)


@pytest.mark.parametrize("data, message", [
    (7, "takes an iterable of batches .* got int"),
    ([], "yields no batch"),
])
def test_what_cannot_feed_the_loop_is_refused(data, message):
    with pytest.raises(UsageError, match=message):
        list(batches(Trainer(["ok"]), data, 1))


def test_a_non_iterable_is_refused_at_the_call_not_at_the_first_step():
    with pytest.raises(UsageError, match="got object"):
        batches(Trainer(["ok"]), object(), 1)


class Ctx:
    replica_id, num_replicas, rank, world_size = 0, 2, 0, 1


def test_a_replica_sampler_loader_that_cannot_be_positioned_is_refused_at_the_call():
    data = TensorDataset(torch.arange(8))
    by_batch_sampler = DataLoader(data, batch_sampler=BatchSampler(ReplicaSampler(data, Ctx()), 2, drop_last=True))
    with pytest.raises(UsageError, match="needs batch_size="):
        batches(Trainer(["ok"]), by_batch_sampler, 1)
    too_big = DataLoader(data, batch_size=8, sampler=ReplicaSampler(data, Ctx()))  # 4 samples per rank
    with pytest.raises(UsageError, match="batch_size 8 does not fit 4 samples"):
        batches(Trainer(["ok"]), too_big, 1)
    with pytest.raises(UsageError, match="cannot feed 2 ranks"):
        ReplicaSampler(range(1), Ctx())
