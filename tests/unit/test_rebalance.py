"""Rebalance (transom/detect/rebalance.py and its users): shares sized by slowness, samples
that add up to the global batch, an update that stays the mean over every sample, the
schedule every member reads alike, the detector's slowdown and recovery, and the
coordinator publishing and withdrawing the shares."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from membership_world import ident, make, register, round_all
from transom.coordinator.detection import Detection
from transom.coordinator.models import QuorumRequest, SignalBatch, SignalRow
from transom.detect.detectors import Detectors
from transom.detect.rebalance import (
    MAX_SLOWNESS,
    SharePolicy,
    ShareSchedule,
    exchange_weight,
    newest_held,
    samples_per_rank,
    share_vector,
)
from transom.detect.step_rows import DetectionSettings, Signal


def test_shares_follow_speed_and_keep_the_global_batch():
    assert share_vector({}, 3) is None
    shares = share_vector({1: 1.5}, 3)
    assert shares == [1.125, 0.75, 1.125] and sum(shares) == 3
    # The slow one's time (share x slowdown) now equals the others': the step is 1.125x, not 1.5x.
    assert shares[1] * 1.5 == pytest.approx(shares[0])
    assert share_vector({0: 100.0}, 2) == share_vector({0: MAX_SLOWNESS}, 2)
    assert share_vector({0: 0.5}, 2) is None  # "faster than the others" is not a slowdown


@pytest.mark.parametrize("shares,batch", [([1.125, 0.75, 1.125], 4), ([0.4, 1.6], 1), ([1.0] * 5, 7),
                                          ([0.25, 1.25, 1.25, 1.25], 3)])
def test_samples_add_up_to_the_global_batch_and_follow_the_shares(shares, batch):
    counts = samples_per_rank(shares, batch, len(shares))
    assert sum(counts) == batch * len(shares) and min(counts) >= 1
    for c, s in zip(counts, shares):
        assert abs(c - s * batch) < 1 or batch == 1
    assert samples_per_rank(None, batch, len(shares)) == [batch] * len(shares)
    with pytest.raises(ValueError):
        samples_per_rank([1.0, 0.0], 4, 2)


def test_weighted_exchange_is_the_mean_over_every_sample():
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    samples = torch.randn(12, 5)
    counts = [5, 3, 4]
    parts = torch.split(samples, counts)

    def grad(x):
        w.grad = None
        (x @ w).pow(2).mean().backward()
        return w.grad.clone()

    want = grad(samples)
    summed = sum(exchange_weight(counts, [0, 1, 2], r) * grad(p) for r, p in enumerate(parts))
    assert torch.allclose(summed, want, atol=1e-6)
    unweighted = sum(grad(p) for p in parts) / 3  # what dividing by the participants would give
    assert not torch.allclose(unweighted, want, atol=1e-3)
    # A member catching up contributes nothing: the others' samples are the step's.
    assert exchange_weight(counts, [0, 2], 0) == 5 / 9


def test_shares_are_published_only_when_every_member_follows_and_apply_from_the_next_step():
    b = SharePolicy(3)
    assert b.slow(1, 1.5) and not b.publish(all_follow=False, step=10)
    assert b.publish(all_follow=True, step=10) and (b.published, b.published_from) == ([1.125, 0.75, 1.125], 11)
    assert not b.slow(1, 1.51) or not b.publish(True, 12)  # a change below CHANGE is not republished
    assert b.published_from == 11
    assert b.restore(1) and b.publish(True, 20) and (b.published, b.published_from) == (None, 21)
    assert not b.restore(1)


def test_each_member_reads_the_shares_in_force_at_any_step():
    s = ShareSchedule()
    s.update(None, 0)
    assert s.at(5) is None
    s.update([0.5, 1.5], 11)  # decided at step 10
    assert s.at(10) is None and s.at(11) == [0.5, 1.5]
    s.update([0.6, 1.4], 11)  # step 10 failed and its retry's round decided again
    assert s.at(10) is None and s.at(11) == [0.6, 1.4]
    s.update(None, 30)
    assert s.at(29) == [0.6, 1.4] and s.at(30) is None


def _rows(step: int, slow: dict[int, float], replicas: int = 3) -> list[Signal]:
    return [Signal(step=step, replica=r, rank=0, step_seconds=0.5 * slow.get(r, 1.0), tokens=100.0)
            for r in range(replicas)]


def test_a_slow_verdict_says_how_slow_and_recovery_is_reported_once():
    d = Detectors(DetectionSettings(warmup_steps=5, slow_steps=4))
    found = []
    for step in range(30):
        found += d.observe_all(_rows(step, {2: 1.5} if 10 <= step < 20 else {}))
        assert d.take_recovered() == ([2] if step == 23 else []), step
    (v,) = found
    assert (v.replica, v.kind, v.first_step) == (2, "slow", 10) and v.slowdown == pytest.approx(1.5, rel=0.02)
    # Recovered: a new slowdown makes a new verdict.
    for step in range(30, 40):
        found += d.observe_all(_rows(step, {2: 2.0}))
    assert [x.replica for x in found] == [2, 2] and found[1].slowdown == pytest.approx(2.0, rel=0.02)


def _quorum(m, step, follows=True, replicas=3):
    return round_all(m, [QuorumRequest(identity=ident(r), step=step, commit_quorum_id=-1 if step == 0 else 0,
                                       last_round=step - 1, follows_shares=follows) for r in range(replicas)],
                     now=1.0 + step)


def test_the_coordinator_rebalances_a_slow_replica_and_restores_it():
    m = make(3)
    for r in range(3):
        register(m, r)
    d = Detection(DetectionSettings(warmup_steps=5, slow_steps=4, slow_action="Rebalance"), m)
    rounds = []

    def step_with_signals(step, slow):
        """Round `step` decided, then every replica's row of that step (rows follow rounds)."""
        prev = rounds[-1] if rounds else None
        rounds.append(round_all(m, [QuorumRequest(
            identity=ident(r), step=step, commit_quorum_id=prev.quorum_id if prev else -1,
            last_round=prev.round if prev else -1, follows_shares=True) for r in range(3)], now=1.0 + step))
        for r in range(3):
            row = SignalRow(step=step, rank=0, step_seconds=0.5 * (1.5 if r == slow else 1.0), tokens=100.0)
            d.observe(SignalBatch(identity=ident(r), rows=[row]), now=1.0 + step)

    for step in range(14):
        step_with_signals(step, slow=1 if step >= 6 else None)
    assert m.replicas[1].state == "healthy"  # Rebalance keeps the replica
    step_with_signals(14, slow=None)
    decision = rounds[-1]
    assert decision.shares == pytest.approx((1.125, 0.75, 1.125), abs=0.01) and decision.shares_from >= 10
    assert m.response(decision, 0).shares == list(decision.shares)
    percent = m.training(2.0)["batchSharePercent"]
    assert percent[1] == 75 and percent[0] == percent[2] in (112, 113)
    assert any(e.kind == "rebalance" for e in m.events) and any("(Rebalance)" in e.message for e in m.events)
    for step in range(15, 23):  # at normal speed again
        step_with_signals(step, slow=None)
    decision = rounds[-1]
    assert decision.shares is None and 15 < decision.shares_from <= 23  # back to nominal from the next round
    assert m.training(3.0)["batchSharePercent"] is None  # removed from status by the merge patch



