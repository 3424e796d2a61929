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
claims.py's. The calls about one incarnation (register, heartbeat, leave...) are
incarnations.py's, the pure parts of a round (the open round, its plan, who is overdue)
rounds.py's, the replicas' records and the queries over them roster.py's, and what the
membership tells others reports.py's; the state they share is job_state.py's (those
modules take it, never Membership), and this class decides.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from transom.coordinator import claims, incarnations, lease, reports, rounds
from transom.coordinator.job_state import JobState
from transom.coordinator.models import (
    MAX_SHARED_BYTES,
    AsideRequest,
    CheckpointReport,
    FailureReport,
    HeartbeatRequest,
    Identity,
    IncarnationAnswer,
    JobProgress,
    JobStatus,
    LeaveRequest,
    QuorumRequest,
    QuorumResponse,
    RegisterRequest,
    RegisterResponse,
)
from transom.coordinator.records import Decision, Replica  # noqa: F401  (re-exported: the records it keeps)
from transom.coordinator.settings import Settings  # noqa: F401  (the coordinator's settings, re-exported)
from transom.detect.rebalance import describe, newest_held
from transom.errors import JobCompleted
from transom.words import EventKind, FailureKind, IncarnationState


@dataclass
class Membership(JobState):
    """Decides the rounds over the job's state (JobState, job_state.py), and is the one door
    the server calls through: the calls about one incarnation are incarnations.py's, what
    it tells others reports.py's."""

    # --- calls about one incarnation (incarnations.py) ----------------------------------------
    def register(self, req: RegisterRequest, now: float) -> RegisterResponse:
        return incarnations.register(self, req, now)

    def heartbeat(self, req: HeartbeatRequest, now: float) -> bool:
        return incarnations.heartbeat(self, req, now)

    def step_aside(self, req: AsideRequest, now: float) -> None:
        return incarnations.step_aside(self, req, now)

    def report_failure(self, req: FailureReport, now: float) -> bool:
        return incarnations.report_failure(self, req, now)

    def leave(self, req: LeaveRequest, now: float) -> None:
        return incarnations.leave(self, req, now)

    def replica_state(self, identity: Identity) -> IncarnationAnswer:
        return incarnations.replica_state(self, identity)

    def expire(self, now: float) -> bool:
        return incarnations.expire(self, now)

    def record_checkpoint(self, req: CheckpointReport, wall_time: float, now: float) -> bool:
        return incarnations.record_checkpoint(self, req, wall_time, now)

    # --- quorum ----------------------------------------------------------------------------------
    def request_quorum(self, req: QuorumRequest, now: float) -> Decision | None:
        """Enter the open round; return this replica's decision if one is ready now."""
        rep = self.replicas.live(req.identity)
        # A retry of an answered request passes too: the round that answered it included its step.
        claims.check(self, req.identity.replica_id, req.step, "quorum request")
        answered = self.answer_for(req)
        if answered is None and self.completed_step is not None:
            raise JobCompleted(f"the job completed at step {self.completed_step}")
        rep.last_heartbeat = now  # asking proves liveness as well as a heartbeat does
        rep.step = req.step
        if rep.aside and answered is None:
            self.open.returned.add(req.identity.replica_id)
        rep.aside = False
        if req.report is not None:
            rep.last_report = req.report
        if answered is not None:
            return answered
        if not self.open.enter(req, now):
            self.event(now, EventKind.SHARED, f"replica {req.identity.replica_id}: shared script values dropped "
                                       f"(more than {rounds.MAX_SHARED_KEYS} keys or {MAX_SHARED_BYTES} bytes "
                                       f"since the last round)", req.identity.replica_id)
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
        """Decide the open round if nobody it must wait for is missing any more."""
        self.expire(now)  # first, so that the requests of the incarnations it fails are dropped too
        ready = self.open.keep(lambda req: self.replicas.current(req.identity) is not None)
        if not ready:  # the round is empty again: its failure report and clock go with it
            self.open.failed_since = None
            return None
        if self._waits(ready, now):
            return None
        ready = self._without(ready, rounds.diverged(ready), FailureKind.DIVERGED, now)
        ready = self._without(ready, claims.unsupported(self, ready), FailureKind.UNSUPPORTED, now)
        if len(ready) < self.settings.min_replicas:
            if not self.paused:
                self.paused = True
                self.event(now, EventKind.PAUSED,
                           f"{len(ready)} replicas ready, fewer than minReplicas {self.settings.min_replicas}")
            return None
        return self._decide(ready, now)

    def _waits(self, ready: dict[int, QuorumRequest], now: float) -> bool:
        """Whether the round still waits: for the first replicas, or for absent members of the
        current quorum (those waited for too long are declared hung here)."""
        if self.current is None:
            opened = self.open.opened(ready, now)
            return len(ready) < self.settings.num_replicas and now - opened < self.settings.startup_wait_s
        absent = rounds.absent(self.current, self.replicas, ready)
        missing = [rid for rid in absent if not self.replicas[rid].aside]
        if len(missing) < len(absent) and not rounds.holder_in(self.current, ready):
            return True  # the state's only holders stepped aside: without them the step is lost
        if not missing:
            return False
        grace = rounds.failed_grace_s(self.settings, self.current, self.replicas, self.round_seconds, ready, missing)
        why = rounds.overdue(self.settings, self.open, self.current, ready, grace, now)
        if why is None:
            return True
        # A member left behind is hung (its heartbeat thread may still run): declare it
        # failed so that its launcher restarts it and it rejoins as a new incarnation.
        for rid in missing:
            self.fail(self.replicas[rid], now, why, FailureKind.HUNG)
        if len(ready) < self.settings.min_replicas:
            self.event(now, EventKind.PAUSED, f"{len(ready)} replicas ready, fewer than minReplicas")
            self.paused = True
            return True
        return False

    def _without(self, ready: dict[int, QuorumRequest], refused: dict[int, str], kind: FailureKind,
                 now: float) -> dict[int, QuorumRequest]:
        """`ready` without the members in `refused`, each declared failed for its reason there."""
        for rid, why in refused.items():
            self.fail(self.replicas[rid], now, why, kind)
        return {rid: r for rid, r in ready.items() if rid not in refused}

    def _decide(self, ready: dict[int, QuorumRequest], now: float) -> Decision:
        p = rounds.plan(ready)
        prev = self.current
        if prev is not None and prev.members == p.members and not p.failed and not self.open.returned & set(p.ids):
            quorum_id, store_addr, prefix = prev.quorum_id, prev.store_addr, prev.store_prefix
        else:
            quorum_id, store_addr, prefix = self._new_quorum(p, now)
        news = self._announce(prev, p, ready, now)
        ends_job = self.end_step is not None and p.max_step >= self.end_step
        quiet = self._quiet(prev, p, news) and not ends_job
        decision = Decision(
            round=self.next_round,
            quorum_id=quorum_id,
            members=p.members,
            store_addr=store_addr,
            store_prefix=prefix,
            max_step=p.max_step,
            participants=max(1, len(p.canonical)),  # none: every member is told it cannot catch up
            recovering=p.recovering,
            sources=tuple(p.canonical) if p.recovering else (),
            snapshot_from=p.snapshot_from,
            shares=tuple(self.shares.published) if self.shares.published is not None else None,
            shares_from=self.shares.published_from,
            shared=self.open.shared or None,
            ends_job=ends_job,
            holds_until=lease.holds_until(self.settings.quorum_lease_s, self._step_seconds(), p.max_step, quiet,
                                          self.end_step),
        )
        self._record(decision, now)
        return decision

    def _quiet(self, prev: Decision | None, p: rounds.RoundPlan, news: bool) -> bool:
        """Whether a round may grant a lease (lease.py): nothing in the job changes. The same
        members as the last round, no failed step, nobody catching up, nothing announced, no
        script values to hand out, and no healthy replica outside the quorum (a joiner that
        asks would otherwise wait for the lease to end)."""
        if prev is None or prev.members != p.members or p.failed or p.recovering or news or self.open.shared:
            return False
        return not any(r.state == IncarnationState.HEALTHY and rid not in p.ids for rid, r in self.replicas.items())

    def _step_seconds(self) -> float | None:
        """The job's recent time a step (the median of its recent rounds' time per step)."""
        return statistics.median(self.round_seconds) if self.round_seconds else None

    def _new_quorum(self, p: rounds.RoundPlan, now: float) -> tuple[int, str, str]:
        """A fresh quorum id, and the store its groups are built on: a member's holding the
        state, or any member's when every one of them is still catching up (they are told
        they cannot)."""
        self.last_quorum_id += 1
        quorum_id = self.last_quorum_id
        owner = self.replicas[p.canonical[0] if p.canonical else p.ids[0]]
        self.quorum_changes_total += 1
        self.event(now, EventKind.QUORUM, f"quorum {quorum_id}: replicas {p.ids} at step {p.max_step}"
                    + (f", recovering {sorted(p.recovering)}" if p.recovering else ""))
        return quorum_id, owner.store_addr, f"transom/{self.settings.job}/{self.epoch}/q{quorum_id}"

    def _announce(self, prev: Decision | None, p: rounds.RoundPlan, ready: dict[int, QuorumRequest],
                  now: float) -> bool:
        """The round's news: who caught up, a resumed job, and new batch shares to publish;
        whether there was any."""
        events = self.events_total
        if prev is not None:
            for rid in sorted(set(prev.recovering) & set(p.canonical)):
                self.event(now, EventKind.CAUGHT_UP, f"replica {rid} caught up at step {p.max_step}", rid)
        if self.paused:
            self.paused = False
            self.event(now, EventKind.RESUMED, f"{len(p.ids)} replicas ready")
        if self.next_round == 0:  # a restarted coordinator: the shares under which batches were drawn
            held = newest_held({i: (ready[i].shares_held, ready[i].shares_held_from) for i in p.ids})
            if held is not None and self.shares.adopt(*held):
                self.event(now, EventKind.REBALANCE,
                           f"kept from before the restart, from step {held[1]}: {describe(held[0])}")
        if self.shares.publish(all(ready[i].follows_shares for i in p.ids), p.max_step, p.ids):
            self.event(now, EventKind.REBALANCE, f"from step {p.max_step + 1}: {describe(self.shares.published)}")
        return self.events_total != events

    def _record(self, decision: Decision, now: float) -> None:
        """Make `decision` the current round: answer its members, time it, open the next."""
        self.next_round += 1
        if self.decided_at is not None and self.current is not None:
            # Per step: a lease makes one round's time span the steps it answered for.
            steps = max(1, decision.max_step - self.current.max_step)
            self.round_seconds.append((now - self.decided_at) / steps)
        self.decided_at = now
        self.current = decision
        self.step_limit = max(self.step_limit, (decision.holds_until or decision.max_step) + 1)
        incarnations.release_checkpoints(self, now)
        self.goodput.observe(now, decision.max_step)
        for i in decision.member_ids():
            self.answers[i] = decision
        self.open.close(decision.member_ids(), now)

    @property
    def pending(self) -> dict[int, QuorumRequest]:
        """The open round's requests, by replica id."""
        return self.open.requests

    def response(self, decision: Decision, replica_id: int) -> QuorumResponse:
        return reports.response(self, decision, replica_id)

    # --- reporting -----------------------------------------------------------------------------------
    def training(self, now: float) -> dict:
        return reports.training(self, now)

    def progress(self, caller: int | None) -> JobProgress:
        return reports.progress(self, caller)

    def status(self, now: float) -> JobStatus:
        return reports.status(self, now)
