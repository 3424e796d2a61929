"""Membership and per-step quorum decisions: the coordinator's brain, with no I/O.

Every method takes the current time as an argument, so the whole protocol is table-tested
without sleeping (tests/unit/test_membership.py). The aiohttp server only parses messages,
calls these methods under one lock and wakes long-polling clients.

The protocol, one *round* per training step:

* Each replica's leader asks for the quorum of its next step, saying which step it has
  committed (and under which quorum) and whether its last step failed.
* A round is decided when every live member of the previous quorum has asked; replicas
  that are new (replacements) and already waiting are added. A member that is known dead
  (failure report, missed heartbeats) is not waited for; one that is merely absent is
  waited for only a short grace once some member reported a failed step (`failed_grace_s`
  or three recent rounds; never while it alone holds the state the others need), and at
  most `round_timeout_s` otherwise; a member left behind so is declared failed (hung), so
  its launcher restarts it even if its heartbeat thread still runs. A member that stepped
  aside (`trainer.aside()`: an evaluation between steps) is not waited for and not taken
  for hung until it asks again, behind the others, unless it alone holds the state. A joiner that
  committed a step no holder of the state committed is declared failed (diverged).
* The decision is the same for every member: the quorum id changes exactly when the
  membership changes or a step failed (then groups are rebuilt under a fresh prefix);
  members behind the newest committed state, and those that say they are still catching
  up, contribute zero gradients and catch up in the background from the *sources* (every
  member that holds the newest state), which keep a snapshot of a step the joiners can use
  (`snapshot_from`) until nobody catches up any more (ft/catchup.py); fewer than
  `min_replicas` ready means no decision (paused).

Because one process decides and every member of a round gets the same answer, two groups
of replicas can never train apart (no split brain).

Progress that cannot have happened is refused (ValueError, HTTP 400): the bounds are
claims.py's.
"""

from __future__ import annotations

import collections
import json
import secrets
import statistics
import time
from dataclasses import dataclass, field

from transom.coordinator import claims
from transom.coordinator.goodput import GoodputClock, as_decimal
from transom.detect.rebalance import BatchShares, describe, newest_held
from transom.coordinator.models import (
    MAX_SHARED_BYTES,
    AsideRequest,
    CheckpointReport,
    Event,
    FailureReport,
    HeartbeatRequest,
    Identity,
    JobProgress,
    JobStatus,
    LeaveRequest,
    QuorumRequest,
    QuorumResponse,
    RecoverySource,
    RegisterRequest,
    RegisterResponse,
    ReplicaState,
    ReplicaStatus,
)
from transom.errors import Evicted, JobCompleted, NotRegistered
from transom.coordinator.settings import Settings  # noqa: F401  (the coordinator's settings, re-exported)
from transom.coordinator.records import Decision, Replica  # noqa: F401  (re-exported: the records it keeps)

# A failed round waits for an absent member at least this many of the job's recent rounds:
# a member still computing its step meets the failed exchange only at the step's end, and
# on a loaded machine that can be well past `failed_grace_s`.
FAILED_GRACE_ROUNDS = 3
ROUNDS_TIMED = 16  # the recent rounds whose median length is "a round"


