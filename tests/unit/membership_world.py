"""Helpers that drive the coordinator's `Membership` in the unit tests: identities,
registrations, quorum requests and whole rounds, with explicit timestamps (no I/O, no sleeps).
"""

from __future__ import annotations

from transom.coordinator.membership import Decision, Membership, Settings
from transom.coordinator.models import HeartbeatRequest, Identity, QuorumRequest, RegisterRequest


def ident(rid: int, gen: int = 0, att: int = 0) -> Identity:
    return Identity(replica_id=rid, generation=gen, attempt=att)


def make(num: int = 3, min_replicas: int = 1, **kw) -> Membership:
    return Membership(Settings(job="t", num_replicas=num, min_replicas=min_replicas, **kw))


def register(m: Membership, rid: int, now: float = 0.0, gen: int = 0, att: int = 0, step: int = 0):
    """`step`: the committed steps the replica holds as it registers (a restore, a restart)."""
    return m.register(
        RegisterRequest(
            identity=ident(rid, gen, att),
            store_addr=f"10.0.0.{rid}:29500",
            state_endpoints=[f"http://10.0.0.{rid}:{8000 + gen}/r{rid}g{gen}a{att}"],
            step=step,
        ),
        now,
    )


def qreq(
    rid: int, step: int = 0, commit: int = -1, last_round: int = -1, failed: bool = False, gen: int = 0, att: int = 0
) -> QuorumRequest:
    return QuorumRequest(
        identity=ident(rid, gen, att), step=step, commit_quorum_id=commit, last_round=last_round, failed=failed
    )


def heartbeat_all(m: Membership, ids, now: float) -> None:
    for rid in ids:
        rep = m.replicas[rid]
        m.heartbeat(HeartbeatRequest(identity=rep.identity, step=rep.step), now)


def round_all(m: Membership, reqs: list[QuorumRequest], now: float) -> Decision:
    """Every request asks at `now`; the last one must complete the round; all get one answer."""
    answers = [m.request_quorum(r, now) for r in reqs]
    decision = answers[-1]
    assert decision is not None, f"round not decided; pending={sorted(m.pending)}"
    for r in reqs:
        assert m.answer_for(r) is decision
    return decision


def started(num: int = 3, **kw) -> tuple[Membership, Decision]:
    """All replicas registered at t=0 and the first quorum formed at step 0."""
    m = make(num, **kw)
    return m, begin(m)


def begin(m: Membership) -> Decision:
    """`m`'s replicas all registered at t=0 and its first quorum formed at step 0."""
    num = m.settings.num_replicas
    for rid in range(num):
        register(m, rid)
    return round_all(m, [qreq(rid) for rid in range(num)], 0.0)


def next_round(m: Membership, prev: Decision, ids, now: float, step: int, failed=()) -> Decision:
    """Members of `prev` committed `step` under it and ask for the next round."""
    reqs = [
        qreq(rid, step=step, commit=prev.quorum_id, last_round=prev.round, failed=rid in failed,
             gen=m.replicas[rid].identity.generation, att=m.replicas[rid].identity.attempt)
        for rid in ids
    ]
    return round_all(m, reqs, now)
