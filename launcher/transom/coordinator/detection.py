"""The coordinator's anomaly detection: signals in, verdicts out, and what a verdict does.

Launchers post their workers' step rows (`POST /v1/signals`, at most once a second each).
Rows are taken only for the posting replica's own live incarnation (a replica cannot speak
for another), then run through the detectors (transom/detect). A verdict:

- is an event and a metric (`transom_coordinator_verdicts_total{kind}`), always;
- with the action Replace (spec.detection.action, or slowAction for `slow`): declares the
  incarnation failed, so it leaves the quorum at once and its launcher restarts it, and
  writes it to `status.training.verdicts`, where the operator replaces the replica's pods
  and, when the verdict blames the node (slow, sdc: hardware-class), excludes that node;
- with slowAction Rebalance (`slow` only): sets the replica's slowdown in the membership's
  batch shares, which the next decision publishes (transom/detect/rebalance.py); the share
  returns to nominal when the detectors find the replica at normal speed again, or with
  its next incarnation.

Rows that carry an input digest are also compared across ranks and replicas
(detect/duplicates.py): pairs of replicas that trained on identical inputs (or, a lesser
kind that never hides those, ranks of one replica) make the job's `DuplicateData` finding:
an event when the first of each kind is made, status.training.duplicateData, and a line in
the coordinator's and every launcher's log whenever the replicas it names change (the answer
to a launcher's posts carries it). It is a warning and acts on no replica: one that lies
about its inputs can raise it, never restart or exclude anyone, nor hide another pair's.

A verdict falls only on the incarnation whose rows made it: rows an old incarnation posted
ahead of the others are dropped when its successor first posts (`Detectors.forget`), and a
verdict reached on them before that leaves the successor alone.

A hang verdict acts on the rank the hang waits for, where the ranks' collective counts
(posted with the rows, `SignalBatch.collectives`) name one (detect/hangs.py): inside the
replica whose watchdog fired, on its own word; in another replica only on that replica's own
counts and the coordinator's own sight of its stall. The culprit is found when the watchdog's
post arrives (by the time the detectors judge the step, the counts have moved on) and the
verdict carries it (`culprit_replica`, `culprit_rank`, the evidence in its message).

It also paces the launchers: each answer says how long to wait before the next post, so
that all of them together post about `SIGNAL_POSTS_PER_S` times a second
(transom/detect/step_rows.py `post_interval`, over the posters heard from lately).

What a post may claim is bounded like progress (claims.py): a row's step at most one past
what its replica can have committed and past what the job's evidence supports
(`claims.believed_step`: the decided rounds, or before the first one what two replicas
registered with), its rank below the replica's size (the ranks it registered);
other rows are dropped and counted, so that one replica can neither move the detectors'
judged-up-to mark past the real steps nor grow their per-rank state. Rows a launcher posts
before a restarted coordinator's first round, of steps past what two replicas hold, are lost. The
detectors' statistics are made so that one replica's figures cannot condemn another
(detect/slow.py, detect/sdc.py). `SignalGate` keeps detection from crowding out
heartbeats and quorum requests on the server's one event loop.

Pure bookkeeping over `Membership`, under the server's lock; no I/O.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator

from transom.coordinator import claims
from transom.coordinator.job_state import JobState
from transom.coordinator.models import DuplicateDataFinding, FingerprintRecord, SignalBatch
from transom.detect.detectors import Detectors, Verdict, lag_steps_for
from transom.detect.duplicates import DuplicateInputs
from transom.detect.hangs import CollectiveLedger, Culprit, RankCounts
from transom.detect.step_rows import MAX_FORWARD_INTERVAL_S, DetectionSettings, Signal, post_interval
from transom.errors import TooManyRequests
from transom.words import REASONS, DetectAction, EventKind, FailureKind, IncarnationState, VerdictKind

MAX_MESSAGE = 1024
POSTER_MEMORY_S = 2 * MAX_FORWARD_INTERVAL_S  # a launcher not heard from for this long is no longer counted
# The detectors may use at most this share of each second of the server's one event loop:
# heartbeats and quorum requests, which decide whether replicas live, get the rest.
DETECTION_SHARE = 0.5
# Each launcher (replica, node) has a bucket of POST_BURST posts, refilled at twice the pace
# it was given (its timing jitters, and an attempt's last rows or a hang's stacks leave at
# once: a launcher at its pace always has a post in hand); past that a post is 429.
POST_BURST = 3.0
STEP_SECONDS_KEPT = 64  # the newest rows' step times whose median paces `Detectors.lag_steps`


class SignalGate:
    """Which signal posts the server takes now (TooManyRequests: the launcher keeps its rows
    and posts them later): each poster at its pace, and the detectors within their share of
    the loop's time, so that a flood of posts delays detection, never a heartbeat."""

    def __init__(self, share: float = DETECTION_SHARE, window_s: float = 1.0):
        self.share, self.window_s = share, window_s
        self._buckets: dict[tuple[int, int], tuple[float, float]] = {}  # poster -> (posts left, when)
        self._spent: collections.deque[tuple[float, float]] = collections.deque()  # (when, seconds)
        self._pruned_at = 0.0
        self.deferred = 0

    def admit(self, poster: tuple[int, int], pace_s: float, now: float) -> None:
        """TooManyRequests unless `poster` may post now (the server asks before it reads the
        body where the credential names the poster: a flood costs it almost nothing)."""
        while self._spent and self._spent[0][0] < now - self.window_s:
            self._spent.popleft()
        if sum(cost for _, cost in self._spent) >= self.share * self.window_s:
            self._defer("the detectors have used their share of the last second")
        left, at = self._buckets.get(poster, (POST_BURST, now))
        left = min(POST_BURST, left + (now - at) * 2.0 / pace_s)
        if left < 1.0:
            self._buckets[poster] = (left, now)
            self._defer(f"posts come faster than one every {pace_s:.3g}s")
        self._buckets[poster] = (left - 1.0, now)
        if now - self._pruned_at > POSTER_MEMORY_S:
            self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] <= POSTER_MEMORY_S}
            self._pruned_at = now

    def _defer(self, why: str) -> None:
        self.deferred += 1
        raise TooManyRequests(f"signals not taken now: {why}")

    @contextlib.contextmanager
    def timed(self, now: float) -> Iterator[None]:
        """Count the time the block takes against the detectors' share."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._spent.append((now, time.perf_counter() - t0))


class Detection:
    def __init__(self, settings: DetectionSettings, membership: JobState):
        self.settings = settings
        self.membership = membership
        self.detectors = Detectors(settings)
        self.duplicates = DuplicateInputs()
        self._duplicate_told: tuple[bool, tuple[int, ...]] | None = None  # what take_duplicate last gave
        self.verdicts_total: collections.Counter[str] = collections.Counter()
        self._incarnation: dict[int, tuple[int, int]] = {}  # replica -> (generation, attempt) last seen
        self._step_seconds: collections.deque[float] = collections.deque(maxlen=STEP_SECONDS_KEPT)
        self._node_of: dict[tuple[int, int], int] = {}  # (replica, rank) -> node rank
        self._stacks: dict[int, str] = {}  # replica -> a hang's stacks, for its verdict
        self.collectives = CollectiveLedger()  # the ranks' collective counts (detect/hangs.py)
        # replica -> whom its hang waits for, found when its watchdog's post came (the counts
        # move on, and the replica restarts, before the detectors judge the step), with the
        # culprit's incarnation then
        self._culprits: dict[int, tuple[Culprit, tuple[int, int]]] = {}
        self._status: dict[int, dict] = {}  # replica -> its verdict in status.training
        self._posters: dict[tuple[int, int], float] = {}  # (replica, node rank) -> when it last posted
        self._pruned_at = 0.0
        self.rows_refused = 0  # rows of steps or ranks their replica cannot have (claims.py)

    def observe(self, batch: SignalBatch, now: float) -> list[Verdict]:
        """Take a launcher's batch (Evicted/NotRegistered for a failed, superseded or unknown
        incarnation; one that left on its own still reports its last steps)."""
        replica = batch.identity.replica_id
        rep = self.membership.replicas.reporting(batch.identity)
        self._posters[(replica, batch.node_rank)] = now
        if not self.settings.enabled:
            return []
        known = self._incarnation.get(replica)
        if known != batch.identity.key():
            self.detectors.forget(replica)  # a new incarnation: new history (maybe new hardware)
            self.collectives.forget(replica)
            self._culprits.pop(replica, None)  # a hang of the old one that was never judged
            self._incarnation[replica] = batch.identity.key()
            if known is not None:  # not merely new to a restarted coordinator, which kept its share
                self._restore(replica, now, "restarted")
        self._count_collectives(batch, len(rep.state_endpoints), now)
        if batch.stacks:
            self._stacks[replica] = batch.stacks
            self._find_culprit(batch, now)
        signals = []
        for r in batch.rows:
            if r.rank >= len(rep.state_endpoints) or not claims.signal_step_ok(self.membership, replica, r.step):
                self.rows_refused += 1  # a rank it does not have, a step it cannot have trained
                continue
            self._node_of[(replica, r.rank)] = batch.node_rank
            signals.append(Signal(step=r.step, replica=replica, rank=r.rank, step_seconds=r.step_seconds,
                                  tokens=r.tokens, sum_len_sq=r.sum_len_sq, loss=r.loss, grad_norm=r.grad_norm,
                                  finite=r.finite, fingerprint=r.fingerprint, recovery=r.recovery,
                                  batch_share=r.batch_share, input_digest=r.input_digest))
        self._compare_inputs(signals, now)
        self._pace_lag(signals)
        if signals:  # the other live replicas' rows of these steps may still be on their way
            first = min(x.step for x in signals)
            for rep in self.membership.replicas.values():
                if rep.state == IncarnationState.HEALTHY and rep.identity.replica_id != replica:
                    self.detectors.expect(rep.identity.replica_id, 0, first)
        verdicts = [self._act(v, now) for v in self.detectors.observe_all(signals)]
        self._stop_if_diverged(now)
        hung = [s.step for s in signals if s.step_seconds >= self.settings.hang_timeout_s]
        if batch.stacks and hung:
            # The watchdog's post is its incarnation's last: its other ranks will not report the
            # step it hung in (they wait for the hung one), so that step is judged without them.
            self.detectors.step_aside(replica, min(hung))
            verdicts += [self._act(v, now) for v in self.detectors.observe_all([])]
        for slow, busy_over_others in self.detectors.take_updates().items():
            if self.settings.slow_action == DetectAction.REBALANCE:
                self.membership.shares.balance(slow, busy_over_others)  # published by the next decision
        for recovered in self.detectors.take_recovered():
            self._restore(recovered, now, "at normal speed again")
        return verdicts

    def _pace_lag(self, signals: list[Signal]) -> None:
        """How far behind a rank may report and still be waited for: two post intervals of the
        job's recent steps (rows wait for their launcher's next post; detectors.py)."""
        self._step_seconds.extend(s.step_seconds for s in signals if s.step_seconds > 0)
        if self._step_seconds:
            step_s = statistics.median(self._step_seconds)
            self.detectors.lag_steps = lag_steps_for(post_interval(len(self._posters)), step_s)

    def _stop_if_diverged(self, now: float) -> None:
        """Replicas that disagree with no majority: no replica can be trusted over another, so
        the job stops (every quorum answer says why from now on) instead of training on."""
        why = self.detectors.take_diverged()
        m = self.membership
        if why is not None and m.diverged is None:
            m.diverged = why
            m.event(now, EventKind.DIVERGED, f"the job stops: {why}")

    def step_aside(self, replica: int, step: int) -> None:
        """The replica trains no step from `step` until it is back (trainer.aside()): the
        detectors judge those steps without waiting for its rows."""
        if self.settings.enabled:
            self.detectors.step_aside(replica, step)

    def _compare_inputs(self, signals: list[Signal], now: float) -> None:
        for s in signals:
            if s.input_digest is not None and self.duplicates.observe(s.step, s.replica, s.rank, s.input_digest):
                finding = self.duplicates.finding  # what observe() just found
                if finding is not None:
                    self.membership.event(now, EventKind.DUPLICATE_DATA, finding.message)

    def duplicate_data(self) -> DuplicateDataFinding | None:
        """The job's finding that ranks trained on identical inputs, if there is one: pairs of
        replicas when there are any."""
        found = self.duplicates.finding
        return DuplicateDataFinding(**found.summary()) if found is not None else None

    def take_duplicate(self) -> DuplicateDataFinding | None:
        """The finding when its kind or the replicas it names changed since it was last taken
        (to be logged; not each step it grows by), else None."""
        found = self.duplicates.finding
        if found is None or self._duplicate_told == (found.across, found.replicas):
            return None
        self._duplicate_told = (found.across, found.replicas)
        return self.duplicate_data()

    def fingerprint(self, committed: int, rank: int) -> FingerprintRecord:
        """What the rows said about `rank`'s parameters holding `committed` steps (the row of
        step `committed - 1`, whose update made them): a joiner checks a snapshot against it."""
        record = self.detectors.fingerprint(committed - 1, rank) if committed > 0 else None
        if record is None:
            return FingerprintRecord(state="unknown")
        if record.voters < 2:
            return FingerprintRecord(state="single", value=record.value)
        return FingerprintRecord(state="agreed" if record.value is not None else "disputed", value=record.value)

    def post_interval(self, now: float) -> float:
        """Seconds every launcher should wait before its next post."""
        if now - self._pruned_at > MAX_FORWARD_INTERVAL_S:
            self._posters = {k: t for k, t in self._posters.items() if now - t <= POSTER_MEMORY_S}
            self._pruned_at = now
        return post_interval(len(self._posters))

    def _restore(self, replica: int, now: float, why: str) -> None:
        if self.membership.shares.restore(replica):
            self.membership.event(now, EventKind.REBALANCE, f"replica {replica} {why}: back to its nominal share",
                                  replica)

    def _act(self, v: Verdict, now: float) -> Verdict:
        """Record and carry out `v`; returns it as acted on (a hang: on the rank it waits for)."""
        reason = REASONS[v.kind]
        stacks = self._stacks.pop(v.replica, None) if v.kind == VerdictKind.HANG else None
        # The incarnation whose rows made the verdict: only it is to blame, not a later one.
        accuser, incarnation = v.replica, self._incarnation.get(v.replica)
        if v.kind == VerdictKind.HANG:
            v, incarnation = self._blamed(v)
        message = v.message
        if stacks:  # the workers' of the replica whose watchdog fired
            message += (f"; stacks of replica {accuser}: " if accuser != v.replica else "; stacks: ") + stacks
        message = message[:MAX_MESSAGE]
        self.verdicts_total[v.kind] += 1
        action = self.settings.action_for(v.kind)
        m = self.membership
        m.event(now, EventKind.VERDICT, f"replica {v.replica}: {reason} from step {v.first_step} ({action}): {message}",
                v.replica)
        rep = m.replicas.get(v.replica)
        if action == DetectAction.REBALANCE:
            m.shares.slow(v.replica, v.slowdown)  # published by the next decision
            return v
        if action != DetectAction.REPLACE or rep is None:
            return v
        if incarnation is not None and rep.identity.key() != incarnation:
            return v  # replaced since its rows (or a hang's counts) were posted: the new one is not to blame
        entry = {"replica": v.replica, "generation": rep.identity.generation, "reason": reason,
                 "message": message, "blame": v.blame,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if v.blame == "Node":
            entry["nodeRank"] = self._node_of.get((v.replica, v.rank if v.rank is not None else 0), 0)
        if v.culprit_rank is not None and v.evidence is not None:  # a hang's: the rank the others waited for
            entry["rank"] = v.culprit_rank
        self._status[v.replica] = entry
        if rep.state == IncarnationState.HEALTHY:
            m.fail(rep, now, f"{reason}: {message}", FailureKind.DETECTED)
        return v

    # --- whom a hang waits for (detect/hangs.py) ---------------------------------------------
    def _count_collectives(self, batch: SignalBatch, size: int, now: float) -> None:
        """Take the poster's counts of its own ranks (a rank it has; the rest are refused)."""
        replica = batch.identity.replica_id
        for c in batch.collectives:
            if c.rank >= size:
                self.rows_refused += 1
                continue
            self._node_of.setdefault((replica, c.rank), batch.node_rank)
            self.collectives.record(replica, RankCounts(rank=c.rank, group_id=c.group_id, ftar_entered=c.ftar_entered,
                                                        ftar_completed=c.ftar_completed, group_entered=c.group_entered,
                                                        group_completed=c.group_completed), now)

    def _find_culprit(self, batch: SignalBatch, now: float) -> None:
        """A watchdog's post (its stacks): find whom the hang waits for while the counts are
        those of the hang. Across replicas, only a member of the current quorum that has not
        asked for the open round and that the coordinator saw make no progress for half the
        hang timeout may be named (detect/hangs.py says why that is evidence enough)."""
        replica = batch.identity.replica_id
        hung = [r.rank for r in batch.rows if r.step_seconds >= self.settings.hang_timeout_s]
        current = self.membership.current
        members = current.member_ids() if current is not None else []
        culprit = self.collectives.blame(replica, hung[-1] if hung else None, members, now,
                                         stall_s=self.settings.hang_timeout_s / 2, asked=self.membership.open.requests)
        rep = self.membership.replicas.get(culprit.replica) if culprit is not None else None
        if culprit is not None and rep is not None:
            self._culprits[replica] = (culprit, rep.identity.key())

    def _blamed(self, v: Verdict) -> tuple[Verdict, tuple[int, int] | None]:
        """The hang verdict `v` (the watchdog's replica and rank) on the rank it waits for, where
        the counts named one when the watchdog posted; else as it is, its own culprit."""
        found = self._culprits.pop(v.replica, None)
        if found is None:
            own = self._incarnation.get(v.replica)
            return dataclasses.replace(v, culprit_replica=v.replica, culprit_rank=v.rank), own
        c, incarnation = found
        node = self._node_of.get((c.replica, c.rank))
        evidence = c.evidence + (f"; on the node of pod {node}" if node is not None else "")
        message = f"{v.message}; the hang waits for rank {c.rank} of replica {c.replica}: {evidence}"
        return dataclasses.replace(v, replica=c.replica, rank=c.rank, culprit_replica=c.replica,
                                   culprit_rank=c.rank, evidence=evidence, message=message), incarnation

    def status_verdicts(self) -> list[dict]:
        """status.training.verdicts: the newest Replace verdict of each replica."""
        return [self._status[r] for r in sorted(self._status)]
