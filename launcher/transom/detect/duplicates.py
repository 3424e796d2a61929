"""Replicas that train on the same data: the input digests of one step, compared.

The port most scripts get first trains every replica on the same batches, and nothing fails:
nanoGPT seeds its batch sampler with `seed_offset = ddp_rank`, and under Transom every
replica is a small world of its own with ranks 0..world_size-1, so replica 1's rank 0 draws
exactly what replica 0's rank 0 draws. The replicas average identical gradients, the job
trains on 1/N of the data it pays for, and ends "bit-identical" with a clean exit.

Every rank digests the input it trains on, on the steps `input_digest_due` names
(ft/input_digest.py; detect/step_rows.py owns the schedule), and the digest travels in its
signal row. Two (replica, rank) pairs with one digest at one step trained on identical
inputs: ranks of different replicas (seeded by the rank alone), or different ranks of one
replica (seeded by the replica alone, a sampler bug inside the replica).

The findings are the job's, not verdicts against any replica: nothing is restarted or
excluded, because a replica that lies could otherwise forge one against an honest replica
(a forged digest can at most raise this warning). They are kept per pair of replicas, with
the first and newest step that showed each, so that no replica can hide another pair's:

- a pair of replicas on one input (the bug above) is the finding that matters. Ranks of one
  replica on one input are a lesser kind, kept apart per replica (tensor-parallel peers
  share their inputs honestly): shown only while no pair of replicas is, never instead of one;
- a replica that copies another's digest makes a pair with that replica, never between two
  others: the pairs name who reported what;
- memory is per replica: the digests of its own newest `MAX_STEPS` due steps (a replica that
  posts steps far ahead, or floods digests, evicts only its own); a pair is kept while
  either of its replicas is in fewer than `MAX_PARTNERS` pairs, so the pairs are at most
  `MAX_PARTNERS` per replica and one replica's lies fill only its own share. The coordinator
  bounds the ranks and steps a replica may report (claims.py) and the replicas there are.

What is shown (status.training.duplicateData, `transom run`'s summary, the logs) is the pairs
of replicas, grouped where they connect, with their steps; or, while there are none, the
replicas whose own ranks shared inputs.

Pure logic, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from transom.detect.step_rows import input_digest_due

MAX_STEPS = 8  # due steps whose digests are kept per replica (its newest): 350 steps at one digest every 50
MAX_PARTNERS = 16  # pairs a replica makes while it has room (a pair is kept if either member has)
MAX_NAMED = 16  # replicas or ranks a message names; the rest are counted
MAX_GROUPS = 3  # groups of replicas a message names, so that it stays within the CRD's 1024 characters
CHECKED = "Nothing is restarted"  # a warning, not a verdict
FIX_ACROSS = ("seed or shard the data by the data-parallel rank across replicas (trainer.data_rank / "
              "trainer.data_world_size, or trainer.generator(micro_step)), not by ctx.rank alone")
FIX_WITHIN = ("seed or shard the data by the data-parallel rank (trainer.data_rank / trainer.data_world_size, "
              "or trainer.generator(micro_step)), not by the replica alone; tensor-parallel peers do share "
              "their inputs")
NOT_THE_DATA = "if the model's first tensor argument is not the data, give the data to trainer.fingerprint_input()"


@dataclass(frozen=True)
class DuplicateData:
    """What the job shows: ranks that trained on identical inputs, from `step` to `last_step`."""

    step: int  # the first step that showed it
    last_step: int  # the newest
    replicas: tuple[int, ...]  # the replicas of those ranks, sorted
    ranks: tuple[int, ...]  # their ranks (within their replicas), sorted
    across: bool  # ranks of different replicas (else: ranks of one replica each)
    message: str

    def summary(self) -> dict:
        """As status.training.duplicateData and `transom run`'s summary show it."""
        return {"step": self.step, "replicas": list(self.replicas), "message": self.message}


@dataclass
class _Span:
    """When a pair of replicas (or one replica's ranks) trained on one input, and which ranks."""

    first: int
    last: int
    ranks: set[int] = field(default_factory=set)

    def see(self, step: int, ranks: Iterable[int]) -> bool:
        """Take one more step that showed it; whether anything shown changed."""
        before = (self.first, self.last, len(self.ranks))
        self.first, self.last = min(self.first, step), max(self.last, step)
        self.ranks.update(ranks)
        return before != (self.first, self.last, len(self.ranks))


