"""What a joining replica takes from a peer: tensors and JSON, never code.

The small state travels in `transom.ft.wire`'s format (tensor blobs read without
unpickling, a JSON index checked against a schema), the snapshot as raw tensor bytes in
checksummed chunks under a JSON manifest (`transom.ft.transfer`). Round trips of real model
and optimizer state; every hostile payload and manifest refused with a WireError; a real
`FaultTolerant` (its own coordinator on loopback) joining from a state server that serves
a pickle which would run code (nothing runs, the replica's state is untouched) and then
catching up from a real one; chunks from several sources with a lying one and a dead one;
the bandwidth cap; malformed requests answered with a 4xx.
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
from transom.checkpoint import structure
from transom.coordinator.membership import Settings
from transom.coordinator.models import QuorumResponse, RecoverySource
from transom.coordinator.thread import CoordinatorThread
from transom.ft import transfer, wire
from transom.ft.catchup import Joiner, record_of, small_part
from transom.ft.expected import ExpectedState
from transom.ft.ftar import StepAllReduce
from transom.ft.sources import Sources
from transom.ft.state_server import StateServer
from transom.ft.step_values import QuorumOutcome

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
        {"key": "w", "dtype": "float32", "shape": [2], "offset": 16, "length": 2000}],
        "skeleton": {"__tensor__": "w"}}),
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


def _joiner_round(round_id: int, source_url: str) -> QuorumResponse:
    return QuorumResponse(round=round_id, quorum_id=1, members=[0, 1], rank=1, store_addr="127.0.0.1:1",
                          store_prefix="transom/t/e/q1", max_step=5, participants=1, recovering=[1],
                          serve_recovery=False, snapshot_from=5,
                          sources=[RecoverySource(replica_id=0, endpoints=[source_url])])


def _published(step: int, state: dict) -> transfer.Published:
    tensors, skeleton = structure.flatten(state, torch.is_tensor)
    return transfer.publish(step, {k: v.detach().clone() for k, v in tensors.items()}, skeleton, chunk_bytes=512)


def _joiner_environment(monkeypatch, url: str, token: str) -> None:
    """This process as replica 1 of 2, without checkpoints or detection."""
    for name, value in {contract.ENV_COORDINATOR_URL: url, contract.ENV_COORDINATOR_TOKEN: token,
                        contract.ENV_REPLICA_ID: "1", contract.ENV_NUM_REPLICAS: "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(contract.ENV_CHECKPOINT_URI, raising=False)
    # A hand-driven source posts no signal rows: no fingerprint to check the snapshot against
    # (ft/snapshot_check.py would wait for one); this test is about what is decoded and replayed.
    monkeypatch.setenv(contract.ENV_DETECTION, '{"enabled": false}')


def _recovering(q, ftar: StepAllReduce) -> QuorumOutcome:
    """The exchange's outcome of a round this replica recovers in."""
    return QuorumOutcome(quorum=q, ftar=ftar, recovering=True, changed=False)


def _refuses_a_pickle_with_code(trainer, source: StateServer) -> None:
    """A small state that is a pickle with code is refused: nothing runs, the joiner stays
    where it was."""
    buf = io.BytesIO()
    torch.save({"step": 5, "model": RunsCode(), "optimizer": {}, "extra": None}, buf)
    source.publish_small(3, buf.getvalue())
    ftar = StepAllReduce(None, 1, contribute=False)
    ftar.error = None
    assert trainer._recovery.round(_recovering(_joiner_round(3, source.url), ftar)) is None
    assert ftar.failed and ftar.error and "bad header" in ftar.error
    assert not RunsCode.marker.exists(), "the joiner ran code its source sent"
    assert trainer.step == 0 and not trainer._recovery.active


