"""The coordinator under hostile input: any body on any endpoint, any sequence of calls.

Over real HTTP (one coordinator on loopback for the module): every body hypothesis makes,
whole or shaped like the real message with wrong values, gets a 2xx or a 4xx with a reason,
never a 5xx, and the server keeps serving. On the membership logic (no I/O): any sequence
of registrations, heartbeats, quorum requests, leaves and checkpoint reports from holders of
the job's token raises only the protocol's own errors, and nothing it records exceeds what
the rounds it decided allow.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import JSON
from transom.coordinator.claims import FIRST_ROUND_STEP_WINDOW, SIGNAL_STEP_WINDOW, believed_step, step_limit
from transom.coordinator.detection import Detection
from transom.coordinator.membership import Membership, Settings
from transom.coordinator.models import (
    CheckpointReport,
    FailureReport,
    HeartbeatRequest,
    Identity,
    LeaveRequest,
    QuorumRequest,
    RegisterRequest,
    SignalBatch,
    SignalRow,
)
from transom.coordinator.thread import CoordinatorThread
from transom.detect.step_rows import DetectionSettings
from transom.errors import Evicted, JobCompleted, NotRegistered

TOKEN = "fuzz-token"
ENDPOINTS = ["/v1/register", "/v1/heartbeat", "/v1/quorum", "/v1/failure", "/v1/leave", "/v1/checkpoint",
             "/v1/rendezvous", "/v1/signals"]
IDENTITY = st.fixed_dictionaries({"replica_id": st.integers(-2, 3) | JSON, "generation": st.integers(0, 3),
                                  "attempt": st.integers(0, 3)})
SHAPED = st.fixed_dictionaries({"identity": IDENTITY}, optional={
    "step": st.integers(-5, 2**64) | JSON, "commit_quorum_id": st.integers(-3, 10), "last_round": st.integers(-3, 10),
    "failed": st.booleans(), "timeout_s": st.floats(0.01, 0.2),
    "report": st.none() | st.fixed_dictionaries({"loss": st.floats(allow_nan=True), "seconds": st.floats()}) | JSON,
    "store_addr": st.text(max_size=300), "state_endpoints": st.lists(st.text(max_size=20), max_size=3),
    "reason": st.text(max_size=2000), "completed": st.booleans() | JSON, "uri": st.text(max_size=50),
    "master_addr": st.text(max_size=10), "master_port": st.integers(-1, 70000), "exit_code": st.integers(-300, 300),
    "node_rank": st.integers(-1, 5000), "stacks": st.text(max_size=50) | JSON,
    "rows": st.lists(st.fixed_dictionaries({"step": st.integers(-1, 2**63), "rank": st.integers(-1, 3)}, optional={
        "step_seconds": st.floats(allow_nan=True) | JSON, "tokens": st.floats(allow_nan=True),
        "loss": st.floats(allow_nan=True) | JSON, "finite": st.booleans() | JSON,
        "fingerprint": st.integers(-(2**64), 2**64)}), max_size=4) | JSON,
})


@pytest.fixture(scope="module")
def coordinator() -> Iterator[http.client.HTTPConnection]:
    # One replica: a valid quorum request is decided at once, so no request blocks on a long-poll.
    ct = CoordinatorThread(Settings(job="fuzz", num_replicas=1, heartbeat_timeout_s=3600.0), TOKEN)
    ct.start()
    conn = http.client.HTTPConnection("127.0.0.1", int(ct.url.rsplit(":", 1)[1]), timeout=10)
    yield conn
    conn.close()
    ct.stop()


def send(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
    method = "PUT" if path == "/v1/rendezvous" else "POST"
    for attempt in range(2):
        try:
            conn.request(method, path, body=body, headers={"Authorization": f"Bearer {TOKEN}"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (http.client.RemoteDisconnected, ConnectionError):
            conn.close()  # a kept-alive connection the server closed: reconnect once
            if attempt:
                raise
    raise AssertionError("unreachable")


@given(path=st.sampled_from(ENDPOINTS), body=JSON | SHAPED, cut=st.none() | st.integers(0, 400))
def test_no_body_makes_a_server_error(coordinator, path, body, cut):
    data = json.dumps(body).encode()  # NaN and Infinity as JSON's extensions, as a careless client sends
    if cut is not None:
        data = data[:cut]
    status, payload = send(coordinator, path, data)
    assert status < 500, (path, data[:200], payload[:200])
    if status >= 400:
        assert json.loads(payload)["error"]
    health, _ = send(coordinator, "/v1/status", b"")
    assert health in (200, 405)


def ident(rid: int, gen: int) -> Identity:
    return Identity(replica_id=rid, generation=gen, attempt=0)


CALL = st.tuples(st.sampled_from(["register", "heartbeat", "quorum", "failure", "leave", "checkpoint", "tick"]),
                 st.integers(0, 2), st.integers(0, 1), st.integers(0, 8), st.integers(-1, 6), st.booleans())


@given(started=st.booleans(), calls=st.lists(CALL, max_size=60))
def test_no_sequence_of_calls_records_impossible_progress(started, calls):
    m = Membership(Settings(job="fuzz", num_replicas=3, heartbeat_timeout_s=5.0, startup_wait_s=1.0))
    now, baseline = 0.0, None
    if started:  # most sequences begin inside a running job: every replica in round 0 at step 0
        for rid in range(3):
            m.register(RegisterRequest(identity=ident(rid, 0), store_addr="127.0.0.1:1", state_endpoints=["x"]), now)
            m.request_quorum(QuorumRequest(identity=ident(rid, 0), step=0, commit_quorum_id=-1, last_round=-1), now)
        assert m.current is not None
    for kind, rid, gen, step, other, flag in calls:
        now += 0.3
        who = ident(rid, gen)
        try:
            if kind == "register":
                m.register(RegisterRequest(identity=who, store_addr="127.0.0.1:1", state_endpoints=["http://x"],
                                           step=step), now)
            elif kind == "heartbeat":
                m.heartbeat(HeartbeatRequest(identity=who, step=step), now)
            elif kind == "quorum":
                m.request_quorum(QuorumRequest(identity=who, step=step, commit_quorum_id=other, last_round=other,
                                               failed=flag), now)
            elif kind == "failure":
                m.report_failure(FailureReport(identity=who, reason="x"), now)
            elif kind == "leave":
                m.leave(LeaveRequest(identity=who, step=step, completed=flag), now)
            elif kind == "checkpoint":
                m.record_checkpoint(CheckpointReport(identity=who, step=step, uri="s3://b/x"), now, now)
            else:
                m.try_decide(now)
        except (Evicted, NotRegistered, JobCompleted, ValueError):
            pass  # the protocol's own refusals (409, 404, 410, 400)
        if m.current is None:
            continue
        if baseline is None:  # what was reported before the first round is not checked (a restart)
            checkpoint = m.last_checkpoint[0] if m.last_checkpoint else 0
            baseline = max(m.replicas.max_step(), m.completed_step or 0, checkpoint)
        # Nothing recorded since may exceed what the decided rounds allow...
        bound = max(m.step_limit, baseline)
        assert m.replicas.max_step() <= bound
        assert m.completed_step is None or m.completed_step <= bound
        assert m.last_checkpoint is None or m.last_checkpoint[0] <= bound
        # ...and every decision counts its participants among its members.
        for d in m.answers.values():
            assert 1 <= d.participants <= len(d.members)


ROW = st.builds(SignalRow, step=st.integers(0, 2**62) | st.integers(0, 40), rank=st.integers(0, (1 << 20) - 1),
                step_seconds=st.floats(0, 1e9), tokens=st.none() | st.floats(0, 1e15),
                loss=st.none() | st.floats(allow_nan=True, allow_infinity=True), finite=st.booleans(),
                fingerprint=st.none() | st.integers(-(2**63), 2**63 - 1), recovery=st.booleans(),
                batch_share=st.none() | st.floats(0.01, 1e3))
POST = st.tuples(st.integers(0, 2), st.integers(0, 3), st.lists(ROW, max_size=30))


@given(held=st.lists(st.integers(0, 30), min_size=3, max_size=3), posts=st.lists(POST, max_size=25))
def test_no_signal_post_moves_the_detectors_past_what_its_replica_can_have(held, posts):
    """Whatever rows a replica posts, the detectors never hold more ranks than the replicas
    have, nor judge past a step some replica could have trained (a row at 2^62 once blinded
    them for the rest of the job), and nothing but the protocol's own refusals is raised."""
    m = Membership(Settings(job="fuzz", num_replicas=3, heartbeat_timeout_s=3600.0))
    for rid in range(3):
        m.register(RegisterRequest(identity=ident(rid, 0), store_addr="h:1", state_endpoints=["x"] * (rid + 1),
                                   step=held[rid]), 0.0)
    d = Detection(DetectionSettings(warmup_steps=2, slow_steps=2), m)
    for rid, node, rows in posts:
        try:
            d.observe(SignalBatch(identity=ident(rid, 0), node_rank=node, rows=rows), 1.0)
        except (Evicted, NotRegistered):
            pass  # a replica a verdict declared failed
        newest = max(step_limit(m, r)[0] for r in range(3)) + SIGNAL_STEP_WINDOW
        assert d.detectors._newest <= newest and d.detectors._judged <= newest
        assert all(rank <= replica for replica, rank in d.detectors._ranks_seen)


