"""`Exchange`: the cross-replica half of a step, from its quorum request to its averaged gradients.

The leader's quorum request leaves with the step's first forward pass (the trainer's
forward hook calls `ask`) and overlaps it; the answer is awaited when the first bucket
of gradients is ready, or at the end of the backward pass. The other ranks of the replica
never talk to the coordinator: the leader hands them its answer (ft/coordinator_link.py).
The trainer (ft/trainer.py) runs the part before any gradient moves in three calls:
`quorum` (await the answer; a changed quorum rebuilds the cross-replica group,
ft/process_group.py), the recovery's `serve` (a source publishes a joiner's small state),
and `start` (the step's all-reduce, ft/ftar.py). Buckets are then sent as backward produces
them (`send`; under FSDP2 its shards, `reduce_shard`: ft/inner_reduction.py), and `finish`
sends the rest and waits for all.

What comes out is a `QuorumOutcome` (ft/step_values.py), or None where the job completed
without this replica or its owner ended it at the step this replica holds; an eviction
raises. The trainer hands the outcome on to the recovery and the commit; what the commit
reports back (`StepRecord`) goes into the next request.
"""

from __future__ import annotations

import concurrent.futures
import logging

from transom.collective_counts import COUNTER
from transom.coordinator.models import Identity, QuorumRequest, QuorumResponse
from transom.errors import Diverged, NoQuorum
from transom.ft.coordinator_link import CoordinatorLink, hand_outcome, read_outcome
from transom.ft.ftar import FlatBuffers, StepAllReduce, bucket_params
from transom.ft.process_group import QuorumGroups
from transom.ft.shared_values import SharedValues
from transom.ft.sliced_ftar import SlicedAllReduce
from transom.ft.step_services import StepServices
from transom.ft.step_values import QuorumOutcome, StepRecord

log = logging.getLogger("transom.ft")


