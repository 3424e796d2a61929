"""Who a hang waits for: the rank that never arrived at a collective, from the ranks' counts.

The hang watchdog (launch/signal_forwarder.py) fires in the replica whose worker stopped making
progress while not in one of Transom's waits. Where a wait is not seen as one (a device sync
after an asynchronous NCCL collective, a collective the watchdog cannot tell from work), the
worker it names is often a healthy one, stuck behind the rank that never entered the collective.
Every worker counts the collectives it *entered* and *completed* (transom/collective_counts.py):
the replica's own control collectives, and the cross-replica all-reduces of its current group;
the launchers forward the counts (`SignalBatch.collectives`). At a hang verdict the coordinator
asks `CollectiveLedger.blame`:

1. Inside the accusing replica: a rank whose count of the replica's collectives is below the
   others', while every other rank entered more and still waits (entered > completed), and
   which waits in none itself, is the one they wait for (`laggard`). Every count here is the
   accusing replica's word about itself, which the coordinator takes as it takes its rows.
2. If that rank (or the watchdog's, when no rank lags) waits in a cross-replica all-reduce,
   the member it waits for is another replica X: rank k of X, in the same group, entered fewer
   all-reduces and waits in none. Then the refinement of step 1 inside X names X's rank.

The trust boundary (docs/architecture.md, "Who may speak for a replica"): a replica's counts
speak only for that replica. The accuser's counts alone never condemn X: X is blamed across
replicas only when (a) X's *own* counts, posted with X's own credential, show it behind (an
accuser cannot forge them) and (b) the coordinator itself saw X stall: none of X's ranks' counts
changed for `stall_s` by the coordinator's clock, X is a member of the current quorum (expected
in that collective), and X has not asked for the open round (the membership's own record: a
replica that asked has arrived, as every replica of a paused job has), and (c) X is behind
*every* member that posted counts of that group, not only the accuser. A liar can then condemn
only itself: it may post counts that put it behind (it is blamed, as it asked), or counts that
put others behind (an honest member level with X keeps X from being named, and X must show the
lag and the stall itself). With two replicas, (c) rests on the accuser's count alone; (a) and
(b) still need X's own counts and the coordinator's observation of X. Otherwise `blame`
returns None and the verdict stays as the watchdog had it (the replica whose watchdog fired,
and its rank): today's behaviour.

Pure bookkeeping, no I/O; the coordinator calls it under its lock (coordinator/detection.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class RankCounts:
    """One rank's counts as its own replica posted them (transom/collective_counts.py)."""

    rank: int
    group_id: int  # the quorum id of the cross-replica group the ftar counts are of
    ftar_entered: int
    ftar_completed: int
    group_entered: int
    group_completed: int

    @property
    def in_ftar(self) -> bool:
        return self.ftar_entered > self.ftar_completed

    @property
    def in_group(self) -> bool:
        return self.group_entered > self.group_completed


@dataclass(frozen=True)
class Culprit:
    replica: int
    rank: int
    evidence: str


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def laggard(replica: int, ranks: dict[int, RankCounts]) -> Culprit | None:
    """The rank of `replica` that its other ranks wait for in a control collective, if the
    counts say so plainly: it entered fewest, waits in none, and every other rank entered more
    and waits. The lowest such rank where several lag."""
    if len(ranks) < 2:
        return None
    low = min(c.group_entered for c in ranks.values())
    behind = sorted(k for k, c in ranks.items() if c.group_entered == low)
    ahead = sorted(k for k, c in ranks.items() if c.group_entered > low)
    if not ahead or not all(ranks[k].in_group for k in ahead) or ranks[behind[0]].in_group:
        return None
    high = max(ranks[k].group_entered for k in ahead)
    return Culprit(replica, behind[0],
                   f"rank {behind[0]} of replica {replica} entered {low} of its replica's collectives, "
                   f"the others ({_ranks(ahead)}) entered {high} and wait in it")