HONEST_MAX = 40  # replicas 1 and 2 hold at most this many steps; replica 0 claims anything
EARLY = st.one_of(
    st.tuples(st.just("register"), st.integers(0, 2), st.integers(0, 1), st.integers(0, 2**62)),
    st.tuples(st.just("signal"), st.integers(0, 2), st.integers(0, 1), st.integers(0, 2**62)),
    st.tuples(st.just("quorum"), st.integers(0, 2), st.integers(0, 1), st.integers(0, 2**62)),
    st.tuples(st.just("checkpoint"), st.integers(0, 2), st.integers(0, 1), st.integers(0, 2**62)),
    st.tuples(st.just("decide"), st.just(0), st.just(0), st.just(0)),
)


def _early_call(m: Membership, d: Detection, kind: str, rid: int, gen: int, step: int, now: float) -> None:
    if rid and kind != "signal":  # the honest replicas claim what they hold
        step %= HONEST_MAX + 1
    who = ident(rid, gen)
    if kind == "register":
        m.register(RegisterRequest(identity=who, store_addr="h:1", state_endpoints=["x"], step=step), now)
    elif kind == "quorum":
        m.request_quorum(QuorumRequest(identity=who, step=step, commit_quorum_id=-1, last_round=-1), now)
    elif kind == "checkpoint":
        m.record_checkpoint(CheckpointReport(identity=who, step=step, uri="s3://b/x"), now, now)
    elif kind == "decide":
        m.try_decide(now + 10.0)  # past startup_wait: the round decides with whoever is ready
    else:
        rows = [SignalRow(step=s, rank=0, step_seconds=0.5, fingerprint=rid) for s in (step, step % 64)]
        d.observe(SignalBatch(identity=who, rows=rows), now)