def test_a_replica_that_under_reports_its_busy_time_moves_no_share_of_the_others():
    """Issue 28: with Rebalance, one liar (busy time x1e-5) among three made the honest two
    "slow" and moved their shares to [0.75, 0.75, 1.49]. The others are judged against the
    median of the replicas' medians (and their own history), which one liar cannot move."""
    m = make(3)
    for r in range(3):
        register(m, r)
    d = Detection(DetectionSettings(warmup_steps=5, slow_steps=4, slow_action="Rebalance"), m)
    prev = None
    for step in range(40):
        prev = round_all(m, [QuorumRequest(
            identity=ident(r), step=step, commit_quorum_id=prev.quorum_id if prev else -1,
            last_round=prev.round if prev else -1, follows_shares=True) for r in range(3)], now=1.0 + step)
        assert prev.shares is None, f"shares moved at step {step}: {prev.shares}"
        for r in range(3):
            seconds = 0.5 * (1e-5 if r == 2 else 1.0) * (1.0 + 0.01 * ((step * 7 + r) % 5))
            d.observe(SignalBatch(identity=ident(r), rows=[SignalRow(step=step, rank=0, step_seconds=seconds,
                                                                     tokens=100.0)]), now=1.0 + step)
    assert m.shares.slowness == {}  # nobody rebalanced: the liar claims speed it cannot be given
    assert not any(e.kind == "rebalance" for e in m.events)

def test_a_member_that_does_not_follow_shares_keeps_everyone_nominal():
    m = make(3)
    for r in range(3):
        register(m, r)
    m.shares.slow(1, 1.5)
    assert _quorum(m, 0, follows=False).shares is None


