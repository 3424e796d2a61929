"""Every detector over one stream of signals, one step at a time, and the verdicts they reach.

Signals arrive per launcher, at most once a second, so the ranks of one step come in at
different times. `Detectors` holds each step until every rank seen within `lag_steps` steps
has reported it (a rank that stopped reporting holds it back that long at most; the
coordinator sets `lag_steps` to two post intervals of the job's steps, `lag_steps_for`, so
that a rank whose rows merely wait for its launcher's next post is not taken for stopped),
then judges the step as a whole:

- hang: a rank's step took `hang_timeout_s` or more (in a live job the launcher's watchdog
  reports it before that step ever ends; in a trace it is such a row);
- nan: a replica whose own loss or gradients were not finite, `bad_steps` times within
  `loss_window` steps; not when every replica's were (then it is the data or the model);
- loss_spike: the same for spikes against the replica's own history (loss.py);
- sdc: a replica whose fingerprint (parameters and optimizer state) differs from the
  majority's (sdc.py), at once; the majority's value of each (step, rank) stays on record
  for a while (`fingerprint`): a replica catching up checks the snapshot it was sent
  against it. Replicas that disagree with no strict majority (two replicas) are no verdict
  against anyone: `take_diverged` says so once, and the coordinator stops the job;
- slow: fail-slow (slow.py).

A verdict names the replica (and the rank, where one rank is to blame), the kind, the first
step it concerns, a message, and whom it blames: the node (slow, sdc: the hardware) or the
replica (a hang, non-finite values, spikes: the software or the data, as far as anyone can
tell). One verdict per replica and kind, until `forget(replica)` (a new incarnation).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from transom.detect.loss import LossHistory
from transom.detect.sdc import minority
from transom.detect.slow import FailSlow
from transom.detect.step_rows import DetectionSettings, Signal
from transom.words import NODE_KINDS, VerdictKind

Kind = VerdictKind
KINDS: tuple[VerdictKind, ...] = tuple(VerdictKind)
LAG_STEPS = 64  # a rank that stopped reporting holds a step back this many steps at most
MAX_PENDING_STEPS = 1024  # steps held at most (a silent rank cannot make memory grow)
MAX_FINGERPRINTS = 4096  # (step, rank) fingerprints kept on record, the newest


@dataclass(frozen=True)
class Fingerprint:
    """What the replicas' rows of one (step, rank) said about its parameters."""

    voters: int  # replicas that fingerprinted it
    value: int | None  # the strict majority's value; None when they disagree without one


@dataclass(frozen=True)
class Verdict:
    replica: int
    rank: int | None  # None: the whole replica
    kind: VerdictKind
    first_step: int
    message: str
    reached_step: int = -1  # the step whose signals completed the evidence (detection delay)
    slowdown: float | None = None  # slow: how many times longer than predicted, relative to the others
    # hang: the rank the hang waits for, where the collectives' counts name it (detect/hangs.py;
    # `replica` and `rank` are then the same), and why they do; None: the watchdog's word stands
    culprit_replica: int | None = None
    culprit_rank: int | None = None
    evidence: str | None = None

    @property
    def blame(self) -> str:
        return "Node" if self.kind in NODE_KINDS else "Replica"

    def summary(self) -> dict:
        out: dict = {"replica": self.replica, "rank": self.rank, "kind": self.kind, "first_step": self.first_step}
        if self.culprit_replica is not None:
            out.update(culprit_replica=self.culprit_replica, culprit_rank=self.culprit_rank, evidence=self.evidence)
        return out