@given(calls=st.lists(EARLY, max_size=40))
def test_claims_before_the_first_round_move_the_detectors_only_as_far_as_decided_rounds(calls):
    """Registrations, quorum requests and rows with huge steps before and around a fresh
    coordinator's first round: the detectors' newest and judged steps stay within what the
    honest majority registered with or a decided round allowed (one registration at 2^62 - 1
    and a row at 2^62 once blinded them for the whole job). The job's first round takes a
    huge step only from a replica that was alone (no other could contradict it), and
    status's last checkpoint moves only as far as the detectors do."""
    m = Membership(Settings(job="fuzz", num_replicas=3, heartbeat_timeout_s=3600.0, startup_wait_s=5.0))
    d = Detection(DetectionSettings(action="Report"), m)
    now, first = 0.0, None
    for kind, rid, gen, step in calls:
        now += 0.5
        try:
            _early_call(m, d, kind, rid, gen, step, now)
        except (Evicted, NotRegistered, JobCompleted, ValueError):
            pass  # the protocol's own refusals
        believed = believed_step(m)
        limit = max(HONEST_MAX, m.step_limit) + SIGNAL_STEP_WINDOW
        assert believed is None or believed <= max(HONEST_MAX, m.step_limit)
        assert d.detectors._newest <= limit and d.detectors._judged <= limit, (d.detectors._newest, m.step_limit)
        assert m.last_checkpoint is None or m.last_checkpoint[0] <= max(HONEST_MAX, m.step_limit)
        first = first or m.current
    if first is not None and first.max_step > HONEST_MAX + FIRST_ROUND_STEP_WINDOW:
        assert first.member_ids() == [0], first  # replica 0's word, with nobody to contradict it
