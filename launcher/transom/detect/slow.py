"""Fail-slow: which rank is slow, told apart from steps that are slow because their work is.

Micro-batch time follows the workload (ResiHP): with packed sequences the tokens per batch
hardly change, but attention's cost grows with the square of each sequence's length, so a
batch of long documents takes much longer than one of short ones. A detector that compares a
step with the recent median (step time > 1.25 x the rolling median) raises an alarm at every
batch of long documents. Here each rank has a predictor, `time ~ a*tokens + b*sum_len_sq + c`,
fitted online by least squares with forgetting (a rank that reports no workload falls back to
its running level, `c`), and a step's *ratio* is its busy time over the prediction.

A step is slow when its rank's ratio exceeds `slow_factor` times the step's *reference*: the
median over the replicas of each replica's median ratio. A change that slows everybody (a
bigger model phase, a shared filesystem) is nobody's fault. Each replica counts once and
the median needs at least MIN_REPLICAS of them, so that one replica's figures (a liar's, or
a broken clock's) can move the reference only within the range of the others': a replica
that reports a busy time of zero cannot make the rest look slow. With fewer replicas
reporting, a rank is judged by its own history only (its ratio against its own predictor),
and the others' figures can only excuse it (every replica slow at once), never condemn it.
`slow_steps` slow steps in a row make a verdict. A slow step does not train the predictor,
so a slowdown is not learnt as the new normal.
A rank's own predictor cannot see a rank that was slow from its first step (a replacement
placed on a degraded GPU, or any rank after the coordinator restarted): it learns that speed
as its normal. So each step is also judged against the *pool*, one predictor fitted on the
normal steps of every rank: the rank's time over what the pool predicts for its workload,
relative to the same reference of that ratio, is the second measure, and the larger of the
two counts (data-parallel ranks do the same work; a rank that is always slower than its
peers for the same workload is slow). The pool compares ranks with each other, so it is used
only with MIN_REPLICAS replicas reporting, and a step trains it only when its ratio lies
within `slow_factor` of the reference either way (a replica reporting absurd times does
not teach it what a step takes). Steps in which
the rank also worked on a catch-up (serving or fetching state) are left out. When every
rank of a replica is slow the verdict names the replica (rank None): its node or its
network, not one GPU. A verdict carries the slowdown (the median relative ratio of the run
that made it), which Rebalance sizes the replica's share by; while a replica has a verdict,
every `slow_steps` steps report its busy time over the others' as it is (`updates`: 1 when
its share balances it), and once its ranks are at normal speed for `slow_steps` steps in a
row it is reported recovered.
A rebalanced rank (a smaller or larger batch than its nominal one, `batch_share`) is judged
per nominal batch: its time and workload divided by its share, so that the predictor,
fitted on nominal batches, stays in its range and a slowdown stays the same number
whatever the share.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from transom.detect.step_rows import DetectionSettings, Signal

FORGET = 0.995  # the predictor's memory: about the last 200 steps weigh
MIN_REPLICAS = 3  # replicas reporting a step before the others' figures can make a rank slow
RIDGE = 1e-6


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small dense system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            return [0.0] * n
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass
class StepTimeModel:
    """`time ~ a*tokens + b*sum_len_sq + c`, least squares with exponential forgetting."""

    n: int = 0
    _scale: tuple[float, float] | None = None  # the first workload seen: keeps the system well conditioned
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    _theta: list[float] | None = None

    def _x(self, tokens: float | None, sum_len_sq: float | None) -> list[float]:
        if self._scale is None:
            self._scale = (tokens or 1.0, sum_len_sq or 1.0)
        return [(tokens or 0.0) / self._scale[0], (sum_len_sq or 0.0) / self._scale[1], 1.0]

    def add(self, tokens: float | None, sum_len_sq: float | None, seconds: float, forget: float = FORGET) -> None:
        x = self._x(tokens, sum_len_sq)
        for i in range(3):
            self._xy[i] = forget * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = forget * self._xx[i][j] + x[i] * x[j]
        self.n += 1
        self._theta = None

    def age(self, forget: float = FORGET) -> None:
        """Forget once for a whole step's rows (the pool adds them with `forget=1`), so its
        memory is counted in steps whatever the number of ranks."""
        self._xy = [forget * v for v in self._xy]
        self._xx = [[forget * v for v in row] for row in self._xx]
        self._theta = None

    def predict(self, tokens: float | None, sum_len_sq: float | None) -> float:
        if self._theta is None:
            scale = max(self._xx[2][2], 1e-12)
            a = [[v + (RIDGE * scale if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._xx)]
            self._theta = _solve(a, self._xy)
        x = self._x(tokens, sum_len_sq)
        return sum(t * v for t, v in zip(self._theta, x))


def _per_nominal_batch(s: Signal) -> Signal:
    if s.batch_share is None:
        return s
    k = 1.0 / s.batch_share
    return replace(s, step_seconds=s.step_seconds * k, batch_share=None,
                   tokens=None if s.tokens is None else s.tokens * k,
                   sum_len_sq=None if s.sum_len_sq is None else s.sum_len_sq * k)


def _reference(ratios: dict[tuple[int, int], float]) -> float | None:
    """The median over the replicas of each replica's median ratio; None with fewer than
    MIN_REPLICAS replicas. One value per replica, so a replica's number of ranks (or of rows)
    weighs nothing, and a median of at least three values lies between two of them: one
    replica cannot move it outside the range of the others."""
    by_replica: dict[int, list[float]] = {}
    for (replica, _), v in ratios.items():
        by_replica.setdefault(replica, []).append(v)
    if len(by_replica) < MIN_REPLICAS:
        return None
    return statistics.median(statistics.median(v) for v in by_replica.values())


def _relative(ratios: dict[tuple[int, int], float], slow_factor: float) -> dict[tuple[int, int], float]:
    """Each rank's ratio over the step's reference (`_reference`), in one pass: a job's step
    has as many ranks as it has GPUs. With fewer replicas than MIN_REPLICAS the ratio stands
    as it is (against the rank's own predictor), unless every replica is slow at once: that
    is the job's step, not a replica's fault."""
    if not ratios:
        return {}
    ref = _reference(ratios)
    if ref is None:
        medians: dict[int, list[float]] = {}
        for (replica, _), v in ratios.items():
            medians.setdefault(replica, []).append(v)
        everyone = all(statistics.median(v) > slow_factor for v in medians.values())
        ref = min(statistics.median(v) for v in medians.values()) if everyone else 1.0
    return {key: v / max(ref, 1e-12) for key, v in ratios.items()}


@dataclass
class _Rank:
    model: StepTimeModel = field(default_factory=StepTimeModel)
    run: int = 0  # slow steps in a row
    run_from: int = -1  # the first step of the current run
    run_ratios: list[float] = field(default_factory=list)  # its relative ratios (the first slow_steps)
    normal_run: int = 0  # steps at normal speed in a row


class FailSlow:
    def __init__(self, settings: DetectionSettings):
        self.settings = settings
        self.ranks: dict[tuple[int, int], _Rank] = {}
        self.flagged: set[int] = set()  # replicas with a verdict, until they are at normal speed
        self.recovered: list[int] = []  # replicas found at normal speed again, for the caller to take
        self.updates: dict[int, float] = {}  # flagged replica -> its busy time over the others', for the caller
        self._balance: dict[int, tuple[float, list[float]]] = {}  # flagged replica -> (its share, that ratio by step)
        self.pool = StepTimeModel()  # every rank's normal steps: what a rank of this job takes for a workload
        self.pool_steps = 0

    def forget(self, replica: int) -> None:
        """A new incarnation of `replica` (new hardware, maybe): start its ranks over."""
        for key in [k for k in self.ranks if k[0] == replica]:
            del self.ranks[key]
        self.flagged.discard(replica)
        self.updates.pop(replica, None)
        self._balance.pop(replica, None)

    def step(self, step: int, signals: Sequence[Signal]) -> list[tuple[int, int | None, int, str, float]]:
        """Observe one step's signals; returns (replica, rank or None, first step, message,
        slowdown) for each rank or replica that is now found slow."""
        # A rank that also served or fetched a joiner's state did more than its workload:
        # its step is neither judged nor learnt from (a catch-up is not a slow device).
        signals = [s for s in signals if not s.recovery]
        self._measure_balance(signals)
        signals = [_per_nominal_batch(s) for s in signals]
        ratios: dict[tuple[int, int], float] = {}  # time over the rank's own prediction
        pooled: dict[tuple[int, int], float] = {}  # time over the pool's prediction
        pool_warm = self.pool_steps >= self.settings.warmup_steps
        for s in signals:
            r = self.ranks.setdefault((s.replica, s.rank), _Rank())
            if r.model.n >= self.settings.warmup_steps:
                ratios[(s.replica, s.rank)] = s.step_seconds / max(r.model.predict(s.tokens, s.sum_len_sq), 1e-9)
                if pool_warm:
                    pooled[(s.replica, s.rank)] = s.step_seconds / max(self.pool.predict(s.tokens, s.sum_len_sq), 1e-9)
        factor = self.settings.slow_factor
        relative_own = _relative(ratios, factor)
        # The pool compares ranks with each other: only against a reference one replica cannot move.
        relative_pool = _relative(pooled, factor) if _reference(pooled) is not None else {}
        found, normal = [], []
        for s in signals:
            key = (s.replica, s.rank)
            r = self.ranks[key]
            if key not in ratios:
                r.model.add(s.tokens, s.sum_len_sq, s.step_seconds)
                normal.append(s)
                continue
            relative = max(relative_own[key], relative_pool.get(key, 0.0))
            if relative > self.settings.slow_factor:
                r.run_from, r.run_ratios = (step, []) if r.run == 0 else (r.run_from, r.run_ratios)
                r.run += 1
                r.normal_run = 0
                if len(r.run_ratios) < self.settings.slow_steps:
                    r.run_ratios.append(relative)
                if r.run == self.settings.slow_steps:
                    slowdown = statistics.median(r.run_ratios)
                    found.append((s.replica, s.rank, r.run_from,
                                  f"rank {s.rank} took {slowdown:.2f}x the time its workload predicts, relative "
                                  f"to the other ranks, for {r.run} steps", slowdown))
            else:
                r.run = 0
                r.normal_run += 1
                r.model.add(s.tokens, s.sum_len_sq, s.step_seconds)
                normal.append(s)
        # A step teaches the pool only when it is near the reference: a replica that reports
        # absurd times, fast or slow, must not set what a step of this job takes.
        normal = [s for s in normal if 1 / factor <= relative_pool.get((s.replica, s.rank), 1.0) <= factor]
        if normal:
            self.pool.age()
            for s in normal:
                self.pool.add(s.tokens, s.sum_len_sq, s.step_seconds, forget=1.0)
            self.pool_steps += 1
        self._find_recovered()
        out = self._whole_replicas(found)
        self.flagged.update(f[0] for f in out)
        return out

    def _measure_balance(self, signals: Sequence[Signal]) -> None:
        """For each flagged replica, its busy time over the replicas' median (as they are, not
        per nominal batch: 1 when its share makes it finish with them); every `slow_steps`
        steps at one share the median goes to `updates`, which Rebalance adjusts the shares by.
        Steps before its share changed say nothing about the new one: they are not counted.
        Each replica's time is its slowest rank's (it waits for it), and the median over all
        of them, itself included, needs MIN_REPLICAS replicas: one other replica's figures
        alone cannot resize anyone's share."""
        busiest: dict[int, float] = {}
        for s in signals:
            busiest[s.replica] = max(busiest.get(s.replica, 0.0), s.step_seconds)
        if len(busiest) < MIN_REPLICAS or statistics.median(busiest.values()) <= 0:
            return
        middle = statistics.median(busiest.values())
        for replica in self.flagged:
            mine = [s for s in signals if s.replica == replica]
            if not mine or mine[0].batch_share is None:
                continue
            share, seen = self._balance.get(replica, (None, []))
            if share != mine[0].batch_share:
                share, seen = mine[0].batch_share, []
                self._balance[replica] = (share, seen)
            seen.append(busiest[replica] / middle)
            if len(seen) >= self.settings.slow_steps:
                self.updates[replica] = statistics.median(seen)
                seen.clear()

    def _find_recovered(self) -> None:
        """Replicas with a verdict whose every rank has been at normal speed for slow_steps steps."""
        for replica in sorted(self.flagged):
            ranks = [r for k, r in self.ranks.items() if k[0] == replica]
            if ranks and all(r.normal_run >= self.settings.slow_steps for r in ranks):
                self.flagged.discard(replica)
                self._balance.pop(replica, None)
                self.recovered.append(replica)

    def _whole_replicas(self, found: list[tuple[int, int, int, str, float]]
                        ) -> list[tuple[int, int | None, int, str, float]]:
        out: list[tuple[int, int | None, int, str, float]] = []
        for replica in sorted({f[0] for f in found}):
            ranks = [k for k in self.ranks if k[0] == replica]
            if len(ranks) > 1 and all(self.ranks[k].run >= self.settings.slow_steps for k in ranks):
                first = min(self.ranks[k].run_from for k in ranks)
                slowdown = statistics.median(statistics.median(self.ranks[k].run_ratios) for k in ranks)
                out.append((replica, None, first, f"every rank of the replica is slow ({len(ranks)} ranks)",
                            slowdown))
            else:  # the replica waits for its slowest rank
                mine = [f for f in found if f[0] == replica]
                out += [max(mine, key=lambda f: f[4])]
        return out
