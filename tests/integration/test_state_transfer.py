"""What a recovering replica takes from a peer: tensors and JSON, never code.

The state travels in `transom.ft.wire`'s format (tensor blobs read without unpickling, a
JSON index checked against a schema). Round trips of real model and optimizer state, every
hostile payload refused with a WireError, and a real `FaultTolerant` (its own coordinator
on loopback) asked to recover from a state server that serves a pickle which would run
code: nothing runs, the recovery fails, and the replica's own state is untouched.
"""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.models import QuorumResponse, RecoverySource
from transom.coordinator.server import CoordinatorThread
from transom.ft import wire
from transom.ft.state_server import StateServer

pytestmark = pytest.mark.timeout(60)


class RunsCode:
    marker: Path

    def __reduce__(self):
        return (os.system, (f"touch {RunsCode.marker}",))


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


@pytest.mark.compat
def test_round_trip_of_model_and_optimizer_state():
    model, opt = trained(0)
    state = {"step": 7, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "extra": {"epoch": 2, "seen": [1, 2], "scale": torch.tensor(65536.0)}}
    back = wire.decode(wire.encode(state))
    assert back["step"] == 7 and back["extra"]["seen"] == [1, 2]
    other, other_opt = trained(1)
    other.load_state_dict(back["model"])
    other_opt.load_state_dict(back["optimizer"])
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert other_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert torch.equal(back["extra"]["scale"], torch.tensor(65536.0))


def _payload_with_index(index: dict) -> bytes:
    body = json.dumps(index).encode()
    return wire.MAGIC + body + struct.pack("<Q", len(body))


HOSTILE = {
    "a pickle with code": None,  # filled in by the test (needs the marker path)
    "empty": b"",
    "magic only": wire.MAGIC,
    "index longer than the payload": wire.MAGIC + struct.pack("<Q", 10**9),
    "index not json": wire.MAGIC + b"{{{" + struct.pack("<Q", 3),
    "unknown field": _payload_with_index({"entries": [], "skeleton": None, "run": "rm -rf"}),
    "skeleton names a missing tensor": _payload_with_index({"entries": [], "skeleton": {"__tensor__": "w"}}),
    "entry outside the payload": _payload_with_index({"entries": [
        {"key": "w", "dtype": "float32", "shape": [2], "offset": 16, "length": 2000}], "skeleton": {"__tensor__": "w"}}),
    "unknown dtype": _payload_with_index({"entries": [
        {"key": "w", "dtype": "object", "shape": [2], "offset": 16, "length": 8}], "skeleton": None}),
    "deep skeleton": _payload_with_index({"entries": [], "skeleton": json.loads("[" * 200 + "]" * 200)}),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_payloads_are_refused_and_run_nothing(tmp_path, case):
    RunsCode.marker = tmp_path / "code-ran"
    data = HOSTILE[case]
    if data is None:
        buf = io.BytesIO()
        torch.save({"step": 1, "model": RunsCode()}, buf)  # what a peer could send before
        data = buf.getvalue()
    with pytest.raises(wire.WireError):
        wire.decode(data)
    assert not RunsCode.marker.exists()


def test_a_recovering_replica_never_unpickles_what_its_source_serves(tmp_path, monkeypatch):
    from transom import ft

    RunsCode.marker = tmp_path / "code-ran"
    token = "transfer-token"
    coordinator = CoordinatorThread(Settings(job="transfer", num_replicas=2), token)
    url = coordinator.start()
    for name, value in {contract.ENV_COORDINATOR_URL: url, contract.ENV_COORDINATOR_TOKEN: token,
                        contract.ENV_REPLICA_ID: "1", contract.ENV_NUM_REPLICAS: "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(contract.ENV_CHECKPOINT_URI, raising=False)
    source = StateServer(token)
    model, opt = trained(0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = ft.FaultTolerant(model, opt, ft.init(backend="gloo"))
    try:
        buf = io.BytesIO()
        torch.save({"step": 5, "model": RunsCode(), "optimizer": {}, "extra": None}, buf)
        source.publish(3, buf.getvalue())
        q = QuorumResponse(round=3, quorum_id=1, members=[0, 1], rank=1, store_addr="127.0.0.1:1",
                           store_prefix="transom/t/e/q1", max_step=5, participants=1, recovering=[1],
                           serve_recovery=False,
                           recover_from=RecoverySource(replica_id=0, step=5, endpoints=[source.url]))
        with pytest.raises(wire.WireError):
            trainer._recover(q)
        assert not RunsCode.marker.exists(), "the joiner ran code its source sent"
        assert trainer.step == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

        # The same path takes a real state: the source's tensors, bit for bit.
        peer, peer_opt = trained(1)
        source.publish(4, wire.encode({"step": 5, "model": peer.state_dict(), "optimizer": peer_opt.state_dict(),
                                       "extra": None}))
        trainer._recover(q.model_copy(update={"round": 4}))
        assert trainer.step == 5 and all(torch.equal(a, b) for a, b in zip(peer.parameters(), model.parameters()))
    finally:
        trainer.close(end_job=True)
        source.close()
        coordinator.stop()


def _raw_get(url: str, request: bytes, timeout_s: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(request)
        return s.recv(4096).split(b"\r\n", 1)[0]


@pytest.mark.parametrize("request_line, status", [
    (b"GET /state/" + b"9" * 5000 + b" HTTP/1.1", b"400"),  # used to raise inside the handler
    (b"GET /state/-1 HTTP/1.1", b"400"),
    (b"GET /state/1/../../etc HTTP/1.1", b"400"),
    (b"GET /state/7 HTTP/1.1", b"404"),
])
def test_state_server_answers_malformed_requests_with_a_4xx(request_line, status):
    server = StateServer("tok")
    try:
        got = _raw_get(server.url, request_line + b"\r\nAuthorization: Bearer tok\r\n\r\n")
        assert got.split()[1] == status
    finally:
        server.close()


@pytest.mark.parametrize("token", ["t\u00f6k".encode("latin-1"), "t\u00f6k".encode("utf-8"), b"\xff\xfe"])
def test_a_non_ascii_token_is_just_a_wrong_token(token):
    server = StateServer("tok")
    coordinator = CoordinatorThread(Settings(job="auth", num_replicas=1), "tok")
    try:
        for url, path in ((server.url, b"/state/1"), (coordinator.start(), b"/v1/status")):
            got = _raw_get(url, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token + b"\r\n\r\n")
            assert got.split()[1] == b"401", (url, got)
    finally:
        server.close()
        coordinator.stop()


def test_idle_connections_cannot_pile_up_threads_and_expire():
    server = StateServer("tok", max_connections=8, idle_timeout_s=1.0)
    server.publish(1, b"state")
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) for _ in range(200)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - before <= 8  # one thread per admitted connection, no more
        time.sleep(1.5)  # the idle timeout ends the admitted ones
        assert threading.active_count() - before <= 1
        got = _raw_get(server.url, b"GET /state/1 HTTP/1.1\r\nAuthorization: Bearer tok\r\n\r\n")
        assert got.split()[1] == b"200"
    finally:
        for s in idle:
            s.close()
        server.close()
