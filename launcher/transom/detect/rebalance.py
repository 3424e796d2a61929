"""Rebalance: a slow replica's smaller share of each global batch (ResiHP's adaptation, at
replica granularity). Pure: the coordinator's policy, the replicas' arithmetic.

A replica that is slow but healthy (a throttled GPU, a noisy neighbour) holds every step
back by its slowdown, since the replicas train in lockstep. With `slowAction: Rebalance`
the coordinator gives it fewer samples of each global batch and the others more, so that
all finish together, instead of replacing it:

- **Policy** (`SharePolicy`, the coordinator's). A `slow` verdict says how much longer the
  replica takes than its workload predicts, relative to the others (`factor`, at most
  `MAX_SLOWNESS` counted). Shares are proportional to speed (1/factor; 1 for the others)
  among the round's members and sum to their number, so their part of the global batch
  keeps its size: with three replicas and one 1.5x slow, 0.75 / 1.125 / 1.125, and a step
  takes 1.125x instead of 1.5x. A replica outside the quorum (failed, catching up from
  outside) takes no samples and has no say in the others' shares: its entry is the nominal
  1.0, which it takes at the step it rejoins, until the first decision with it as a member.
  The first measure can be off (where replicas share CPUs or a link, or where part of a
  step does not shrink with the batch), so while the replica is rebalanced the detector
  reports its busy time over the others' every `slowSteps` steps, and the estimate is
  multiplied by the square root of it (1 when the share balances it; the root damps the
  swings of a noisy measure), within `MAX_ADJUSTMENT` of the verdict's measure either way.
  The share returns to 1 when the detector sees the replica at normal speed again for `slowSteps` steps, or when
  the replica is restarted or replaced (a new incarnation, maybe new hardware).
- **Schedule** (`ShareSchedule`, each replica's). A new vector is published in a round's
  decision and applies from the step after that round's, so every member knows it before
  it takes that step's batch; a retried step keeps the batch it had.
- **Samples** (`samples_per_rank`): the nominal batch `b` per rank times the share,
  rounded so that the replicas' samples still add up to `replicas x b` (largest remainder,
  ties to the lower replica id): every member computes the same numbers.
- **Exact update** (`exchange_weight`): each contributing replica scales its gradients (a
  mean over its own samples) by its samples over all contributors' samples before the sum,
  so the average is the mean over every sample of the step, whatever the shares.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Collection
from dataclasses import dataclass, field

MAX_SLOWNESS = 4.0  # a replica slower than this is given the share of one this slow (replace it instead)
# How far the balance may move the estimate from the verdict's measure, either way: further
# than that, the step does not follow the batch (a part that does not shrink with it, CPUs
# shared with the others) and shifting more samples would not help.
MAX_ADJUSTMENT = 1.5
CHANGE = 0.02  # shares that differ by less than this are not worth a new schedule


def share_vector(slowness: dict[int, float], replicas: int,
                 members: Collection[int] | None = None) -> list[float] | None:
    """Each replica's share of the global batch (1.0 the nominal one), or None when every
    member has the nominal share. The `members`' shares (all replicas' if None) sum to their
    number; a replica outside them gets 1.0, so that the vector always sums to `replicas`."""
    inside = sorted(set(range(replicas) if members is None else members) & set(range(replicas)))
    speeds = {r: 1.0 / min(max(slowness.get(r, 1.0), 1.0), MAX_SLOWNESS) for r in inside}
    if all(s == 1.0 for s in speeds.values()):
        return None
    total = sum(speeds.values())
    return [round(len(inside) * speeds[r] / total, 4) if r in speeds else 1.0 for r in range(replicas)]


def samples_per_rank(shares: list[float] | None, batch: int, replicas: int) -> list[int]:
    """Samples each replica's ranks take per step: `batch` times its share, rounded by largest
    remainder so that they add up to `replicas x batch`; at least one each."""
    if shares is None:
        return [batch] * replicas
    if len(shares) != replicas or not all(math.isfinite(s) and s > 0 for s in shares):
        raise ValueError(f"batch shares {shares} do not fit {replicas} replicas")
    total = batch * replicas
    ideal = [s * total / sum(shares) for s in shares]
    counts = [max(1, math.floor(x)) for x in ideal]
    # Largest remainders first, lower replica ids on ties; take back from the largest if the
    # floor of one made the sum overshoot.
    order = sorted(range(replicas), key=lambda r: (-(ideal[r] - counts[r]), r))
    i = 0
    while sum(counts) < total:
        counts[order[i % replicas]] += 1
        i += 1
    while sum(counts) > total:
        counts[max(range(replicas), key=lambda r: (counts[r], -r))] -= 1
    return counts


def exchange_weight(counts: list[int], contributors: list[int], me: int) -> float:
    """What `me` multiplies its (per-sample mean) gradients by before the cross-replica sum, so
    that the sum is the mean over every contributing replica's samples."""
    return counts[me] / sum(counts[c] for c in contributors)