def test_a_replica_weighs_its_gradients_by_the_shares_of_the_rounds_step():
    from transom.coordinator.models import QuorumResponse
    from transom.ft.shares import BatchShares as Follower

    def answer(shares, recovering=(), step=12):
        return QuorumResponse(round=3, quorum_id=1, members=[0, 1, 2], rank=0, store_addr="h:1", store_prefix="p",
                              max_step=step, participants=3 - len(recovering), recovering=list(recovering),
                              serve_recovery=False, shares=shares, shares_from=11)

    f = Follower(3)
    f.update(answer([1.125, 0.75, 1.125]))
    assert f.weight(answer([1.125, 0.75, 1.125]), 1) is None  # its batches do not follow the shares
    f.follow(8)
    assert f.counts(10) is None and f.counts(11) == [9, 6, 9]
    assert f.weight(answer([1.125, 0.75, 1.125]), 1) == 6 / 24
    assert f.weight(answer([1.125, 0.75, 1.125], recovering=[2]), 1) == 6 / 15
    assert f.weight(answer([1.125, 0.75, 1.125], recovering=[2]), 2) == 0.0  # catching up: zeros
    assert f.weight(answer([1.125, 0.75, 1.125], step=10), 1) is None  # before the shares apply


def test_a_rebalanced_rank_is_judged_per_nominal_batch():
    """After the rebalance its batch is 0.75 of the nominal one and the others' 1.125: while it
    is still 1.5x slow it stays flagged (no recovery, no second verdict); once it is at normal
    speed it is reported recovered, though its step is then the shortest."""
    d = Detectors(DetectionSettings(warmup_steps=5, slow_steps=4))
    share = {0: 1.125, 1: 1.125, 2: 0.75}

    def rows(step, slowdown):
        return [Signal(step=step, replica=r, rank=0, step_seconds=0.5 * share[r] * (slowdown if r == 2 else 1.0),
                       tokens=100.0 * share[r], batch_share=share[r]) for r in range(3)]

    found = []
    for step in range(10):
        found += d.observe_all(_rows(step, {}))
    for step in range(10, 40):
        found += d.observe_all(rows(step, 1.5))
        assert d.take_recovered() == [], step
    assert [(v.replica, round(v.slowdown, 2)) for v in found] == [(2, 1.5)]
    recovered = []
    for step in range(40, 50):
        found += d.observe_all(rows(step, 1.0))
        recovered += d.take_recovered()
    assert recovered == [2] and len(found) == 1


def test_a_rebalanced_replica_is_measured_against_the_others_and_its_share_adjusted():
    d = Detectors(DetectionSettings(warmup_steps=5, slow_steps=4))
    for step in range(10):
        d.observe_all(_rows(step, {}))
    for step in range(10, 14):
        d.observe_all(_rows(step, {2: 1.5}))
    assert d.take_updates() == {}  # the verdict itself carries the first measure
    for step in range(14, 22):  # its share made it 1.2x the others' busy time: still too long
        rows = _rows(step, {2: 1.2})
        share = 0.75 if step < 16 else 0.8  # ... and the shares changed once more meanwhile
        rows[2] = dataclasses.replace(rows[2], batch_share=share)
        d.observe_all(rows)
        assert d.take_updates() == ({2: pytest.approx(1.2)} if step == 19 else {}), step
    b = SharePolicy(3)
    assert not b.balance(2, 1.2)  # not rebalanced: nothing to adjust
    b.slow(2, 1.5)
    assert b.balance(2, 1.2) and b.slowness[2] == pytest.approx(1.5 * 1.2 ** 0.5)
    assert b.balance(2, 0.8) and b.slowness[2] == pytest.approx(1.5 * (1.2 * 0.8) ** 0.5)
    assert not b.balance(2, 1.0)  # balanced: the shares stay


def test_the_balance_moves_the_estimate_only_so_far_from_the_verdicts_measure():
    b = SharePolicy(2)
    b.slow(1, 2.0)
    for _ in range(10):  # its step does not follow its batch: shifting more would not help
        b.balance(1, 1.3)
    assert b.slowness[1] == pytest.approx(2.0 * 1.5)
    for _ in range(20):
        b.balance(1, 0.5)
    assert b.slowness[1] == pytest.approx(2.0 / 1.5)


def test_of_the_schedules_the_replicas_hold_the_newest_announcement_is_carried_on():
    v1, v2 = [1.125, 0.75, 1.125], [1.2, 0.6, 1.2]
    assert newest_held({0: (None, 0), 1: (None, 0)}) is None  # never rebalanced
    # The old coordinator stopped while its last answers went out: replica 2 heard v2 from
    # step 8 (and may have drawn step 8's batch by it), the others still hold v1.
    assert newest_held({0: (v1, 5), 1: (v1, 5), 2: (v2, 8)}) == (v2, 8, [2])
    assert newest_held({0: (None, 9), 1: (v1, 5), 2: (None, 9)}) == (None, 9, [0, 2])  # withdrawn at 9


