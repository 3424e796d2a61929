"""FTAR on real Gloo groups in real processes: averaging, zero contribution, dead peers, and
the step guard's flags that ride with the last bucket.

Three processes build a CrossReplicaGroup from one TCPStore, as replicas do for a quorum.
A SIGKILLed peer must fail the step in the survivors quickly, turn the rest of the step
into no-ops, and a group rebuilt under a fresh prefix must work at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from transom.detect.step_rows import DetectionSettings
from transom.ft.ftar import StepAllReduce
from transom.ft.guard import Guard
from transom.ft.process_group import CrossReplicaGroup, ReplicaSlices
from transom.ft.sliced_ftar import SlicedAllReduce

pytestmark = pytest.mark.timeout(120)


def grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, which the step has set."""
    assert p.grad is not None
    return p.grad


def _params(value: float, device: str = "cpu") -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.zeros(5, device=device)), torch.nn.Parameter(torch.zeros(2, 3, device=device))]
    for p in ps:
        p.grad = torch.full_like(p, value)
    return ps


def _average_worker(rank: int, port: int, out: mp.Queue, choice: str = "gloo", device: str = "cpu") -> None:
    group = CrossReplicaGroup(choice, f"127.0.0.1:{port}", f"t/avg-{choice}-{device}", rank, 3, timeout_s=10,
                              device=torch.device(device))
    params = _params(rank + 1.0, device)
    step = StepAllReduce(group, participants=2, contribute=rank != 2)  # rank 2 is joining
    step.allreduce_gradients(params)
    # Plain values, not tensors: a tensor sent through the queue is shared by a file
    # descriptor that vanishes when this process exits before the parent reads it.
    out.put((rank, step.failed, [grad(p).cpu().tolist() for p in params], group.backend))


def _forced_nccl_worker(rank: int, port: int, out: mp.Queue) -> None:
    from transom.ft.backend import BackendError

    try:
        CrossReplicaGroup("nccl", f"127.0.0.1:{port}", "t/forced-nccl", rank, 2, timeout_s=10)
    except BackendError as e:
        out.put((rank, str(e)))
    else:
        out.put((rank, "built"))


def _kill_worker(rank: int, port: int, out: mp.Queue) -> None:
    group = CrossReplicaGroup("gloo", f"127.0.0.1:{port}", "t/kill", rank, 3, timeout_s=10)
    params = _params(1.0)
    StepAllReduce(group, 3, True).allreduce_gradients(params)  # a healthy first step
    if rank == 1:
        time.sleep(0.2)  # the others are inside the next all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    step = StepAllReduce(group, 3, True)
    t0 = time.monotonic()
    step.allreduce_gradients(params)
    detected = time.monotonic() - t0
    del group
    before = [grad(p).clone() for p in params]
    step.allreduce_gradients(params)  # no-op after the failure
    untouched = all(torch.equal(a, grad(p)) for a, p in zip(before, params))
    # Rebuild among the survivors under a fresh prefix, as the next quorum does.
    new_rank = 0 if rank == 0 else 1
    t1 = time.monotonic()
    survivors = CrossReplicaGroup("gloo", f"127.0.0.1:{port}", "t/kill-q2", new_rank, 2, timeout_s=10)
    retry = StepAllReduce(survivors, 2, True)
    for p in params:
        grad(p).fill_(rank)
    retry.allreduce_gradients(params)
    out.put((rank, step.failed, detected, untouched, retry.failed, time.monotonic() - t1, grad(params[0])[0].item()))


# Per step: (rank with NaN gradients, {rank: loss reported before the last bucket},
# {rank: loss reported only at the step's end}, rank that catches up (sends zeros)).
GUARD_STEPS = [
    (None, {}, {}, None),  # clean; a first step may still see a late loss: the agreement runs
    (1, {}, {}, None),  # NaN gradients: found from the flags alone
    (None, {}, {}, None),  # clean, and no collective for the guard
    (None, {2: float("inf")}, {}, None),  # a loss reported in time rides with the flags
    (None, {}, {2: float("nan")}, None),  # reported late by a rank that reported before: agreed
    (1, {}, {}, 1),  # the NaN of a replica that catches up counts nowhere; rank 2 reported a loss
    # before, so it may report one late again: the agreement runs
]