def describe(vector: list[float] | None) -> str:
    if vector is None:
        return "every replica takes its nominal share of the global batch"
    return "shares of the global batch " + ", ".join(f"replica {r} {v:.2f}" for r, v in enumerate(vector))


def newest_held(held: dict[int, tuple[list[float] | None, int]]) -> tuple[list[float] | None, int, list[int]] | None:
    """Of the schedules the replicas hold (replica -> (vector, from); from 0: never told one),
    the newest announcement, and the replicas that hold it; None if none was ever made.
    Replicas can differ only when the old coordinator stopped while its last answers went
    out: some heard the newest vector (and may have drawn a batch by it), the others will."""
    told = {r: (tuple(v) if v is not None else None, start) for r, (v, start) in held.items() if start > 0}
    if not told:
        return None
    start = max(s for _, s in told.values())
    newest = collections.Counter(v for v, s in told.values() if s == start)
    vector = max(newest, key=lambda v: (newest[v], v or ()))  # one per round; a tie only from a confused client
    return (list(vector) if vector is not None else None, start,
            sorted(r for r, h in told.items() if h == (vector, start)))


@dataclass
class SharePolicy:
    """The coordinator's policy: who is slow by how much, and the vector that follows."""

    replicas: int
    slowness: dict[int, float] = field(default_factory=dict)
    measured: dict[int, float] = field(default_factory=dict)  # the verdict's slowdown
    published: list[float] | None = None  # the vector in the latest decision
    published_from: int = 0  # ... applies from this step
    members: tuple[int, ...] | None = None  # the latest round's members (None: all replicas)

    def slow(self, replica: int, factor: float | None) -> bool:
        """A `slow` verdict with Rebalance; True if the wanted shares changed."""
        before = self.wanted()
        self.slowness[replica] = self.measured[replica] = max(factor or 1.0, 1.0)
        return self.wanted() != before

    def balance(self, replica: int, busy_over_others: float) -> bool:
        """A rebalanced replica's busy time over the others' (1: its share balances it); True if
        the wanted shares changed."""
        if replica not in self.slowness or not math.isfinite(busy_over_others) or busy_over_others <= 0:
            return False
        before = self.wanted()
        first = self.measured[replica]
        adjusted = self.slowness[replica] * math.sqrt(busy_over_others)
        self.slowness[replica] = max(min(adjusted, first * MAX_ADJUSTMENT), first / MAX_ADJUSTMENT, 1.0)
        return self.wanted() != before

    def restore(self, replica: int) -> bool:
        """The replica is at normal speed again, or a new incarnation; True if it had a share."""
        self.measured.pop(replica, None)
        return self.slowness.pop(replica, None) is not None

    def wanted(self) -> list[float] | None:
        return share_vector(self.slowness, self.replicas, self.members)

    def adopt(self, vector: list[float] | None, start: int, holders: list[int]) -> bool:
        """A restarted coordinator carries on with the schedule the replicas hold: `vector`
        from `start`, as the last decision before the restart published it (and some member
        may already have drawn a batch by it). The slowness it implies is taken back for the
        `holders`, the replicas that were told it (the incarnations that were measured);
        another replica, a new incarnation, gets its nominal share at the next decision.
        False, adopting nothing, for a vector that does not fit this job (a scaled job)."""
        if vector is not None:
            if len(vector) != self.replicas or abs(sum(vector) - self.replicas) > 0.01 * self.replicas:
                return False
            top = max(vector)
            for r in holders:
                if vector[r] < top:
                    self.slowness[r] = self.measured[r] = min(top / vector[r], MAX_SLOWNESS)
        self.published, self.published_from = vector, start
        return True

    def publish(self, all_follow: bool, step: int, members: Collection[int] | None = None) -> bool:
        """The vector for a round of `members` (None: all replicas) decided at `step` (applied
        from step + 1). Only when every member takes its batches from the schedule
        (trainer.batches): a replica with its own data loop would be weighted for samples it
        did not take. True if it changed."""
        self.members = None if members is None else tuple(sorted(members))
        want = self.wanted() if all_follow else None
        if want is not None and self.published is not None and \
                max(abs(a - b) for a, b in zip(want, self.published)) < CHANGE:
            return False
        if want == self.published:
            return False
        self.published, self.published_from = want, step + 1
        return True


@dataclass
class ShareSchedule:
    """A replica's view of the published vectors: the one in force at any step it may take."""

    current: list[float] | None = None
    pending: list[float] | None = None
    pending_from: int = 0

    def update(self, shares: list[float] | None, shares_from: int) -> None:
        """The vector of a round's answer (applies from `shares_from`)."""
        if (shares, shares_from) == (self.pending, self.pending_from):
            return  # the same answer again (most rounds): keep the objects, and what was made of them
        if shares_from != self.pending_from:  # the previous announcement is in force before it
            self.current = self.pending
        self.pending, self.pending_from = shares, shares_from

    def at(self, step: int) -> list[float] | None:
        return self.pending if step >= self.pending_from else self.current
