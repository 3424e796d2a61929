"""The coordinator over real HTTP: a `CoordinatorThread` on loopback, real sockets.

Covers what the pure membership tests cannot: bearer-token auth (and the endpoints that need
none: /metrics, /healthz), parsing of hostile bodies (every client mistake is a 4xx with a
reason, never a 5xx, and the server keeps serving), long-polled quorums with concurrent
`CoordinatorClient`s, 408 "ask again", failure reports and heartbeat expiry changing the
next quorum, 409 for stale incarnations (`Evicted`), /v1/status, OOM kills in status.training,
the rendezvous table, and that
stop() does not hang on a long-poll (the seeded fuzz loop over every write endpoint:
test_coordinator_http_fuzz.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import requests

from transom.coordinator.client import CoordinatorClient, CoordinatorError, Evicted
from transom.coordinator.membership import Settings
from transom.coordinator.models import (
    CheckpointReport,
    FailureReport,
    FingerprintRecord,
    HeartbeatRequest,
    Identity,
    QuorumRequest,
    QuorumResponse,
    RegisterRequest,
    RendezvousInfo,
    SignalBatch,
    SignalRow,
)
from transom.coordinator.thread import CoordinatorThread
from transom.detect.step_rows import DetectionSettings

TOKEN = "test-token-3f9a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HTTP_TIMEOUT = 5.0


@pytest.fixture
def start_coordinator() -> Iterator[Callable[..., CoordinatorThread]]:
    started: list[CoordinatorThread] = []

    def start(**settings) -> CoordinatorThread:
        settings.setdefault("job", "http-test")
        ct = CoordinatorThread(Settings(**settings), TOKEN)
        ct.start()
        started.append(ct)
        return ct

    yield start
    for ct in started:
        ct.stop()


@pytest.fixture
def coord(start_coordinator) -> CoordinatorThread:
    return start_coordinator(num_replicas=3, heartbeat_timeout_s=30.0)


def ident(rid: int, gen: int = 0, att: int = 0) -> Identity:
    return Identity(replica_id=rid, generation=gen, attempt=att)


def reg_req(rid: int, gen: int = 0, att: int = 0, step: int = 0) -> RegisterRequest:
    return RegisterRequest(
        identity=ident(rid, gen, att),
        store_addr=f"127.0.0.1:{29500 + rid}",
        state_endpoints=[f"http://127.0.0.1/{rid}"],
        step=step,
    )


def q_req(rid: int, step: int = 0, commit: int = -1, last_round: int = -1, gen: int = 0, **kw) -> QuorumRequest:
    return QuorumRequest(identity=ident(rid, gen), step=step, commit_quorum_id=commit, last_round=last_round, **kw)


def client(ct: CoordinatorThread) -> CoordinatorClient:
    return CoordinatorClient(ct.url, TOKEN, timeout_s=HTTP_TIMEOUT)


def post(ct: CoordinatorThread, path: str, body, headers=AUTH, method: str = "POST") -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.request(method, ct.url + path, data=data, headers=headers, timeout=HTTP_TIMEOUT)


def get(ct: CoordinatorThread, path: str, headers=AUTH) -> requests.Response:
    return requests.get(ct.url + path, headers=headers, timeout=HTTP_TIMEOUT)


def quorum_together(
    ct: CoordinatorThread, reqs: list[QuorumRequest], timeout_s: float = 4.0
) -> dict[int, QuorumResponse]:
    """Each request long-polls from its own thread, as each replica's leader does."""
    out: dict[int, QuorumResponse | Exception] = {}

    def ask(r: QuorumRequest) -> None:
        try:
            out[r.identity.replica_id] = client(ct).quorum(r, timeout_s=timeout_s)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            out[r.identity.replica_id] = e

    threads = [threading.Thread(target=ask, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 2)
    assert all(isinstance(v, QuorumResponse) for v in out.values()) and len(out) == len(reqs), out
    return out  # type: ignore[return-value]


def wait_until(cond: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# --- auth ------------------------------------------------------------------------------------------
V1_ENDPOINTS = [
    ("POST", "/v1/register"),
    ("POST", "/v1/heartbeat"),
    ("POST", "/v1/quorum"),
    ("POST", "/v1/failure"),
    ("POST", "/v1/leave"),
    ("PUT", "/v1/rendezvous"),
    ("GET", "/v1/replicas/0"),
    ("GET", "/v1/rendezvous/0"),
    ("GET", "/v1/status"),
]
BAD_AUTH = [
    {},
    {"Authorization": "Bearer wrong-token"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": "Bearer "},
    {"Authorization": TOKEN},
    {"Authorization": f"Bearer {TOKEN}x"},
]


@pytest.mark.parametrize("headers", BAD_AUTH, ids=["none", "wrong", "basic", "empty", "no-scheme", "suffix"])
def test_v1_needs_the_bearer_token(coord, headers):
    body = reg_req(0).model_dump_json().encode()
    for method, path in V1_ENDPOINTS:
        r = requests.request(method, coord.url + path, data=body, headers=headers, timeout=HTTP_TIMEOUT)
        assert r.status_code == 401, (method, path, r.status_code)
        assert "token" in r.json()["error"]
    assert client(coord).status().replicas == []  # the unauthenticated register did nothing


def test_unauthenticated_calls_are_counted_per_endpoint(coord):
    """What a deleted pod's token gets on Kubernetes (a zombie healed after its pod was
    replaced): 401, counted, so that its attempts show."""
    body = reg_req(0).model_dump_json().encode()
    for path in ("/v1/heartbeat", "/v1/heartbeat", "/v1/register"):
        r = requests.post(coord.url + path, data=body, headers={"Authorization": "Bearer nope"}, timeout=HTTP_TIMEOUT)
        assert r.status_code == 401
    text = requests.get(coord.url + "/metrics", timeout=HTTP_TIMEOUT).text
    assert 'transom_coordinator_unauthenticated_requests_total{endpoint="/v1/heartbeat"} 2.0' in text
    assert 'transom_coordinator_unauthenticated_requests_total{endpoint="/v1/register"} 1.0' in text


def test_readiness_says_whether_rounds_can_be_decided_now_and_liveness_only_that_it_answers(coord):
    ready = lambda: requests.get(coord.url + "/readyz", timeout=HTTP_TIMEOUT)  # noqa: E731
    assert (ready().status_code, ready().text) == (200, "ready")

    async def hold_state(seconds):
        async with coord.server.lock:
            await asyncio.sleep(seconds)

    held = asyncio.run_coroutine_threadsafe(hold_state(2.5), coord._loop)
    time.sleep(0.2)
    busy = ready()
    assert busy.status_code == 503 and "stayed busy for 1 s" in busy.text
    assert requests.get(coord.url + "/healthz", timeout=HTTP_TIMEOUT).status_code == 200  # alive all the same
    held.result(timeout=5)
    assert ready().status_code == 200

    async def stop_ticker():
        coord.server._tick_task.cancel()
    asyncio.run_coroutine_threadsafe(stop_ticker(), coord._loop).result(timeout=5)
    time.sleep(0.1)
    assert (ready().status_code, ready().text) == (503, "the round ticker is not running")


def test_metrics_and_healthz_need_no_token(coord):
    c = client(coord)
    c.register(reg_req(0))
    c.register(reg_req(1))
    c.report_failure(FailureReport(identity=ident(1), reason="test"))
    h = requests.get(coord.url + "/healthz", timeout=HTTP_TIMEOUT)
    assert h.status_code == 200 and h.text == "ok"
    m = requests.get(coord.url + "/metrics", timeout=HTTP_TIMEOUT)
    assert m.status_code == 200 and m.headers["Content-Type"].startswith("text/plain")
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in m.text.splitlines() if line and line[0] != "#"
    }
    assert samples["transom_coordinator_healthy_replicas"] == 1
    assert samples["transom_coordinator_quorum_id"] == -1
    assert samples["transom_coordinator_paused"] == 0
    assert samples["transom_coordinator_step"] == 0
    assert samples["transom_coordinator_quorum_changes_total"] == 0
    assert samples['transom_coordinator_replica_failures_total{reason="reported"}'] == 1
    assert samples['transom_coordinator_replica_failures_total{reason="heartbeat"}'] == 0


# --- hostile bodies ------------------------------------------------------------------------------------
VALID_REGISTER = json.loads(reg_req(0).model_dump_json())


def with_(**changes) -> dict:
    body = json.loads(json.dumps(VALID_REGISTER))
    body.update(changes)
    return body


BAD_REGISTER_BODIES = {
    "not-json": b"{not json",
    "empty": b"",
    "truncated": b'{"identity": {"replica_id": 0',
    "array": b"[]",
    "string": b'"x"',
    "null": b"null",
    "number": b"1",
    "true": b"true",
    "empty-object": b"{}",
    "missing-identity": json.dumps({k: v for k, v in VALID_REGISTER.items() if k != "identity"}).encode(),
    "missing-replica-id": json.dumps(with_(identity={"generation": 0, "attempt": 0})).encode(),
    "wrong-type-id": json.dumps(with_(identity={"replica_id": "zero", "generation": 0, "attempt": 0})).encode(),
    "float-id": json.dumps(with_(identity={"replica_id": 0.5, "generation": 0, "attempt": 0})).encode(),
    "negative-id": json.dumps(with_(identity={"replica_id": -1, "generation": 0, "attempt": 0})).encode(),
    "id-beyond-replicas": json.dumps(with_(identity={"replica_id": 3, "generation": 0, "attempt": 0})).encode(),
    "huge-id": json.dumps(with_(identity={"replica_id": 10**30, "generation": 0, "attempt": 0})).encode(),
    "extra-field": json.dumps(with_(color="blue")).encode(),
    "extra-identity-field": json.dumps(with_(identity={**VALID_REGISTER["identity"], "x": 1})).encode(),
    "endpoints-not-list": json.dumps(with_(state_endpoints="http://x")).encode(),
    "endpoints-empty": json.dumps(with_(state_endpoints=[])).encode(),
    "huge-store-addr": json.dumps(with_(store_addr="h" * 100_000)).encode(),
    # Python's json accepts NaN and overflows 1e400 to inf: neither may reach an int field.
    "nan-id": b'{"identity": {"replica_id": NaN, "generation": 0, "attempt": 0}, "store_addr": "a:1"}',
    "inf-id": b'{"identity": {"replica_id": 1e400, "generation": 0, "attempt": 0}, "store_addr": "a:1"}',
    "5000-digit-int": b'{"identity": {"replica_id": ' + b"9" * 5000 + b"}}",
    "deeply-nested": b"[" * 100_000,
    "deeply-nested-object": b'{"a":' * 50_000,
    "invalid-utf8": b'{"store_addr": "\xff\xfe"}',
    "utf16-noise": b"\xff\xfe\x00",
}


@pytest.mark.parametrize("body", BAD_REGISTER_BODIES.values(), ids=BAD_REGISTER_BODIES.keys())
def test_bad_body_is_a_4xx_with_a_reason(coord, body):
    r = post(coord, "/v1/register", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert isinstance(error, str) and error and r.json()["retry"] is False
    assert requests.get(coord.url + "/healthz", timeout=HTTP_TIMEOUT).status_code == 200
    assert client(coord).status().replicas == []


def test_malformed_json_names_the_problem(coord):
    r = post(coord, "/v1/heartbeat", b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = post(coord, "/v1/register", with_(color="blue"))
    assert r.status_code == 400 and "color" in r.json()["error"]
    r = post(coord, "/v1/register", with_(identity={"replica_id": -1, "generation": 0, "attempt": 0}))
    assert r.status_code == 400 and "replica_id" in r.json()["error"]


def test_body_over_one_mebibyte_is_refused(coord):
    body = json.dumps(with_(store_addr="a" * (2 << 20))).encode()
    r = post(coord, "/v1/register", body)
    assert r.status_code == 413 and "error" in r.json()
    assert requests.get(coord.url + "/healthz", timeout=HTTP_TIMEOUT).status_code == 200


@pytest.mark.parametrize(
    "path,status",
    [
        ("/v1/replicas/abc", 400),
        ("/v1/replicas/-1", 400),
        ("/v1/replicas/0?generation=x", 400),
        ("/v1/replicas/0?generation=-1", 400),
        ("/v1/replicas/99999999999999999999", 400),
        ("/v1/rendezvous/abc", 400),
        ("/v1/rendezvous/0?attempt=1.5", 400),
        ("/v1/replicas/0?known=unknown&wait_s=x", 400),
        ("/v1/replicas/0?known=unknown&wait_s=-1", 400),
        ("/v1/replicas/0?known=unknown&wait_s=61", 400),
        ("/v1/replicas/0?known=healthy&wait_s=30", 200),  # answered at once: the state is not `known`
        ("/v1/replicas/0", 200),
        ("/v1/nothing-here", 404),
    ],
)
def test_get_paths_are_validated(coord, path, status):
    r = get(coord, path)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json() == {"replica_id": 0, "state": "unknown", "reason": None, "job_completed": False}
    else:
        assert r.json()["error"]


def test_calls_from_unregistered_replica_are_404(coord):
    hb = json.loads(HeartbeatRequest(identity=ident(1), step=0).model_dump_json())
    assert post(coord, "/v1/heartbeat", hb).status_code == 404
    r = post(coord, "/v1/quorum", json.loads(q_req(1, timeout_s=0.1).model_dump_json()))
    assert r.status_code == 404 and "not registered" in r.json()["error"]


# --- quorum ------------------------------------------------------------------------------------------
def test_three_replicas_long_poll_into_one_quorum(coord):
    for rid in range(3):
        client(coord).register(reg_req(rid))
    out = quorum_together(coord, [q_req(rid) for rid in range(3)])
    assert {r.quorum_id for r in out.values()} == {0}
    assert all(r.members == [0, 1, 2] and r.round == 0 for r in out.values())
    assert sorted(r.rank for r in out.values()) == [0, 1, 2]
    assert all(out[rid].rank == rid for rid in range(3))
    assert len({r.store_prefix for r in out.values()}) == 1
    # Next step, same members, nothing failed: same quorum id, next round.
    again = quorum_together(coord, [q_req(rid, 1, 0, 0) for rid in range(3)])
    assert {(r.quorum_id, r.round, r.max_step) for r in again.values()} == {(0, 1, 1)}
    s = client(coord).status()
    assert (s.round, s.quorum_id, s.members, s.max_step) == (1, 0, [0, 1, 2], 1)


def test_long_poll_times_out_with_408_when_replicas_are_missing(coord):
    client(coord).register(reg_req(0))
    body = json.loads(q_req(0, timeout_s=0.3).model_dump_json())
    t0 = time.monotonic()
    r = post(coord, "/v1/quorum", body)
    took = time.monotonic() - t0
    assert r.status_code == 408 and r.json()["retry"] is True
    assert 0.25 <= took < 2.0
    with pytest.raises(CoordinatorError, match="no quorum"):
        client(coord).quorum(q_req(0, timeout_s=0.2), timeout_s=0.5)


def test_reported_failure_excludes_member_from_next_quorum(coord):
    c = client(coord)
    for rid in range(3):
        c.register(reg_req(rid))
    first = quorum_together(coord, [q_req(rid) for rid in range(3)])
    assert c.report_failure(FailureReport(identity=ident(2), reason="CUDA error", exit_code=1)) is True
    assert c.report_failure(FailureReport(identity=ident(2), reason="again")) is False
    nxt = quorum_together(coord, [q_req(rid, 1, 0, 0, failed=True) for rid in range(2)])
    assert all(r.members == [0, 1] for r in nxt.values())
    assert {r.quorum_id for r in nxt.values()} == {first[0].quorum_id + 1}
    assert nxt[0].store_prefix != first[0].store_prefix
    with pytest.raises(Evicted):
        c.quorum(q_req(2, 1, 0, 0), timeout_s=1.0)
    assert c.replica_state(ident(2)).state == "failed"
    assert "CUDA error" in c.replica_state(ident(2)).reason


def test_an_oom_killed_report_reaches_status_training_even_after_the_replica_was_declared_failed(coord):
    c = client(coord)
    for rid in range(3):
        c.register(reg_req(rid))
    assert c.report_failure(FailureReport(identity=ident(2), reason="heartbeat lost")) is True
    said = "OOMKilled: worker rank 0 was OOMKilled (memory limit 3Gi)"
    assert c.report_failure(FailureReport(identity=ident(2), reason=said)) is False  # failed already
    (kills,) = coord.call(lambda: coord.server.training()["oomKills"])
    assert (kills["replica"], kills["generation"], kills["count"]) == (2, 0, 1)
    assert kills["message"] == "worker rank 0 was OOMKilled (memory limit 3Gi)"


def test_failure_report_wakes_waiting_members(coord):
    c = client(coord)
    for rid in range(3):
        c.register(reg_req(rid))
    quorum_together(coord, [q_req(rid) for rid in range(3)])
    result: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: result.update(r=client(coord).quorum(q_req(0, 1, 0, 0), timeout_s=4)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # waiting for 1 and 2
    c.report_failure(FailureReport(identity=ident(2), reason="gone"))
    c.report_failure(FailureReport(identity=ident(1), reason="gone"))
    waiter.join(4)
    assert result["r"].members == [0]


def test_waiting_replica_declared_dead_is_evicted_at_once(coord):
    c = client(coord)
    c.register(reg_req(0))  # 1 and 2 never come, so 0's first quorum waits
    outcome: dict[str, object] = {}

    def wait() -> None:
        t0 = time.monotonic()
        try:
            client(coord).quorum(q_req(0, timeout_s=3.0), timeout_s=4.0)
        except Exception as e:  # noqa: BLE001 - asserted below
            outcome["error"] = e
        outcome["took"] = time.monotonic() - t0

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: coord.call(lambda: 0 in coord.server.membership.pending))
    assert c.report_failure(FailureReport(identity=ident(0), reason="watchdog"))
    waiter.join(5)
    assert isinstance(outcome["error"], Evicted)
    assert outcome["took"] < 1.5  # not only when its 3 s long-poll ran out


def test_stale_incarnation_is_evicted(coord):
    c = client(coord)
    c.register(reg_req(0, gen=1))
    with pytest.raises(Evicted) as e:
        c.register(reg_req(0, gen=0))
    assert e.value.status == 409 and "older" in str(e.value)
    with pytest.raises(Evicted):
        c.heartbeat(HeartbeatRequest(identity=ident(0, 0), step=0))
    raw = post(coord, "/v1/heartbeat", json.loads(HeartbeatRequest(identity=ident(0, 0), step=0).model_dump_json()))
    assert raw.status_code == 409 and raw.json()["error"]
    c.register(reg_req(0, gen=1, att=1))  # an in-place restart supersedes generation 1 attempt 0
    assert c.replica_state(ident(0, 1, 0)).state == "superseded"
    assert c.replica_state(ident(0, 1, 1)).state == "healthy"
    with pytest.raises(Evicted):
        c.quorum(QuorumRequest(identity=ident(0, 1, 0), step=0, commit_quorum_id=-1, last_round=-1), timeout_s=1)


def test_heartbeat_timeout_marks_replica_failed(start_coordinator):
    ct = start_coordinator(num_replicas=2, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    c = client(ct)
    reg = c.register(reg_req(0))
    assert (reg.heartbeat_interval_s, reg.heartbeat_timeout_s) == (0.1, 0.5)
    c.register(reg_req(1, step=3))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # replica 1 beats, replica 0 stays silent
        c.heartbeat(HeartbeatRequest(identity=ident(1), step=3))
        time.sleep(0.1)
    states = {r.replica_id: r.state for r in c.status().replicas}
    assert states == {0: "failed", 1: "healthy"}
    assert "no heartbeat" in c.replica_state(ident(0)).reason
    with pytest.raises(Evicted):
        c.heartbeat(HeartbeatRequest(identity=ident(0), step=0))
    metrics = requests.get(ct.url + "/metrics", timeout=HTTP_TIMEOUT).text
    assert 'transom_coordinator_replica_failures_total{reason="heartbeat"} 1.0' in metrics
    assert "transom_coordinator_healthy_replicas 1.0" in metrics


def test_status_reflects_replicas(coord):
    c = client(coord)
    for rid in range(3):
        c.register(reg_req(rid))
    quorum_together(coord, [q_req(rid) for rid in range(3)])
    c.heartbeat(HeartbeatRequest(identity=ident(1), step=1))
    # Step 4 cannot have been committed under one round at step 0: refused, nothing recorded.
    bad = post(coord, "/v1/heartbeat", {"identity": ident(1).model_dump(), "step": 4})
    assert bad.status_code == 400 and "can hold at most 1 committed steps" in bad.json()["error"]
    c.report_failure(FailureReport(identity=ident(2), reason="oom"))
    r = get(coord, "/v1/status")
    assert r.status_code == 200
    s = r.json()
    assert (s["quorum_id"], s["members"], s["num_replicas"], s["healthy_replicas"]) == (0, [0, 1, 2], 3, 2)
    assert s["paused"] is False and s["max_step"] == 1
    rows = {row["replica_id"]: row for row in s["replicas"]}
    assert [rows[i]["state"] for i in range(3)] == ["healthy", "healthy", "failed"]
    assert rows[1]["step"] == 1 and rows[2]["failures"] == 1 and rows[2]["last_failure"] == "oom"
    assert rows[2]["heartbeat_age_s"] is None and 0 <= rows[0]["heartbeat_age_s"] < 5
    assert {"registered", "quorum", "failed"} <= {e["kind"] for e in s["events"]}


def test_rendezvous_put_then_get(coord):
    c = client(coord)
    assert get(coord, "/v1/rendezvous/1?generation=2&attempt=0").status_code == 404
    with pytest.raises(CoordinatorError) as e:
        c.get_rendezvous(ident(1, 2), timeout_s=0.3)
    assert e.value.status == 404
    info = RendezvousInfo(identity=ident(1, 2), master_addr="10.1.2.3", master_port=29400)
    c.put_rendezvous(info)
    r = get(coord, "/v1/rendezvous/1?generation=2&attempt=0")
    assert r.status_code == 200 and RendezvousInfo.model_validate(r.json()) == info
    assert c.get_rendezvous(ident(1, 2), timeout_s=1) == info
    assert get(coord, "/v1/rendezvous/1?generation=2&attempt=1").status_code == 404  # another incarnation
    newer = RendezvousInfo(identity=ident(1, 3), master_addr="10.1.2.4", master_port=29401)
    assert post(coord, "/v1/rendezvous", json.loads(newer.model_dump_json()), method="PUT").status_code == 200
    assert get(coord, "/v1/rendezvous/1?generation=3").json()["master_addr"] == "10.1.2.4"
    assert get(coord, "/v1/rendezvous/1?generation=2").status_code == 404  # older entry dropped
    bad = json.loads(info.model_dump_json()) | {"master_port": 70000}
    assert post(coord, "/v1/rendezvous", bad, method="PUT").status_code == 400


# --- life cycle ---------------------------------------------------------------------------------
def test_stop_does_not_hang_on_an_open_long_poll():
    ct = CoordinatorThread(Settings(num_replicas=2), TOKEN)
    ct.start()
    try:
        client(ct).register(reg_req(0))
        def poll() -> None:
            try:
                requests.post(ct.url + "/v1/quorum", headers=AUTH, timeout=HTTP_TIMEOUT,
                              data=q_req(0, timeout_s=60).model_dump_json())
            except requests.ConnectionError:
                pass  # expected: the server goes away under the open long-poll

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        wait_until(lambda: ct.call(lambda: 0 in ct.server.membership.pending))
    finally:
        t0 = time.monotonic()
        ct.stop(timeout_s=4.0)
    assert time.monotonic() - t0 < 4.0
    with pytest.raises(requests.ConnectionError):
        requests.get(ct.url + "/healthz", timeout=1.0)


def test_checkpoint_reports_keep_the_newest_and_need_a_live_replica(coord):
    c = client(coord)
    c.register(reg_req(0, step=100))  # e.g. restored from a checkpoint of step 100
    assert c.report_checkpoint(CheckpointReport(identity=ident(0), step=100, uri="file:///ck/step-100"))
    assert c.status().last_checkpoint is None  # held: no other replica supports step 100 yet
    c.register(reg_req(1, step=100))
    assert not c.report_checkpoint(CheckpointReport(identity=ident(0), step=50, uri="file:///ck/step-50"))
    assert c.status().last_checkpoint == 100
    assert post(coord, "/v1/checkpoint", {"identity": ident(2).model_dump(), "step": 20, "uri": "x"}).status_code == 404
    r = post(coord, "/v1/checkpoint", {"identity": ident(0).model_dump(), "step": -1, "uri": "x"})
    assert r.status_code == 400 and "step" in r.json()["error"]
    assert post(coord, "/v1/checkpoint", {"identity": ident(0).model_dump(), "step": 300, "uri": ""}).status_code == 400


def test_signal_posts_are_answered_with_the_pace_to_keep(coord):
    c = client(coord)
    c.register(reg_req(0))
    row = SignalRow(step=0, rank=0, step_seconds=0.5)
    assert c.report_signals(SignalBatch(identity=ident(0), node_rank=0, rows=[row])).next_post_s == 1.0  # a small job
    r = post(coord, "/v1/signals", {"identity": ident(0).model_dump(), "node_rank": 0, "rows": []})
    assert r.status_code == 200 and r.json() == {"verdicts": 0, "next_post_s": 1.0, "duplicate_data": None}


def test_the_last_rows_of_an_incarnation_that_reported_its_own_failure_are_refused_without_an_event(coord):
    # Its launcher posts the attempt's last rows after its worker reported the failure: counted,
    # refused, and not an event that repeats the failure as the run's last line.
    c = client(coord)
    for r in (0, 1):
        c.register(reg_req(r))
    c.report_failure(FailureReport(identity=ident(1), reason="uncaught RuntimeError in rank 0: a bug"))
    with pytest.raises(Evicted):
        c.report_signals(SignalBatch(identity=ident(1), rows=[SignalRow(step=0, rank=0, step_seconds=0.5)]))
    with pytest.raises(Evicted):
        c.heartbeat(HeartbeatRequest(identity=ident(1), step=0))
    assert coord.call(lambda: dict(coord.server.refusals.counts)) == {"/v1/signals": 1, "/v1/heartbeat": 1}
    events = [(e.kind, e.message) for e in c.status().events]
    assert [k for k, _ in events].count("failed") == 1 and "refused" not in [k for k, _ in events], events


def test_identical_input_digests_are_told_to_every_poster_and_in_the_status_and_restart_no_one(coord):
    c = client(coord)
    for r in (0, 1):
        c.register(reg_req(r))
    row = SignalRow(step=0, rank=0, step_seconds=0.5, input_digest=-42)
    assert c.report_signals(SignalBatch(identity=ident(0), rows=[row])).duplicate_data is None
    found = c.report_signals(SignalBatch(identity=ident(1), rows=[row])).duplicate_data
    assert found is not None and (found.step, found.replicas) == (0, [0, 1])
    assert found.message.startswith("replicas 0 and 1 trained on identical inputs at step 0")
    assert c.report_signals(SignalBatch(identity=ident(0), rows=[])).duplicate_data == found  # every later answer
    status = c.status()
    assert status.duplicate_data == found and [r.state for r in status.replicas] == ["healthy", "healthy"]
    assert [e.kind for e in status.events].count("duplicate_data") == 1
    training = coord.call(coord.server.training)
    assert training["duplicateData"] == {"step": 0, "replicas": [0, 1], "message": found.message}
    assert "verdicts" not in training


def test_a_claim_believed_before_the_first_round_does_not_blind_detection(start_coordinator):
    # Replica 0 registers at step 2^62 - 1 before a fresh coordinator's first round, posts one
    # row at 2^62, then trains from step 0 with the others. That row once made every real step
    # judged on the first poster's rows alone (the others' "late"): an SDC in replica 1 gave
    # no verdict, its record read `single`, and a bad batch on every replica blamed replica 0.
    ct = CoordinatorThread(Settings(job="http-test", num_replicas=3, heartbeat_timeout_s=30.0), TOKEN,
                           detection=DetectionSettings(action="Report"))
    ct.start()
    try:
        c = client(ct)
        c.register(reg_req(0, step=2**62 - 1))
        for r in (1, 2):
            c.register(reg_req(r))
        c.report_signals(SignalBatch(identity=ident(0), rows=[SignalRow(step=2**62, rank=0, step_seconds=0.5)]))
        for step in range(13):
            quorum_together(ct, [q_req(r, step=step, commit=0 if step else -1, last_round=step - 1)
                                 for r in range(3)])
        for r in range(3):  # replica 0's rows first, as in the report
            c.report_signals(SignalBatch(identity=ident(r), rows=[
                SignalRow(step=step, rank=0, step_seconds=0.5, loss=1.0,
                          finite=step not in (5, 6, 7),  # a bad batch, non-finite on every replica
                          fingerprint=(7 + (r == 1)) if step == 12 else None)  # replica 1's bit flip
                for step in range(13)]))
        verdicts = [e.message for e in c.status().events if e.kind == "verdict"]
        assert len(verdicts) == 1 and verdicts[0].startswith("replica 1: SilentDataCorruption"), verdicts
        assert c.fingerprint(13, 0) == FingerprintRecord(state="agreed", value=7)
    finally:
        ct.stop()