def _restarted(held, gens=(0, 0, 0)):
    """A fresh coordinator's first round, the replicas holding `held` (replica -> (vector, from))."""
    m = make(3)
    for r in range(3):
        register(m, r, gen=gens[r], step=7)
    reqs = [QuorumRequest(identity=ident(r, gens[r]), step=7, commit_quorum_id=4, last_round=-1, follows_shares=True,
                          shares_held=held[r][0], shares_held_from=held[r][1]) for r in range(3)]
    return m, round_all(m, reqs, now=1.0)


def test_a_restarted_coordinator_keeps_the_shares_the_replicas_follow():
    before = make(3)
    for r in range(3):
        register(before, r)
    before.shares.slow(1, 1.5)
    old = _quorum(before, 0)
    v = list(old.shares)
    m, decision = _restarted({r: (v, old.shares_from) for r in range(3)})
    # The same vector from the same step: no step is weighted by shares its batches did not follow.
    assert decision.shares == old.shares and decision.shares_from == old.shares_from == 1
    assert [e.message for e in m.events if e.kind == "rebalance"] == [
        "kept from before the restart, from step 1: shares of the global batch replica 0 1.12, replica 1 0.75, "
        "replica 2 1.12"]
    assert m.shares.slowness == {1: pytest.approx(1.5)}  # so the detector's balance and restore go on from it
    # The replicas' first signals to the new coordinator are not a new incarnation's.
    d = Detection(DetectionSettings(warmup_steps=5, slow_steps=4, slow_action="Rebalance"), m)
    d.observe(SignalBatch(identity=ident(1), rows=[SignalRow(step=8, rank=0, step_seconds=0.5, tokens=1.0)]), 1.5)
    assert m.shares.slowness == {1: pytest.approx(1.5)}
    # ... but a later incarnation of the slow replica is new hardware, maybe: nominal again.
    register(m, 1, now=2.0, gen=1, step=8)
    d.observe(SignalBatch(identity=ident(1, 1), rows=[SignalRow(step=9, rank=0, step_seconds=0.5, tokens=1.0)]), 2.0)
    assert m.shares.slowness == {}


def test_a_slow_replica_restarted_with_the_coordinator_gets_its_nominal_share_at_the_next_step():
    v = [1.125, 0.75, 1.125]
    # Replica 1 is a new incarnation: it was never told the vector, the other two were.
    m, decision = _restarted({0: (v, 5), 1: (None, 0), 2: (v, 5)}, gens=(0, 1, 0))
    assert decision.shares is None and decision.shares_from == 8  # v stays in force for step 7, drawn by it
    assert m.shares.slowness == {}


def test_a_held_vector_that_does_not_fit_the_job_is_not_adopted():
    shares = SharePolicy(3)
    assert not shares.adopt([1.5, 0.5], 5, [0, 1])  # the job was scaled from two replicas
    assert not shares.adopt([3.0, 3.0, 3.0], 5, [0, 1, 2])  # does not keep the global batch
    assert shares.published is None and shares.slowness == {}
    with pytest.raises(ValueError):
        QuorumRequest(identity=ident(0), step=1, commit_quorum_id=0, last_round=0, shares_held=[float("nan"), 1.0])
    with pytest.raises(ValueError):
        QuorumRequest(identity=ident(0), step=1, commit_quorum_id=0, last_round=0, shares_held=[-1.0, 3.0])


def test_only_the_quorums_members_share_the_batch():
    # Replica 1 is outside the quorum (failed, say) while replica 0 is 2x slow: the members'
    # shares balance them and keep their two nominal batches; replica 1 has no say and no share.
    assert share_vector({0: 2.0, 1: 3.0}, 3, members=[0, 2]) == [pytest.approx(2 / 3, abs=1e-4), 1.0,
                                                                  pytest.approx(4 / 3, abs=1e-4)]
    assert share_vector({1: 3.0}, 3, members=[0, 2]) is None  # only a non-member is slow: nothing to balance
    m = make(3, min_replicas=2, startup_wait_s=0.0)  # replica 1 not in
    for r in (0, 2):
        register(m, r)
    m.shares.slow(0, 2.0)
    decision = round_all(m, [QuorumRequest(identity=ident(r), step=0, commit_quorum_id=-1, last_round=-1,
                                           follows_shares=True) for r in (0, 2)], now=1.0)
    assert decision.shares == pytest.approx((2 / 3, 1.0, 4 / 3), abs=1e-3)
    counts = samples_per_rank(list(decision.shares), 6, 3)
    assert counts[0] + counts[2] == 2 * 6 and counts[0] * 2 == counts[2]  # equal time, the members' batch kept