_Group = tuple[list[int], list[int], int, int]  # replicas, ranks, first step, last step


def message(step: int, replicas: Iterable[int], ranks: Iterable[int], last_step: int | None = None) -> str:
    """What a user reads about one group: who trained on what, when, and the fix."""
    return _text([(sorted(replicas), sorted(ranks), step, step if last_step is None else last_step)])


def _text(groups: list[_Group]) -> str:
    across = len(groups[0][0]) > 1
    parts: list[str] = []
    for replicas, ranks, first, last in groups[:MAX_GROUPS]:
        who = f"replicas {_names(replicas)}" if across else f"ranks {_names(ranks)} of replica {replicas[0]}"
        at = f"step {first}" if first == last else f"steps {first} to {last}"
        parts.append(f"{who} trained on identical inputs at {at}" if not parts else f"{who} at {at}")
    more = f" (and {len(groups) - MAX_GROUPS} more groups)" if len(groups) > MAX_GROUPS else ""
    fix = FIX_ACROSS if across else FIX_WITHIN
    return f"{', '.join(parts)}{more}: {fix}. {CHECKED}; {NOT_THE_DATA}."


def _names(ids: list[int]) -> str:
    """"0 and 1", "0, 1 and 2", "0, 1, ..., 15 and 9 more"."""
    shown = [str(i) for i in ids[:MAX_NAMED]]
    if len(ids) > MAX_NAMED:
        return f"{', '.join(shown)} and {len(ids) - MAX_NAMED} more"
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


@dataclass
class _Holders:
    """Who reported one digest at one step: each replica's ranks, and which of those replicas
    are in fewer than MAX_PARTNERS pairs (only they can make a new pair with a replica that is
    in as many)."""

    ranks: dict[int, set[int]] = field(default_factory=dict)
    open: set[int] = field(default_factory=set)