def lag_steps_for(post_interval_s: float, step_seconds: float | None) -> int:
    """How many steps behind the newest row a rank's rows may be and the rank still counts as
    reporting. Rows come in a launcher's posts, one every `post_interval_s`: a live rank's
    newest row can be a post interval of steps behind another's (more than LAG_STEPS when
    steps take milliseconds). Two intervals of `step_seconds` steps, at least LAG_STEPS, at
    most half of MAX_PENDING_STEPS (what is held stays bounded)."""
    if step_seconds is None or step_seconds <= 0:
        return LAG_STEPS
    return min(MAX_PENDING_STEPS // 2, max(LAG_STEPS, math.ceil(2 * post_interval_s / step_seconds)))


class Detectors:
    def __init__(self, settings: DetectionSettings, lag_steps: int = LAG_STEPS):
        self.settings, self.lag_steps = settings, lag_steps
        self.slow = FailSlow(settings)
        self._pending: dict[int, list[Signal]] = {}
        self._ranks_seen: dict[tuple[int, int], int] = {}  # (replica, rank) -> last step reported
        # (replica, rank) -> the first step its incarnation reported: a replica that restarted
        # is not waited for in the steps before it came back (it never reports them).
        self._first_seen: dict[tuple[int, int], int] = {}
        # replica -> the first step it does not train: it stepped aside (trainer.aside()), and
        # its rows of later steps are not waited for until it reports one again.
        self._away: dict[int, int] = {}
        self._newest = -1
        self._judged = -1  # steps up to here are judged; later signals of them are dropped
        self._losses: dict[int, LossHistory] = {}
        self._bad: dict[tuple[int, str], collections.deque[int]] = {}
        self._reported: set[tuple[int, str]] = set()
        self._diverged: str | None = None  # the first disagreement without a majority, until taken
        self.diverged_at: int | None = None  # its step, once found (it is never forgotten)
        self._prints: collections.OrderedDict[tuple[int, int], Fingerprint] = collections.OrderedDict()

    # --- input --------------------------------------------------------------------------------
    def observe(self, signal: Signal) -> list[Verdict]:
        """Take one signal; returns the verdicts of the steps this completes."""
        self._add(signal)
        return self._judge_ready(final=False)

    def observe_all(self, signals: Iterable[Signal]) -> list[Verdict]:
        """Take signals in step order; steps are judged after each run of one step's rows, not
        after every row (whether a step is complete looks at every rank seen)."""
        out: list[Verdict] = []
        run_step = None
        for s in signals:
            if run_step is not None and s.step != run_step:
                out += self._judge_ready(final=False)
            run_step = s.step
            self._add(s)
        return out + self._judge_ready(final=False)

    def _add(self, signal: Signal) -> None:
        key = (signal.replica, signal.rank)
        away = self._away.get(signal.replica)
        if away is not None and signal.step >= away:  # back: the steps it missed are not waited for
            del self._away[signal.replica]
            for k in [k for k in self._first_seen if k[0] == signal.replica]:
                self._first_seen[k] = signal.step
        self._ranks_seen[key] = max(signal.step, self._ranks_seen.get(key, -1))
        self._first_seen[key] = min(signal.step, self._first_seen.get(key, signal.step))
        if signal.step <= self._judged:
            return  # judged already without it (it came too late)
        self._pending.setdefault(signal.step, []).append(signal)
        self._newest = max(self._newest, signal.step)

    def expect(self, replica: int, rank: int, step: int) -> None:
        """Wait for (replica, rank)'s report of `step` and later ones (up to `lag_steps`) before
        judging them, though it has reported nothing yet (a replica known to train)."""
        self._ranks_seen.setdefault((replica, rank), step)
        self._first_seen.setdefault((replica, rank), step)

    def step_aside(self, replica: int, step: int) -> None:
        """`replica` trains no step from `step` on until it reports one again (it works aside):
        its rows of those steps are not waited for."""
        self._away[replica] = step

    def flush(self) -> list[Verdict]:
        """Judge every step still held (the end of a trace)."""
        return self._judge_ready(final=True)

    def forget(self, replica: int) -> None:
        """`replica` is a new incarnation: its history and verdicts start over, and the rows
        its old one posted of steps not judged yet are dropped (a verdict on them would fall
        on the new incarnation, which never trained them)."""
        for step, signals in list(self._pending.items()):
            kept = [s for s in signals if s.replica != replica]
            if kept:
                self._pending[step] = kept
            else:
                del self._pending[step]
        self.slow.forget(replica)
        self._losses.pop(replica, None)
        for key in [k for k in self._bad if k[0] == replica]:
            del self._bad[key]
        self._reported = {k for k in self._reported if k[0] != replica}
        self._ranks_seen = {k: v for k, v in self._ranks_seen.items() if k[0] != replica}
        self._first_seen = {k: v for k, v in self._first_seen.items() if k[0] != replica}
        self._away.pop(replica, None)

    # --- judging ------------------------------------------------------------------------------
    def _complete(self, step: int) -> bool:
        recent = {k for k, last in self._ranks_seen.items()
                  if last >= step - self.lag_steps and self._first_seen.get(k, step) <= step
                  and step < self._away.get(k[0], step + 1)}
        return recent <= {(s.replica, s.rank) for s in self._pending[step]}

    def _judge_ready(self, final: bool) -> list[Verdict]:
        out: list[Verdict] = []
        for step in sorted(self._pending):
            if not (final or self._newest - step >= self.lag_steps or self._complete(step)
                    or len(self._pending) > MAX_PENDING_STEPS):
                break
            out += self._judge(step, self._pending.pop(step))
            self._judged = step
        return out

    def _judge(self, step: int, signals: list[Signal]) -> list[Verdict]:
        s = self.settings
        found: list[Verdict] = []
        for sig in signals:
            if sig.step_seconds >= s.hang_timeout_s:
                found.append(Verdict(sig.replica, sig.rank, VerdictKind.HANG, step,
                                     f"rank {sig.rank} made no progress for {sig.step_seconds:.0f}s"))
        by_replica: dict[int, list[Signal]] = {}
        for sig in signals:
            by_replica.setdefault(sig.replica, []).append(sig)
        found += self._nonfinite(step, by_replica)
        found += self._spikes(step, by_replica)
        found += self._fingerprints(step, signals)
        found += [Verdict(r, k, VerdictKind.SLOW, first, msg, slowdown=x)
                  for r, k, first, msg, x in self.slow.step(step, signals)]
        return self._once([dataclasses.replace(v, reached_step=step) for v in found])

    def take_updates(self) -> dict[int, float]:
        """Replicas with a `slow` verdict: their busy time over the others' since (1: balanced)."""
        out, self.slow.updates = self.slow.updates, {}
        return out

    def take_recovered(self) -> list[int]:
        """Replicas that had a `slow` verdict and are at normal speed again (each once); a new
        slowdown of theirs can make a new verdict."""
        out, self.slow.recovered = self.slow.recovered, []
        self._reported -= {(r, VerdictKind.SLOW) for r in out}
        return out

    def _nonfinite(self, step: int, by_replica: dict[int, list[Signal]]) -> list[Verdict]:
        bad = [r for r, sigs in by_replica.items() if not all(x.finite for x in sigs)]
        if not bad or (len(by_replica) > 1 and len(bad) == len(by_replica)):
            return []  # every replica at once: the batch or the model, not one replica
        return [v for r in bad if (v := self._count(r, VerdictKind.NAN, step, "non-finite loss or gradients"))]

    def _spikes(self, step: int, by_replica: dict[int, list[Signal]]) -> list[Verdict]:
        losses: dict[int, float] = {}
        for r, sigs in by_replica.items():
            values = [x.loss for x in sigs if x.loss is not None and x.finite and math.isfinite(x.loss)]
            if values:
                losses[r] = statistics.fmean(values)
        spiking = [r for r, v in losses.items()
                   if self._losses.setdefault(r, LossHistory(self.settings.loss_window, self.settings.loss_spike_z))
                   .is_spike(v)]
        everyone = len(losses) > 1 and len(spiking) == len(losses)
        for r, v in losses.items():
            if r not in spiking:
                self._losses[r].add(v)
        if everyone:
            return []
        return [verdict for r in spiking
                if (verdict := self._count(r, VerdictKind.LOSS_SPIKE, step,
                                           f"loss {losses[r]:.4g} far above its recent level"))]

    def _count(self, replica: int, kind: VerdictKind, step: int, what: str) -> Verdict | None:
        window = self._bad.setdefault((replica, kind), collections.deque())
        window.append(step)
        while window and window[0] <= step - self.settings.loss_window:
            window.popleft()
        if len(window) < self.settings.bad_steps:
            return None
        return Verdict(replica, None, kind, window[0],
                       f"{what} in {len(window)} steps within {self.settings.loss_window}")

    def fingerprint(self, step: int, rank: int) -> Fingerprint | None:
        """The record of (step, rank) once that step is judged; None before (or long after)."""
        return self._prints.get((step, rank))

    def _fingerprints(self, step: int, signals: list[Signal]) -> list[Verdict]:
        by_rank: dict[int, dict[int, int]] = {}
        for sig in signals:
            if sig.fingerprint is not None:
                by_rank.setdefault(sig.rank, {})[sig.replica] = sig.fingerprint
        out = []
        for rank, prints in sorted(by_rank.items()):
            culprits, disagree = minority(prints)
            if disagree and not culprits and self.diverged_at is None:
                self.diverged_at = step
                self._diverged = (f"replicas {', '.join(map(str, sorted(prints)))} hold different parameters or "
                                  f"optimizer state at step {step} (rank {rank}) and no majority says which is right")
            majority = {v for r, v in prints.items() if r not in culprits}
            self._prints[(step, rank)] = Fingerprint(len(prints), majority.pop() if len(majority) == 1 else None)
            while len(self._prints) > MAX_FINGERPRINTS:
                self._prints.popitem(last=False)
            out += [Verdict(r, rank, VerdictKind.SDC, step,
                            f"its parameters (rank {rank}) differ from the other replicas' at step {step}")
                    for r in culprits]
        return out

    def take_diverged(self) -> str | None:
        """The replicas' disagreement without a culprit, once (None: none, or taken)."""
        found, self._diverged = self._diverged, None
        return found

    def _once(self, found: list[Verdict]) -> list[Verdict]:
        out = []
        for v in found:
            if (v.replica, v.kind) not in self._reported:
                self._reported.add((v.replica, v.kind))
                out.append(v)
        return out