def _guard_worker(rank: int, port: int, out: mp.Queue) -> None:
    group = CrossReplicaGroup("gloo", f"127.0.0.1:{port}", "t/guard", rank, 3, timeout_s=10)
    guard = Guard(DetectionSettings(), None, rank, 0, 0, 0)
    params = _params(1.0)
    seen = []
    for nan_rank, early, late, joiner in GUARD_STEPS:
        guard.begin()
        for p in params:
            p.grad = torch.full_like(p, float("nan") if rank == nan_rank else rank + 1.0)
        contributes = rank != joiner
        weight = None if joiner is None else (0.0 if not contributes else 0.5)
        ftar = StepAllReduce(group, 2 if joiner is not None else 3, contributes, own=guard.own_bucket,
                             flags=guard.flags, weight=weight)
        agreements: list[bool] = []

        def agree(bad, device, agreements=agreements, inner=ftar.agree):
            agreements.append(bad)
            return inner(bad, device)

        ftar.agree = agree  # type: ignore[method-assign]  # counts the separate agreements
        if rank in early:
            guard.reported(torch.tensor(early[rank]), None, None)
        ftar.start(params[:1])
        ftar.start(params[1:], last=True)
        ftar.finish()
        loss = early.get(rank, late.get(rank))
        # A replica of one process: the replica's vote on `skip` is this rank's own.
        skip, _, _ = guard.decide(None if loss is None else torch.tensor(loss), ftar, contributes, torch.device("cpu"))
        grad = params[1].grad
        assert grad is not None
        seen.append((skip, len(agreements), grad[0, 0].item()))
    out.put((rank, seen))


def _shard_worker(rank: int, port: int, out: mp.Queue, weighted: bool) -> None:
    """Two shards reduced in place (FSDP2's all-reduce hook), the flags travelling alone at
    the end; rank 2 catches up (sends zeros), or, `weighted`, everyone sends its share."""
    group = CrossReplicaGroup("gloo", f"127.0.0.1:{port}", f"t/shard-{weighted}", rank, 3, timeout_s=10)
    guard = Guard(DetectionSettings(), None, rank, 0, 0, 0)
    guard.begin()
    weight = (0.2, 0.3, 0.5)[rank] if weighted else None
    ftar = StepAllReduce(group, 3 if weighted else 2, contribute=weighted or rank != 2, own=guard.own_bucket,
                         flags=guard.flags, weight=weight)
    shards = [torch.full((4,), rank + 1.0), torch.full((3,), float("nan") if rank == 1 else 10.0 * (rank + 1))]
    for shard in shards:
        ftar.reduce_in_place(shard)
    ftar.finish()
    assert ftar.flag_sums is not None
    out.put((rank, ftar.failed, [s.tolist() for s in shards], ftar.flag_sums.tolist()))


def _sliced_worker(rank: int, port: int, out: mp.Queue) -> None:
    """Two replicas of two ranks: buckets exchanged in slices (DDP inside the replica), with
    odd sizes (the last slice padded); in the second step replica 1 catches up (zeros)."""
    replica, k = divmod(rank, 2)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"replica{replica}", store), rank=k, world_size=2)
    slices = ReplicaSlices(timeout_s=10)
    group = CrossReplicaGroup("gloo", f"127.0.0.1:{port}", f"t/sliced/shard{k}", replica, 2, timeout_s=10)
    seen = []
    for participants, contribute in ((2, True), (1, replica == 0)):
        params = _params(0.0)
        for p in params:
            p.grad = torch.arange(p.numel(), dtype=torch.float32).view_as(p) * (rank + 1)
        ftar = SlicedAllReduce(slices, group, participants, contribute, flags=lambda like: torch.tensor([1.0, 0.0]))
        ftar.start(params[:1])
        ftar.start(params[1:], last=True)
        ftar.finish()
        assert ftar.flag_sums is not None
        seen.append((ftar.failed, [grad(p).reshape(-1).tolist() for p in params], ftar.flag_sums.tolist()))
    out.put((rank, seen))
    dist.destroy_process_group()