class DuplicateInputs:
    """The digests of each replica's newest due steps, compared; the pairs they show.

    A pair is kept when either of its replicas is in fewer than `max_partners` pairs: one
    replica's lies fill its own record, and a replica that trains on the same data as
    hundreds of others is still named (it makes its first pairs itself). So the pairs are at
    most `max_partners` per replica, and each digest costs a bounded amount of work."""

    def __init__(self, max_steps: int = MAX_STEPS, max_partners: int = MAX_PARTNERS):
        self.max_steps, self.max_partners = max_steps, max_partners
        self._digests: dict[int, dict[int, dict[int, int]]] = {}  # replica -> due step -> rank -> digest
        self._holders: dict[int, dict[int, _Holders]] = {}  # step -> digest -> who reported it
        self._pairs: dict[int, dict[int, _Span]] = {}  # replica -> partner -> the pair's span (shared)
        self._within: dict[int, _Span] = {}  # replica -> when its own ranks shared one input
        self._finding: DuplicateData | None = None  # built anew when read after a change
        self._changed = False

    def observe(self, step: int, replica: int, rank: int, digest: int) -> bool:
        """Take one rank's digest of `step`'s input; True when it makes the job's first finding
        of its kind (across replicas, or within one). A digest of a step that is not due, or
        older than every step the replica has kept, is not taken."""
        ranks = self._kept(replica, step)
        if ranks is None or rank in ranks:
            return False  # a rank's first digest of a step stands (a restarted one trains it again)
        ranks[rank] = digest
        had_pairs, had_within = bool(self._pairs), bool(self._within)
        h = self._holders.setdefault(step, {}).setdefault(digest, _Holders())
        if replica in h.ranks and self._within.setdefault(replica, _Span(step, step)).see(
                step, h.ranks[replica] | {rank}):
            self._changed = True
        self._compare(replica, rank, step, h)
        h.ranks.setdefault(replica, set()).add(rank)
        if self._room(replica):
            h.open.add(replica)
        return (bool(self._pairs) and not had_pairs) or (bool(self._within) and not had_within)

    @property
    def finding(self) -> DuplicateData | None:
        """The pairs of replicas on one input (grouped where they connect), else the replicas
        whose own ranks shared inputs; None while there is neither."""
        if self._changed:
            self._changed = False
            groups = self._groups() or [([r], sorted(s.ranks), s.first, s.last) for r, s in self._within.items()]
            groups.sort(key=lambda g: (g[2], g[0]))
            self._finding = _finding(groups) if groups else None
        return self._finding

    def pairs(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Every pair of replicas kept, as (first step, last step)."""
        return {(a, b): (span.first, span.last) for a, theirs in self._pairs.items()
                for b, span in theirs.items() if a < b}

    def kept(self, replica: int) -> int:
        """Digests kept of `replica` (bounded: its newest due steps, one per rank)."""
        return sum(len(ranks) for ranks in self._digests.get(replica, {}).values())

    def _room(self, replica: int) -> bool:
        return len(self._pairs.get(replica, ())) < self.max_partners

    def _compare(self, x: int, rank: int, step: int, h: _Holders) -> None:
        """Replica `x`'s rank `rank` reported the digest `h` holds: the pairs it shows."""
        mine = self._pairs.get(x, {})
        for y, span in mine.items():  # pairs kept already: one more step shows them
            if y in h.ranks and span.see(step, h.ranks[y] | {rank}):
                self._changed = True
        for y in list(h.ranks):  # new pairs while x has room: a bounded number of these
            if not self._room(x):
                break
            if y != x and y not in mine:
                self._link(x, y, step, h.ranks[y] | {rank})
        for y in list(h.open):  # then with the holders that have room
            if y != x and y not in mine and self._room(y):
                self._link(x, y, step, h.ranks[y] | {rank})

    def _link(self, x: int, y: int, step: int, ranks: set[int]) -> None:
        span = _Span(step, step, set(ranks))
        self._pairs.setdefault(x, {})[y] = self._pairs.setdefault(y, {})[x] = span
        self._changed = True
        for r in (x, y):
            if not self._room(r):  # full: no longer among the holders others may make new pairs with
                for s, digests in self._digests.get(r, {}).items():
                    for digest in set(digests.values()):
                        self._holders[s][digest].open.discard(r)

    def _groups(self) -> list[_Group]:
        """The pairs, joined into groups of replicas where they connect."""
        parent: dict[int, int] = {}

        def root(r: int) -> int:
            while parent.setdefault(r, r) != r:
                parent[r] = parent[parent[r]]
                r = parent[r]
            return r

        for a, theirs in self._pairs.items():
            for b in theirs:
                parent[root(a)] = root(b)
        groups: dict[int, _Group] = {}
        for a, theirs in self._pairs.items():
            for span in theirs.values():
                replicas, ranks, first, last = groups.setdefault(root(a), ([], [], span.first, span.last))
                if a not in replicas:
                    replicas.append(a)
                ranks.extend(k for k in span.ranks if k not in ranks)
                groups[root(a)] = (replicas, ranks, min(first, span.first), max(last, span.last))
        return [(sorted(g[0]), sorted(g[1]), g[2], g[3]) for g in groups.values()]

    def _kept(self, replica: int, step: int) -> dict[int, int] | None:
        """`replica`'s record of `step` (rank -> digest), made if the step is due and not older
        than every step the replica has kept; making it may forget the replica's oldest."""
        if not input_digest_due(step):
            return None
        mine = self._digests.setdefault(replica, {})
        if step not in mine:
            if len(mine) >= self.max_steps:
                oldest = min(mine)
                if step < oldest:
                    return None
                self._forget(replica, oldest)
            mine[step] = {}
        return mine[step]

    def _forget(self, replica: int, step: int) -> None:
        """Drop `replica`'s digests of `step`, and only its own."""
        at = self._holders.get(step, {})
        for digest in set(self._digests[replica].pop(step).values()):
            h = at.get(digest)
            if h is None:
                continue
            h.ranks.pop(replica, None)
            h.open.discard(replica)
            if not h.ranks:
                del at[digest]
        if not at:
            self._holders.pop(step, None)


def _finding(groups: list[_Group]) -> DuplicateData:
    replicas = sorted({r for g in groups for r in g[0]})
    ranks = sorted({k for g in groups for k in g[1]})
    return DuplicateData(step=min(g[2] for g in groups), last_step=max(g[3] for g in groups),
                         replicas=tuple(replicas), ranks=tuple(ranks), across=len(groups[0][0]) > 1,
                         message=_text(groups))