class Exchange:
    def __init__(self, services: StepServices, identity: Identity, groups: QuorumGroups, link: CoordinatorLink | None,
                 shared: SharedValues):
        """`link`: the leader's to the coordinator (None on the other ranks); `shared`: the
        script's values set aside for every replica, which ride the request and the answer."""
        self.services, self.ctx, self.config = services, services.ctx, services.config
        self.identity, self.groups, self.link, self.shared = identity, groups, link, shared
        # Buckets in the order backward produces gradients (roughly the reverse of the parameters').
        self.buckets = bucket_params(list(reversed(list(services.model.parameters()))), self.config.bucket_bytes)
        self.flats = FlatBuffers()  # the buckets' flat tensors, kept from step to step
        self.last_round = -1  # the last round answered
        self.evicted: str | None = None  # why the coordinator no longer counts this incarnation
        self.completed_elsewhere = False  # the job finished without this replica
        self.ended_by_owner = False  # the job's owner ended the job at this replica's step (POST /v1/finish)
        self.asked = False  # this step's quorum request left (on the leader; the flag on every rank)
        self._step = 0
        self._request: QuorumRequest | None = None  # this step's, until the forward pass sends it
        self._future: concurrent.futures.Future | None = None
        self.awaited = False  # this step's quorum is in (opened holds the outcome, None if the job completed)
        self.opened: QuorumOutcome | None = None
        self.finished = False  # this step's gradients were exchanged
        self._sent_any = False  # the first gradients of this step left (fault injection sees them)
        self._shards = False  # FSDP2's hook reduced this step's shards in place: no bucket is left
        self._changed = False  # this step's quorum differs from the last one's
        self._group_error: str | None = None  # its group could not be rebuilt: the step fails
        # The newest answer that granted a lease (coordinator/lease.py): its steps up to
        # `holds_until` need no request. `_leased`: this step is one of them (the leader's choice).
        self.lease: QuorumResponse | None = None
        self._leased = False

    def begin(self, step: int, last: StepRecord, catching_up_from: int | None) -> None:
        """A new step: refuse it if this incarnation was evicted, and prepare its request."""
        self.evicted = self.evicted or (self.link.evicted if self.link is not None else None)
        if self.evicted:
            raise self.services.fence.evicted(self.evicted, None, f"step {step} not committed")
        self._step, self.asked = step, False
        self.awaited, self.opened, self.finished = False, None, False
        self._sent_any = self._shards = False
        # Under a lease a step asks nothing, unless this replica's last step failed (then every
        # member's did, and each asks) or it still catches up (it never was in a quiet round).
        self._leased = self.lease is not None and self.lease.holds_until is not None \
            and step <= self.lease.holds_until and not last.failed and catching_up_from is None
        self._last, self._catching_up_from = last, catching_up_from
        if not self._leased:
            self._prepare()

    def _prepare(self) -> None:
        """The step's quorum request (the leader's), sent by `ask`."""
        if self.link is not None:
            last, shares = self._last, self.services.shares
            self._request = QuorumRequest(
                identity=self.identity, step=self._step, commit_quorum_id=last.commit_quorum_id,
                last_round=self.last_round, failed=last.failed, report=last.report,
                catching_up_from=self._catching_up_from, follows_shares=shares.following,
                shares_held=shares.schedule.pending, shares_held_from=shares.schedule.pending_from,
                shared=self.shared.take(),
            )

    def end_lease(self) -> None:
        """This replica steps aside (trainer.aside()): the lease ends for it, and this step
        asks, with a group built anew. Its group is closed: the members still training under
        the lease fail their step's collective at once (ft/process_group.py); they ask, and
        the round goes on without this replica (aside) until it asks again."""
        if self.lease is None:
            return
        self.lease = None
        if self._leased and not self.asked:
            self._leased = False
            self._prepare()
        self.groups.drop()

    def not_committed(self) -> None:
        """The step did not commit (here or on another rank of this replica): leave its group.
        The next round names a new quorum anyway (a failed step changes it), and a member of
        the lease whose collective completed may already wait in the next step's: closing the
        group frees it at once (ft/process_group.py)."""
        self.groups.drop()

    def ask(self) -> None:
        """Send the step's quorum request (once); the leader alone talks to the coordinator."""
        self.asked = True
        if self._request is not None and self.link is not None:
            self._future, self._request = self.link.ask(self._request), None

    def quorum(self) -> QuorumResponse | None:
        """Wait for this step's quorum (once per step) and rebuild the group for a changed one;
        None where the job ended without this step."""
        s = self.services
        with s.clock.waiting():
            q = self._await_quorum()
        self.awaited = True
        if q is None:
            return None
        if q.ends_job and self.ctx.replica_id in q.recovering:
            # Back just as the job ends: it holds none of the job's state, so the members that
            # do complete the job, and this one leaves with it.
            log.info("replica %d: the job ends at step %d, before this replica caught up", self.ctx.replica_id,
                     q.max_step)
            self.completed_elsewhere = True
            return None
        if q.ends_job:  # the job ends at the step this replica holds: nothing of this step is exchanged
            log.info("replica %d: the job ends at step %d, as its owner asked", self.ctx.replica_id, q.max_step)
            self.ended_by_owner = True
            return None
        self.last_round = q.round
        if q is not self.lease:  # an answer of the coordinator's, not a leased step's
            self.lease = q if q.holds_until is not None else None
        self.shared.apply(q.shared)  # before anything of this step is served or captured
        # The prefix names a quorum uniquely, across coordinator restarts too.
        self._changed = self.groups.changed(q.store_prefix)
        self._group_error = self.groups.rebuild(q.store_addr, q.store_prefix, q.rank, len(q.members), q.quorum_id) \
            if self._changed else None
        if self._changed:  # a new group: every member counts its collectives from 0 (collective_counts.py)
            COUNTER.new_group(q.quorum_id)
        return q

    def start(self, q: QuorumResponse) -> QuorumOutcome:
        """Set up the step's all-reduce under quorum `q` (after the recovery served its joiners)."""
        s = self.services
        s.hooks.allreduce(self._step)
        recovering = self.ctx.replica_id in q.recovering
        s.shares.update(q)
        guard = s.guard  # its flags ride at the end of the last bucket (ft/guard.py)
        # A group as wide as every rank of every member sums each replica's ranks too: the
        # average is over participants x ranks, and a replica's weight is shared by its ranks.
        width, weight = self.groups.width, s.shares.weight(q, self.ctx.replica_id)
        args = (self.groups.group, q.participants * width, not recovering, guard.own_bucket if guard else None,
                None if weight is None else weight / width, guard.flags if guard else None, self.flats)
        slices = self.groups.slices  # DDP inside the replica, in slices (ft/sliced_ftar.py)
        ftar = StepAllReduce(*args) if slices is None else SlicedAllReduce(slices, *args)
        s.gate.busy()  # a catch-up in the background leaves the link to the buckets
        if self._group_error:
            ftar.fail(self._group_error)
        self.opened = QuorumOutcome(quorum=q, ftar=ftar, recovering=recovering, changed=self._changed)
        return self.opened

    def send(self, index: int, grads: list | None = None) -> None:
        """A bucket's gradients are final (mid-backward): its exchange starts now. `grads`:
        under DDP, its bucket's gradients averaged inside the replica."""
        if self.opened is not None:
            self._first(grads[0] if grads else self.buckets[index][0].grad)
            self.opened.ftar.start(self.buckets[index], last=index == len(self.buckets) - 1, grads=grads)

    def reduce_shard(self, shard) -> None:
        """Under FSDP2: a group's reduce-scattered shard, averaged across replicas in place."""
        if self.opened is not None:
            self._first(shard)
            self._shards = True
            self.opened.ftar.reduce_in_place(shard)

    def _first(self, grad) -> None:
        """The step's first gradients to leave: what a `nan` fault poisons (ft/hooks.py)."""
        if not self._sent_any:
            self._sent_any = True
            self.services.hooks.gradients(self._step, grad)

    def finish(self, started: int) -> QuorumOutcome | None:
        """The step's gradient exchange, once per step, after `start`: the buckets from
        `started` on (the backward pass sent the others) start now; then all are awaited."""
        outcome = self.opened
        if outcome is not None and not self.finished:
            for i in range(len(self.buckets) if self._shards else started, len(self.buckets)):
                self._first(self.buckets[i][0].grad)
                outcome.ftar.start(self.buckets[i], last=i == len(self.buckets) - 1)
            with self.services.clock.waiting():
                outcome.ftar.finish()
            self.services.gate.free()
            if outcome.ftar.failed:
                self.groups.drop()
                self.flats.drop()  # a collective that never completed may still write into them
        self.finished = True
        return outcome

    def _await_quorum(self) -> QuorumResponse | None:
        # Only the leader asked; it tells the other ranks (a leased step asked nobody: below).
        self.ask()  # no forward pass went through the model (e.g. it called a submodule)
        if self._leased:
            # Every rank took this choice in `begin` from what all of them hold (the lease, the
            # last step's agreed vote, the agreed catch-up), so the leader need not hand it
            # down: a collective here would make the step wait for the replica's slowest rank.
            # A leader that finds its incarnation evicted raises in `begin` instead; the other
            # ranks cannot commit without it (every collective of the step needs it).
            assert self.lease is not None
            self.lease = self.lease.model_copy(update={"max_step": self._step, "shared": None})
            return self.lease
        payload = hand_outcome(self.ctx.from_leader, self._future, self.config.quorum_timeout_s + 30)
        self._future = None
        answer = read_outcome(payload)
        if isinstance(answer, QuorumResponse):
            if answer.diverged:  # every member stops: no replica's state can be trusted over another's
                raise Diverged(f"replica {self.ctx.replica_id} stops at step {self._step}: {answer.diverged}")
            return answer
        if answer.kind == "evicted":  # refused: this incarnation's update is discarded, on every rank
            self.evicted = answer.message
            raise self.services.fence.evicted(answer.message, answer.state, f"step {self._step} not committed")
        if answer.kind == "completed":
            log.warning("replica %d stops at step %d: %s", self.ctx.replica_id, self._step, answer.message)
            self.completed_elsewhere = True
            return None
        raise NoQuorum(f"replica {self.ctx.replica_id}: no quorum: {answer.message}")