@dataclass
class Membership:
    settings: Settings
    # Distinguishes this coordinator's life from a previous one: quorum ids restart at 0
    # after a restart, and group prefixes must never repeat (a reused prefix hangs).
    epoch: str = field(default_factory=lambda: secrets.token_hex(4))
    replicas: dict[int, Replica] = field(default_factory=dict)
    pending: dict[int, QuorumRequest] = field(default_factory=dict)
    answers: dict[int, Decision] = field(default_factory=dict)
    current: Decision | None = None
    # One past the highest max_step of any decided round: no replica can hold more steps.
    step_limit: int = 0
    next_round: int = 0
    last_quorum_id: int = -1
    round_failed_since: float | None = None
    decided_at: float | None = None  # when the newest round was decided
    round_seconds: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=ROUNDS_TIMED))
    pending_since: dict[int, float] = field(default_factory=dict)  # when each waiter first asked
    # Script values set aside (trainer.aside()) by replicas that asked since the last decision:
    # the next decision hands them to every member. Later ones win; bounded like one request.
    shared_pending: dict = field(default_factory=dict)
    paused: bool = False
    # Set when the first replica leaves with `completed`: the job's last step. A replica
    # still asking for a quorum after that cannot be helped (its peers are gone).
    completed_step: int | None = None
    events: collections.deque[Event] = field(default_factory=lambda: collections.deque(maxlen=256))
    # Monotonic counters exported as metrics.
    failures_total: collections.Counter[str] = field(default_factory=collections.Counter)
    quorum_changes_total: int = 0
    events_total: int = 0
    # For status.training: the newest committed checkpoint (step, wall-clock unix time) and
    # the goodput clock, advanced by every decided round.
    last_checkpoint: tuple[int, float] | None = None
    last_checkpoint_stall_s: float | None = None  # the committing replica's snapshot stall
    goodput: GoodputClock = field(default_factory=GoodputClock)
    # Rebalance (spec.detection.slowAction): the detectors set who is slow, a decision
    # publishes the shares (transom/detect/rebalance.py).
    shares: BatchShares = field(init=False)

    def __post_init__(self) -> None:
        self.shares = BatchShares(self.settings.num_replicas)

    # --- helpers -----------------------------------------------------------------------
    def _event(self, now: float, kind: str, message: str) -> None:
        self.events.append(Event(time=now, kind=kind, message=message))
        self.events_total += 1

    def _live(self, identity: Identity) -> Replica:
        """The record of a live incarnation, or Evicted/NotRegistered."""
        rep = self.replicas.get(identity.replica_id)
        if rep is None:
            raise NotRegistered(f"replica {identity.replica_id} is not registered")
        if rep.identity.key() != identity.key():
            raise Evicted(
                f"replica {identity.replica_id} incarnation {identity.key()} is superseded by {rep.identity.key()}"
            )
        if rep.state != "healthy":
            raise Evicted(f"replica {identity.replica_id} was declared {rep.state}: {rep.last_failure or 'left'}")
        return rep

    def _fail(self, rep: Replica, now: float, reason: str, kind: str) -> None:
        rep.state = "failed"
        rep.failures += 1
        rep.last_failure = reason
        self.failures_total[kind] += 1
        self.pending.pop(rep.identity.replica_id, None)
        self.pending_since.pop(rep.identity.replica_id, None)
        self._event(now, "failed", f"replica {rep.identity.replica_id}: {reason}")

    # --- calls from replicas ----------------------------------------------------------------
    def register(self, req: RegisterRequest, now: float) -> RegisterResponse:
        rid = req.identity.replica_id
        if rid >= self.settings.num_replicas:
            raise ValueError(f"replica_id must be below num_replicas ({self.settings.num_replicas})")
        claims.check_registration(self, rid, req.step)
        old = self.replicas.get(rid)
        if old is not None and old.identity.key() > req.identity.key():
            raise Evicted(f"replica {rid} incarnation {req.identity.key()} is older than {old.identity.key()}")
        if old is not None and old.identity.key() == req.identity.key():
            if old.state != "healthy":
                raise Evicted(f"replica {rid} incarnation {req.identity.key()} was declared {old.state}")
            old.store_addr, old.state_endpoints, old.last_heartbeat = req.store_addr, list(req.state_endpoints), now
            if rid not in self.answers:
                old.registered_step = req.step
        else:
            failures, last_failure = 0, None
            if old is not None:
                if old.state == "healthy":
                    self._fail(old, now, "replaced by a newer incarnation", "superseded")
                failures, last_failure = old.failures, old.last_failure
            self.replicas[rid] = Replica(
                identity=req.identity,
                store_addr=req.store_addr,
                state_endpoints=list(req.state_endpoints),
                last_heartbeat=now,
                step=req.step,
                registered_step=req.step,
                failures=failures,
                last_failure=last_failure,
            )
            self.answers.pop(rid, None)
            self._event(now, "registered", f"replica {rid} generation {req.identity.generation} attempt {req.identity.attempt}")
        s = self.settings
        return RegisterResponse(
            heartbeat_interval_s=s.heartbeat_interval_s,
            heartbeat_timeout_s=s.heartbeat_timeout_s,
            num_replicas=s.num_replicas,
            min_replicas=s.min_replicas,
        )

    def heartbeat(self, req: HeartbeatRequest, now: float) -> None:
        rep = self._live(req.identity)
        claims.check(self, req.identity.replica_id, req.step, "heartbeat")
        rep.last_heartbeat = now
        rep.step = max(rep.step, req.step)

    def step_aside(self, req: AsideRequest, now: float) -> None:
        """The replica works outside the steps for a while: rounds go on without it (not
        counted as hung) until it asks for a quorum again, behind the others."""
        rep = self._live(req.identity)
        claims.check(self, req.identity.replica_id, req.step, "aside")
        rep.last_heartbeat = now
        if not rep.aside:
            rep.aside = True
            self._event(now, "aside", f"replica {req.identity.replica_id} stepped aside at step {req.step}")

    def report_failure(self, req: FailureReport, now: float) -> bool:
        """Mark an incarnation failed. Idempotent; reports about old incarnations are ignored."""
        rep = self.replicas.get(req.identity.replica_id)
        if rep is None or rep.identity.key() != req.identity.key() or rep.state != "healthy":
            return False
        code = f" (exit code {req.exit_code})" if req.exit_code is not None else ""
        self._fail(rep, now, req.reason + code, "reported")
        return True

    def leave(self, req: LeaveRequest, now: float) -> None:
        rep = self._live(req.identity)
        claims.check(self, req.identity.replica_id, req.step, "leave")
        if req.completed:
            claims.check_completion(self, req.identity.replica_id, req.step)
        rep.state = "left"
        rep.step = max(rep.step, req.step)
        if req.completed and self.completed_step is None:
            self.completed_step = req.step
            self._event(now, "completed", f"replica {rep.identity.replica_id} completed the job at step {req.step}")
        self.pending.pop(rep.identity.replica_id, None)
        self.pending_since.pop(rep.identity.replica_id, None)
        why = req.reason or ("completed" if req.completed else "no reason given")
        self._event(now, "left", f"replica {rep.identity.replica_id} left at step {req.step}: {why}")

    def replica_state(self, identity: Identity) -> ReplicaState:
        rep = self.replicas.get(identity.replica_id)
        done = self.completed_step is not None
        if rep is None or rep.identity.key() < identity.key():
            return ReplicaState(replica_id=identity.replica_id, state="unknown", job_completed=done)
        if rep.identity.key() > identity.key():
            return ReplicaState(replica_id=identity.replica_id, state="superseded", job_completed=done)
        return ReplicaState(replica_id=identity.replica_id, state=rep.state, reason=rep.last_failure,
                            job_completed=done)

    # --- time ---------------------------------------------------------------------------------
    def expire(self, now: float) -> bool:
        """Declare replicas whose heartbeats stopped failed. Returns whether anything changed."""
        changed = False
        for rep in self.replicas.values():
            age = now - rep.last_heartbeat
            if rep.state == "healthy" and age > self.settings.heartbeat_timeout_s:
                self._fail(rep, now, f"no heartbeat for {age:.1f}s", "heartbeat")
                changed = True
        return changed

    # --- quorum ----------------------------------------------------------------------------------
    def request_quorum(self, req: QuorumRequest, now: float) -> Decision | None:
        """Enter the open round; return this replica's decision if one is ready now."""
        rep = self._live(req.identity)
        # A retry of an answered request passes too: the round that answered it included its step.
        claims.check(self, req.identity.replica_id, req.step, "quorum request")
        answered = self.answer_for(req)
        if answered is None and self.completed_step is not None:
            raise JobCompleted(f"the job completed at step {self.completed_step}")
        rep.last_heartbeat = now  # asking proves liveness as well as a heartbeat does
        rep.step = req.step
        rep.aside = False
        if req.last_loss is not None:
            rep.last_loss = req.last_loss
        if answered is not None:
            return answered
        self.pending[req.identity.replica_id] = req
        self.pending_since.setdefault(req.identity.replica_id, now)
        if req.shared:
            merged = {**self.shared_pending, **req.shared}
            if len(merged) <= 256 and len(json.dumps(merged, separators=(",", ":"))) <= MAX_SHARED_BYTES:
                self.shared_pending = merged
            else:
                self._event(now, "shared", f"replica {req.identity.replica_id}: shared script values dropped "
                                           f"(more than 256 keys or {MAX_SHARED_BYTES} bytes since the last round)")
        if req.failed and self.round_failed_since is None:
            self.round_failed_since = now
        self.try_decide(now)
        return self.answer_for(req)

    def answer_for(self, req: QuorumRequest) -> Decision | None:
        d = self.answers.get(req.identity.replica_id)
        if d is None or d.round <= req.last_round:
            return None
        if req.identity not in d.members:
            return None
        return d

    def try_decide(self, now: float) -> Decision | None:
        self.expire(now)
        ready: dict[int, QuorumRequest] = {}
        for rid, req in list(self.pending.items()):
            rep = self.replicas.get(rid)
            if rep is None or rep.state != "healthy" or rep.identity.key() != req.identity.key():
                del self.pending[rid]
                self.pending_since.pop(rid, None)
            else:
                ready[rid] = req
        if not ready:  # the round is empty again: its failure report and clock go with it
            self.round_failed_since = None
            return None
        if self.current is None:
            opened = min(self.pending_since.get(r, now) for r in ready)
            if len(ready) < self.settings.num_replicas and now - opened < self.settings.startup_wait_s:
                return None
        else:
            absent = [
                m.replica_id
                for m in self.current.members
                if m.replica_id not in ready
                and (rep := self.replicas.get(m.replica_id)) is not None
                and rep.state == "healthy"
                and rep.identity.key() == m.key()
            ]
            missing = [rid for rid in absent if not self.replicas[rid].aside]
            if len(missing) < len(absent) and not self._holder_in(ready):
                return None  # the state's only holders stepped aside: without them the step is lost
            if missing:
                # The round timeout runs from the first *member* that asked: a replacement
                # may ask in the middle of the members' step, which proves nothing.
                member_ids = {m.replica_id for m in self.current.members}
                opened = min((self.pending_since.get(r, now) for r in ready if r in member_ids), default=now)
                grace = self.failed_grace_s(ready, missing)
                if self.round_failed_since is not None and now - self.round_failed_since >= grace:
                    why = f"did not return within {grace:.3g}s of a failed step"
                elif now - opened >= self.settings.round_timeout_s:
                    why = f"did not ask for its next quorum within {self.settings.round_timeout_s:g}s"
                else:
                    return None
                # A member left behind is hung (its heartbeat thread may still run): declare
                # it failed so that its launcher restarts it and it rejoins as a new incarnation.
                for rid in missing:
                    self._fail(self.replicas[rid], now, why, "hung")
                if len(ready) < self.settings.min_replicas:
                    self._event(now, "paused", f"{len(ready)} replicas ready, fewer than minReplicas")
                    self.paused = True
                    return None
        ready = self._without_diverged(ready, now)
        if len(ready) < self.settings.min_replicas:
            if not self.paused:
                self.paused = True
                self._event(
                    now, "paused", f"{len(ready)} replicas ready, fewer than minReplicas {self.settings.min_replicas}"
                )
            return None
        return self._decide(ready, now)

    def _holder_in(self, ready: dict[int, QuorumRequest]) -> bool:
        """Whether a ready replica holds the current round's state (a member not catching up)."""
        assert self.current is not None
        return any(m.replica_id in ready and ready[m.replica_id].identity.key() == m.key()
                   for m in self.current.members if m.replica_id not in self.current.recovering)

    def _without_diverged(self, ready: dict[int, QuorumRequest], now: float) -> dict[int, QuorumRequest]:
        """`ready` without the members catching up that committed a step no member holding
        the state committed (their last exchange completed on them only, as a peer died in
        it): the update they recorded belongs to a lineage nobody holds. They are declared
        failed and restart as fresh joiners; otherwise no member could be a source and every
        one would be told to restart."""
        newest = max((r.step for r in ready.values() if r.catching_up_from is None), default=None)
        if newest is None:
            return ready
        ahead = [rid for rid, r in ready.items() if r.catching_up_from is not None and r.step > newest]
        for rid in ahead:
            self._fail(self.replicas[rid], now, f"committed step {ready[rid].step} while catching up, and no "
                       f"replica holding the state did (at step {newest}); it catches up again", "diverged")
        return {rid: r for rid, r in ready.items() if rid not in ahead}

    def failed_grace_s(self, ready: dict[int, QuorumRequest], missing: list[int]) -> float:
        """How long a round with a failed step waits for the absent `missing` members.

        `failed_grace_s`, or FAILED_GRACE_ROUNDS of the job's recent rounds if that is
        longer (a live member asks again only after it meets the failed exchange, at the end
        of the step it is computing). As long as `round_timeout_s` when the
        absent include a member holding the newest state and no ready member holds it: the
        ready ones could not train without it, and cutting it loses the job's progress.
        """
        assert self.current is not None
        # Incarnations, not replica ids: a holder's restarted incarnation holds nothing yet.
        holders = {(m.replica_id, m.key()) for m in self.current.members if m.replica_id not in self.current.recovering}
        absent = {(r, self.replicas[r].identity.key()) for r in missing}
        if holders & absent and not holders & {(rid, req.identity.key()) for rid, req in ready.items()}:
            return self.settings.round_timeout_s
        grace = self.settings.failed_grace_s
        if self.round_seconds:
            grace = max(grace, FAILED_GRACE_ROUNDS * statistics.median(self.round_seconds))
        return min(grace, self.settings.round_timeout_s)

    def _decide(self, ready: dict[int, QuorumRequest], now: float) -> Decision:
        ids = sorted(ready)
        members = tuple(ready[i].identity for i in ids)
        any_failed = any(ready[i].failed for i in ids)
        prev = self.current
        same = prev is not None and prev.members == members and not any_failed
        if same:
            assert prev is not None
            quorum_id, store_addr, prefix = prev.quorum_id, prev.store_addr, prev.store_prefix
        else:
            quorum_id = self.last_quorum_id + 1
            self.last_quorum_id = quorum_id
        max_step = max(ready[i].step for i in ids)
        at_max = [i for i in ids if ready[i].step == max_step]
        # Replicas at the same step that committed it under different quorums can differ (a
        # collective that completed on some members only): the newest lineage wins. A
        # member still catching up counts its steps but does not hold their state yet.
        holding = [i for i in at_max if ready[i].catching_up_from is None]
        newest = max((ready[i].commit_quorum_id for i in holding), default=-1)
        canonical = [i for i in holding if ready[i].commit_quorum_id == newest]
        recovering = tuple(i for i in ids if i not in canonical)
        # What the joiners need: one that joins now records updates from this step on, one
        # catching up says from which step.
        needs = [ready[i].catching_up_from if ready[i].catching_up_from is not None else max_step
                 for i in recovering]
        if not same:
            # The groups are built on a member's store: one holding the state, or any member
            # when every one of them is still catching up (they are told they cannot).
            owner = self.replicas[canonical[0] if canonical else ids[0]]
            store_addr = owner.store_addr
            prefix = f"transom/{self.settings.job}/{self.epoch}/q{quorum_id}"
            self.quorum_changes_total += 1
            self._event(
                now,
                "quorum",
                f"quorum {quorum_id}: replicas {ids} at step {max_step}"
                + (f", recovering {sorted(recovering)}" if recovering else ""),
            )
        if prev is not None:
            for rid in sorted(set(prev.recovering) & set(canonical)):
                self._event(now, "caught_up", f"replica {rid} caught up at step {max_step}")
        if self.paused:
            self.paused = False
            self._event(now, "resumed", f"{len(ids)} replicas ready")
        if self.next_round == 0:  # a restarted coordinator: the shares under which batches were drawn
            held = newest_held({i: (ready[i].shares_held, ready[i].shares_held_from) for i in ids})
            if held is not None and self.shares.adopt(*held):
                self._event(now, "rebalance", f"kept from before the restart, from step {held[1]}: {describe(held[0])}")
        if self.shares.publish(all(ready[i].follows_shares for i in ids), max_step):
            self._event(now, "rebalance", f"from step {max_step + 1}: {describe(self.shares.published)}")
        decision = Decision(
            round=self.next_round,
            quorum_id=quorum_id,
            members=members,
            store_addr=store_addr,
            store_prefix=prefix,
            max_step=max_step,
            participants=max(1, len(canonical)),  # none: every member is told it cannot catch up
            recovering=recovering,
            sources=tuple(canonical) if recovering else (),
            snapshot_from=max(needs) if needs else None,
            shares=tuple(self.shares.published) if self.shares.published is not None else None,
            shares_from=self.shares.published_from,
            shared=self.shared_pending or None,
        )
        self.shared_pending = {}
        self.next_round += 1
        if self.decided_at is not None:
            self.round_seconds.append(now - self.decided_at)
        self.decided_at = now
        self.current = decision
        self.step_limit = max(self.step_limit, max_step + 1)
        self.goodput.observe(now, max_step)
        for i in ids:
            self.answers[i] = decision
            del self.pending[i]
            self.pending_since.pop(i, None)
        self.round_failed_since = None
        for req in self.pending.values():  # stragglers from a decided round start the next one
            if req.failed:
                self.round_failed_since = now
                break
        return decision

    def response(self, decision: Decision, replica_id: int) -> QuorumResponse:
        ids = decision.member_ids()
        sources = [RecoverySource(replica_id=s, endpoints=list(self.replicas[s].state_endpoints))
                   for s in decision.sources] if replica_id in decision.recovering else []
        return QuorumResponse(
            round=decision.round,
            quorum_id=decision.quorum_id,
            members=ids,
            rank=ids.index(replica_id),
            store_addr=decision.store_addr,
            store_prefix=decision.store_prefix,
            max_step=decision.max_step,
            participants=decision.participants,
            recovering=sorted(decision.recovering),
            serve_recovery=replica_id in decision.sources,
            sources=sources,
            snapshot_from=decision.snapshot_from,
            shares=list(decision.shares) if decision.shares is not None else None,
            shares_from=decision.shares_from,
            shared=decision.shared,
        )

    def record_checkpoint(self, req: CheckpointReport, wall_time: float, now: float) -> bool:
        """A replica committed the checkpoint of `req.step`; older reports are ignored."""
        self._live(req.identity)
        claims.check(self, req.identity.replica_id, req.step, "checkpoint report")
        if self.last_checkpoint is not None and req.step <= self.last_checkpoint[0]:
            return False
        self.last_checkpoint = (req.step, wall_time)
        self.last_checkpoint_stall_s = req.stall_seconds
        self._event(now, "checkpoint", f"checkpoint of step {req.step} committed by replica {req.identity.replica_id}")
        return True

    # --- reporting -----------------------------------------------------------------------------------
    def max_step(self) -> int:
        """The highest step any replica (of any state) reported committed."""
        return max((r.step for r in self.replicas.values()), default=0)

    def healthy_count(self) -> int:
        return sum(1 for r in self.replicas.values() if r.state == "healthy")

    def training(self, now: float) -> dict:
        """status.training of the TrainingJob (camelCase, as the CRD has it), without updateTime.
        `step` only once this coordinator has decided a round: a restarted one knows no replica
        until they register again, and would write 0 over the job's committed step (a merge
        patch without it leaves the last one in place)."""
        out: dict = {"step": self.max_step()} if self.current is not None else {}
        if self.completed_step is not None:
            out["completedStep"] = self.completed_step
        if self.last_checkpoint is not None:
            step, wall = self.last_checkpoint
            out["lastCheckpoint"] = step
            out["lastCheckpointTime"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))
        goodput = self.goodput.value(now)
        if goodput is not None:
            out["goodput"] = as_decimal(goodput)
        if self.shares.published is not None:
            out["batchSharePercent"] = [round(v * 100) for v in self.shares.published]
        elif self.shares.published_from > 0:  # rebalanced before: a merge patch's null removes it
            out["batchSharePercent"] = None
        return out

    def progress(self, caller: int | None) -> JobProgress:
        """What replica `caller` (None: the job's token holder) needs when it starts."""
        peers = [r.step for r in self.replicas.values() if r.state == "healthy" and r.identity.replica_id != caller]
        return JobProgress(peer_step=max(peers, default=None), completed_step=self.completed_step,
                           last_checkpoint=self.last_checkpoint[0] if self.last_checkpoint else None)

    def status(self, now: float) -> JobStatus:
        cur = self.current
        return JobStatus(
            round=self.next_round - 1,
            quorum_id=cur.quorum_id if cur else -1,
            members=cur.member_ids() if cur else [],
            max_step=self.max_step(),
            num_replicas=self.settings.num_replicas,
            min_replicas=self.settings.min_replicas,
            healthy_replicas=self.healthy_count(),
            paused=self.paused,
            completed_step=self.completed_step,
            last_checkpoint=self.last_checkpoint[0] if self.last_checkpoint else None,
            goodput=self.goodput.value(now),
            replicas=[
                ReplicaStatus(
                    replica_id=r.identity.replica_id,
                    generation=r.identity.generation,
                    attempt=r.identity.attempt,
                    state=r.state,
                    step=r.step,
                    last_loss=r.last_loss,
                    heartbeat_age_s=round(now - r.last_heartbeat, 3) if r.state == "healthy" else None,
                    failures=r.failures,
                    last_failure=r.last_failure,
                )
                for r in sorted(self.replicas.values(), key=lambda r: r.identity.replica_id)
            ],
            events=list(self.events)[-50:],
        )