def test_a_joiner_never_unpickles_what_its_source_serves_and_catches_up_from_a_real_one(tmp_path, monkeypatch):
    """The joiner's whole path in one process against a hand-driven source: a small state
    that is a pickle with code is refused (nothing runs, nothing changes); a real small state
    puts the joiner in step at once; the snapshot (raw bytes and JSON) and one recorded
    update replayed on the shadow end with the source's parameters after that update."""
    from transom import ft

    RunsCode.marker = tmp_path / "code-ran"
    token = "transfer-token"
    coordinator = CoordinatorThread(Settings(job="transfer", num_replicas=2), token)
    _joiner_environment(monkeypatch, coordinator.start(), token)
    source = StateServer(token)
    model, opt = trained(0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = ft.FaultTolerant(model, opt, ft.init(backend="gloo"))
    try:
        _refuses_a_pickle_with_code(trainer, source)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

        # A real source: its small state at step 5, then its snapshot of step 5.
        peer, peer_opt = trained(1)
        peer_state = {"step": 5, "model": peer.state_dict(), "optimizer": peer_opt.state_dict(), "scaler": None,
                      "sampler": None, "extra": None, "rng": None}
        source.publish_small(4, wire.encode(small_part(peer_state)))
        ftar = StepAllReduce(None, 1, contribute=False)
        ftar.error = None
        assert trainer._recovery.round(_recovering(_joiner_round(4, source.url), ftar)) == 5
        assert not ftar.failed and trainer._recovery.active
        source.publish_snapshot(_published(5, peer_state))
        # One committed step while catching up: recorded, replayed on the shadow.
        grads = [torch.full_like(p, 0.5) for p in peer.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        assert trainer._recovery.defer(5, update=True) == 1
        deadline = time.monotonic() + 20
        while trainer._recovery.active:  # swapped in once the shadow has replayed step 5
            trainer._recovery.before_apply(6)
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for p, g in zip(peer.parameters(), grads):
            p.grad = g
        peer_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(peer.parameters(), model.parameters()))
        assert all(torch.equal(opt.state[a]["exp_avg"], peer_opt.state[b]["exp_avg"])
                   for a, b in zip(model.parameters(), peer.parameters()))
    finally:
        trainer.close()  # hand-driven: no round ever answered it, so it cannot complete the job
        source.close()
        coordinator.stop()


def test_a_joiner_over_its_record_budget_asks_for_a_newer_snapshot_and_still_ends_equal():
    """Recording costs memory; past `max_record_bytes` the joiner forgets its records, needs a
    snapshot newer than the last one and catches up from that instead."""
    source = StateServer("tok")
    model, opt = trained(0)
    peer, peer_opt = trained(1)
    joiner = Joiner(model, opt, "tok", torch.device("cpu"), None, need_from=5, sources=[source.url],
                    timeout_s=20.0, max_record_bytes=1)
    try:
        state = {"step": 5, "model": peer.state_dict(), "optimizer": peer_opt.state_dict()}
        source.publish_snapshot(_published(5, state))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        joiner.record(record_of(5, opt, update=True))  # over the budget at once
        assert joiner.need_from == 6 and not joiner.ready_at(6)
        for p in peer.parameters():  # the sources go on and take a newer snapshot
            p.grad = torch.ones_like(p)
        peer_opt.step()
        source.publish_snapshot(_published(6, {**state, "model": peer.state_dict(),
                                               "optimizer": peer_opt.state_dict(), "step": 6}))
        deadline = time.monotonic() + 20
        while not joiner.ready_at(6):
            assert joiner.error is None and time.monotonic() < deadline
            time.sleep(0.02)
        joiner.take()
        assert all(torch.equal(a, b) for a, b in zip(peer.parameters(), model.parameters()))
        assert [f[0] for f in joiner.fetched][-1] == 6
    finally:
        joiner.close()
        source.close()


def _manifest(**changes) -> bytes:
    body = {"step": 1, "chunk_bytes": 64, "total_bytes": 8, "skeleton": {"__tensor__": "w"}, "checksum": "crc32c",
            "digests": [0],
            "entries": [{"key": "w", "dtype": "float32", "shape": [2], "offset": 0}]}
    body.update(changes)
    return json.dumps(body).encode()


BAD_MANIFESTS = {
    "not json": b"{{{",
    "unknown field": _manifest(run="rm -rf"),
    "unknown checksum": _manifest(checksum="crc32"),
    "no checksum named": _manifest(checksum=None),
    "skeleton names a missing tensor": _manifest(skeleton={"__tensor__": "x"}),
    "tensors overlap": _manifest(entries=[{"key": "w", "dtype": "float32", "shape": [2], "offset": 0},
                                          {"key": "v", "dtype": "float32", "shape": [2], "offset": 4}],
                                 total_bytes=12),
    "bytes beyond the tensors": _manifest(total_bytes=4000, digests=[0] * 63),
    "a digest missing": _manifest(digests=[]),
    "unknown dtype": _manifest(entries=[{"key": "w", "dtype": "object", "shape": [2], "offset": 0}]),
    "negative shape": _manifest(entries=[{"key": "w", "dtype": "float32", "shape": [-2], "offset": 0}]),
    "deep skeleton": _manifest(skeleton=json.loads("[" * 200 + "]" * 200)),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_bad_manifests_are_refused_before_anything_is_allocated(case):
    with pytest.raises(wire.WireError):
        transfer.parse_manifest(BAD_MANIFESTS[case])


def test_chunks_come_from_every_source_and_a_lying_or_dead_one_is_dropped():
    model, opt = trained(0)
    state = {"step": 2, "model": model.state_dict(), "optimizer": opt.state_dict()}
    good = _published(2, state)
    lying = _published(2, state)
    for view in lying.views:  # same manifest, flipped bytes: the digests must catch it
        if len(view):
            view[0] ^= 0xFF
    servers = [StateServer("tok") for _ in range(3)]
    try:
        servers[0].publish_snapshot(good)
        servers[1].publish_snapshot(lying)
        servers[2].publish_snapshot(good)
        urls = [s.url for s in servers]
        chosen = Sources(lambda: urls, "tok", 5.0, ExpectedState.of(model, opt)).find(lambda: (2, 2))
        manifest, serving = chosen.manifest, chosen.serving
        assert manifest.step == 2 and serving == urls
        data = transfer.fetch(manifest, serving, "tok", 5.0)
        back = transfer.assemble(manifest, data)
        assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
        with pytest.raises(wire.WireError, match="every source failed"):
            transfer.fetch(manifest, [urls[1]], "tok", 5.0)
        servers[0].close()  # dead: its chunks come from the live one
        assert bytes(transfer.fetch(manifest, urls[:1] + urls[2:], "tok", 5.0)) == bytes(data)
        servers[2].publish_snapshot(_published(3, {**state, "step": 3}))  # replaced mid-way
        with pytest.raises(transfer.SnapshotChanged):
            transfer.fetch(manifest, [urls[2]], "tok", 5.0)
    finally:
        for s in servers[1:]:
            s.close()


def test_a_bandwidth_cap_holds_the_transfer_to_it():
    model, opt = trained(0)
    published = _published(1, {"model": model.state_dict()})
    capped = StateServer("tok", bytes_per_s=published.manifest.total_bytes / 0.5)  # half a second
    free = StateServer("tok")
    try:
        for server, at_least, at_most in ((capped, 0.45, 5.0), (free, 0.0, 0.4)):
            server.publish_snapshot(published)
            t0 = time.monotonic()
            transfer.fetch(published.manifest, [server.url], "tok", 5.0)
            assert at_least <= time.monotonic() - t0 <= at_most
    finally:
        capped.close()
        free.close()


def _raw_get(url: str, request: bytes, timeout_s: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(request)
        return s.recv(4096).split(b"\r\n", 1)[0]


@pytest.mark.parametrize("request_line, status", [
    (b"GET /small/" + b"9" * 5000 + b" HTTP/1.1", b"400"),  # used to raise inside the handler
    (b"GET /small/-1 HTTP/1.1", b"400"),
    (b"GET /small/1/../../etc HTTP/1.1", b"400"),
    (b"GET /small/7 HTTP/1.1", b"404"),
    (b"GET /snapshot HTTP/1.1", b"404"),
    (b"GET /snapshot/1/chunk/0 HTTP/1.1", b"404"),
    (b"GET /snapshot/1/chunk/" + b"9" * 50 + b" HTTP/1.1", b"400"),
    (b"GET /snapshot/x/chunk/0 HTTP/1.1", b"400"),
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
        for url, path in ((server.url, b"/small/1"), (server.url, b"/snapshot"), (coordinator.start(), b"/v1/status")):
            request = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token + b"\r\n\r\n"
            got = _raw_get(url, request)
            assert got.split()[1] == b"401", (url, got)
    finally:
        server.close()
        coordinator.stop()


def test_idle_connections_cannot_pile_up_threads_and_expire():
    server = StateServer("tok", max_connections=8, idle_timeout_s=1.0)
    server.publish_small(1, b"state")
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) for _ in range(200)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - before <= 8  # one thread per admitted connection, no more
        time.sleep(1.5)  # the idle timeout ends the admitted ones
        assert threading.active_count() - before <= 1
        got = _raw_get(server.url, b"GET /small/1 HTTP/1.1\r\nAuthorization: Bearer tok\r\n\r\n")
        assert got.split()[1] == b"200"
    finally:
        for s in idle:
            s.close()
        server.close()