def behind_across(accuser: int, mine: RankCounts, others: dict[int, RankCounts], members: Collection[int],
                  stalled: Collection[int]) -> Culprit | None:
    """The replica whose rank `mine.rank` the accuser's rank waits for in a cross-replica
    all-reduce: `others` maps each replica to that rank's counts, as the replica itself posted
    them. Only a member of the quorum that the coordinator saw stall (`stalled`) is named, and
    only if its own counts, in the same group, show it in no all-reduce and behind the accuser
    and every other member that posted counts of that group: one liar cannot move the honest
    members' counts, so it cannot put an honest replica behind them."""
    if not mine.in_ftar:
        return None
    same = {x: c for x, c in others.items() if x in members and c.group_id == mine.group_id}
    same[accuser] = mine
    found = []
    for x, c in same.items():
        rest = [o.ftar_entered for y, o in same.items() if y != x]
        if x != accuser and x in stalled and not c.in_ftar and all(c.ftar_entered < e for e in rest):
            found.append((c.ftar_entered, x))
    if not found:
        return None
    entered, x = min(found)
    return Culprit(x, mine.rank,
                   f"rank {mine.rank} of replica {x} entered {entered} all-reduces of quorum {mine.group_id} and "
                   f"made no progress since; rank {mine.rank} of replica {accuser} entered {mine.ftar_entered} "
                   f"and waits in it")


class CollectiveLedger:
    """The newest counts of every (replica, rank), and when the coordinator last saw them change."""

    def __init__(self) -> None:
        self._counts: dict[int, dict[int, RankCounts]] = {}
        self._changed_at: dict[int, dict[int, float]] = {}

    def record(self, replica: int, counts: RankCounts, now: float) -> None:
        """Take `replica`'s own post about its rank (the caller checked that the poster is
        `replica`'s live incarnation and the rank one it has)."""
        by_rank = self._counts.setdefault(replica, {})
        if by_rank.get(counts.rank) != counts:
            by_rank[counts.rank] = counts
            self._changed_at.setdefault(replica, {})[counts.rank] = now

    def forget(self, replica: int) -> None:
        """A new incarnation: its processes count from 0 again."""
        self._counts.pop(replica, None)
        self._changed_at.pop(replica, None)

    def view(self, replica: int) -> dict[int, RankCounts]:
        return dict(self._counts.get(replica, {}))

    def stalled(self, replica: int, now: float, stall_s: float) -> bool:
        """None of `replica`'s ranks' counts changed for `stall_s` (by the coordinator's clock)."""
        times = self._changed_at.get(replica, {})
        return bool(times) and all(now - t >= stall_s for t in times.values())

    def blame(self, accuser: int, rank: int | None, members: Collection[int], now: float,
              stall_s: float, asked: Collection[int] = ()) -> Culprit | None:
        """Whom the hang `accuser`'s watchdog reported (its `rank`) waits for; None: the counts
        do not say, and the watchdog's word stands (the module's docstring says whom they may
        name). `members`: the current quorum's; `asked`: the replicas that asked for the open
        round (they arrived: a paused job's replicas all stall, and none of them is to blame)."""
        own = self.view(accuser)
        lag = laggard(accuser, own)
        k = lag.rank if lag is not None else rank
        mine = own.get(k) if k is not None else None
        if mine is not None and mine.in_ftar:
            others = {x: c[mine.rank] for x, c in self._counts.items() if mine.rank in c}
            stalled = [x for x in members if x not in asked and self.stalled(x, now, stall_s)]
            across = behind_across(accuser, mine, others, members, stalled)
            if across is None:
                return None  # it waits for another replica, and none is shown to be behind
            inner = laggard(across.replica, self.view(across.replica))
            if inner is not None and not self._counts[across.replica][inner.rank].in_ftar:
                return Culprit(across.replica, inner.rank, f"{across.evidence}; {inner.evidence}")
            return across
        return lag if lag is None else Culprit(lag.replica, lag.rank, lag.evidence + self._witnesses(lag))

    def _witnesses(self, culprit: Culprit) -> str:
        """What the other replicas' counts add about the culprit's rank: those that wait for it
        in an all-reduce of its group. Said, never acted on: it is their word about another."""
        mine = self._counts.get(culprit.replica, {}).get(culprit.rank)
        if mine is None or mine.in_ftar:
            return ""
        waiting = sorted(x for x, by_rank in self._counts.items()
                         if x != culprit.replica and (c := by_rank.get(culprit.rank)) is not None
                         and c.group_id == mine.group_id and c.in_ftar and c.ftar_entered > mine.ftar_entered)
        if not waiting:
            return ""
        whose = ("replica " if len(waiting) == 1 else "replicas ") + ", ".join(map(str, waiting))
        return (f"; rank {culprit.rank} of {whose} entered all-reduce "
                f"{mine.ftar_entered + 1} of quorum {mine.group_id}, which it never entered, and waits in it")