def _run(target, n: int, *extra) -> list:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, store.port, out, *extra)) for r in range(n)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(sum(1 for _ in procs) - (1 if target is _kill_worker else 0)):
            results.append(out.get(timeout=60))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return sorted(results)


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize("choice", ["gloo", "auto"])
def test_average_over_participants_with_a_zero_contributing_joiner(choice):
    results = _run(_average_worker, 3, choice)
    assert [r[1] for r in results] == [False, False, False]
    assert [r[3] for r in results] == ["gloo"] * 3  # auto: CPU gradients go through Gloo, also where CUDA is
    grads = [[torch.tensor(v) for v in r[2]] for r in results]  # float32 values survive a float round trip
    for g in grads:
        assert torch.equal(g[0], torch.full((5,), 1.5))  # (1 + 2) / 2; the joiner's 3 is not sent
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))  # bit-identical


def test_sigkilled_peer_fails_the_step_fast_and_a_new_group_works():
    results = _run(_kill_worker, 3)
    assert [r[0] for r in results] == [0, 2]
    for rank, failed, detected, untouched, retry_failed, rebuild_s, value in results:
        assert failed, "the step with a dead peer must fail"
        assert detected < 2.0, f"survivor {rank} took {detected:.2f}s to notice a SIGKILL"
        assert untouched, "collectives after a failure must be no-ops"
        assert not retry_failed and rebuild_s < 2.0
        assert value == pytest.approx(1.0)  # (0 + 2) / 2 over the survivors


def test_a_forced_nccl_group_that_cannot_work_is_refused_by_every_member_alike():
    # The members swap their devices through the store and all refuse the same way,
    # instead of a failed NCCL init that surfaces as one failed step after another.
    results = _run(_forced_nccl_worker, 2)
    assert [r[0] for r in results] == [0, 1]
    assert all("backend nccl needs the gradients on a CUDA device" in r[1] for r in results), results


def test_the_guards_agreement_rides_with_the_last_bucket_and_costs_a_collective_only_for_a_late_loss():
    results = _run(_guard_worker, 3)
    assert [r[0] for r in results] == [0, 1, 2]
    per_step = list(zip(*(r[1] for r in results)))  # every rank's (skip, agreements, gradient) per step
    for steps in per_step:
        assert all(s[:2] == steps[0][:2] for s in steps), steps  # every replica decides alike
    skips = [steps[0][0] for steps in per_step]
    agreements = [steps[0][1] for steps in per_step]
    assert skips == [False, True, False, True, True, False]
    assert agreements == [1, 0, 0, 0, 1, 1]
    assert per_step[0][0][2] == pytest.approx(2.0)  # (1 + 2 + 3) / 3: the flags are not averaged in
    assert per_step[5][0][2] == pytest.approx(0.5 * 1.0 + 0.5 * 3.0)  # weighted; the joiner sends zeros


@pytest.mark.parametrize("weighted", [False, True])
def test_shards_reduced_in_place_hold_the_average_and_the_flags_travel_alone(weighted):
    results = _run(_shard_worker, 3, weighted)
    assert [r[1] for r in results] == [False] * 3
    first = [r[2][0] for r in results]
    expected = 0.2 * 1 + 0.3 * 2 + 0.5 * 3 if weighted else (1 + 2) / 2  # the joiner's 3 is not sent
    for values in first:
        assert values == pytest.approx([expected] * 4)
    assert len({tuple(v) for v in first}) == 1  # every member holds the same bytes
    # The flags, summed on every member: rank 1's NaN shard is one BAD; no loss was reported,
    # so each contributing member is LATE (the joiner's flags are zeros: it cannot make anyone skip).
    assert [r[3] for r in results] == [[1.0, 3.0 if weighted else 2.0]] * 3


@pytest.mark.slow
def test_buckets_exchanged_in_slices_hold_the_average_of_every_rank_of_every_replica():
    results = _run(_sliced_worker, 4)
    assert [r[0] for r in results] == [0, 1, 2, 3]
    for step, replicas_counted in ((0, [0, 1]), (1, [0])):
        per_rank = [r[1][step] for r in results]
        assert all(not failed for failed, _, _ in per_rank)
        ranks = [r for r in range(4) if r // 2 in replicas_counted]
        factor = sum(r + 1 for r in ranks) / len(ranks)  # the mean over the ranks counted
        for p in per_rank[0][1]:
            expected = [i * factor for i in range(len(p))]
            assert p == pytest.approx(expected), (step, p, expected)
        assert len({str(g) for _, g, _ in per_rank}) == 1, "every rank of every replica holds the same bytes"
        # Each rank's flags ride its own slice across replicas: summed over the contributors.
        assert all(flags == [float(len(replicas_counted)), 0.0] for _, _, flags in per_rank), per_rank
