"""A joiner among sources that lie: it takes only a snapshot that fits its own model, of a
step that was committed, that a majority of its sources serve (or that it verified).

Real state servers on loopback serve the snapshots; the joiner (ft/catchup.py's `Joiner`,
its background thread and all) has a fresh model whose optimizer never stepped, as a
restarted replica has. One source lies in each way a manifest can: it claims 2 GiB for a
model of 1 KB, another shape, another dtype, a tensor the model lacks, a step nobody
committed, a manifest longer than the state it could describe; or it serves a well-formed
snapshot of zeros. The joiner drops the liar without allocating what it claims, never
builds its state from the liar's snapshot, and ends with the honest sources' state.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Callable

import pytest
import torch

from transom.checkpoint import blob, structure
from transom.ft import sources as sources_module
from transom.ft import transfer
from transom.ft.catchup import Joiner, Shadow, record_of
from transom.ft.sources import SnapshotUse
from transom.ft.state_server import StateServer

pytestmark = pytest.mark.timeout(60)
GIB = 1 << 30


def model_and_optimizer(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same 1 KB model every test uses (178 float32 parameters), after `steps` steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


def snapshot(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
             change: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.detach().clone()) -> transfer.Published:
    """What a source serves for this state (as catchup.Source publishes it); `change` makes
    each tensor's copy (zeros, for a liar)."""
    tensors, skeleton = structure.flatten({"step": step, "model": model.state_dict(),
                                           "optimizer": opt.state_dict()}, torch.is_tensor)
    return transfer.publish(step, {k: change(v) for k, v in tensors.items()}, skeleton, chunk_bytes=512)


def claiming(honest: transfer.Published, step: int | None = None, specs: dict[str, tuple[str, list[int]]] | None = None,
             skeleton: dict | None = None) -> transfer.Published:
    """A manifest that passes the schema (offsets, total, a digest per chunk) but describes
    `specs` (key -> dtype, shape) and `skeleton` instead of the honest ones; its chunks are
    the honest snapshot's."""
    m = honest.manifest
    specs = specs if specs is not None else honest_specs(honest)
    entries, offset = [], 0
    for key, (dtype, shape) in specs.items():
        offset = -(-offset // transfer.ALIGN) * transfer.ALIGN
        entries.append({"key": key, "dtype": dtype, "shape": shape, "offset": offset})
        offset += blob.nbytes_of(dtype, shape)
    body = {"step": m.step if step is None else step, "chunk_bytes": GIB, "total_bytes": offset, "entries": entries,
            "skeleton": m.skeleton if skeleton is None else skeleton, "checksum": m.checksum,
            "digests": [0] * -(-offset // GIB)}
    manifest_json = json.dumps(body).encode()
    transfer.parse_manifest(manifest_json)  # well-formed: only the joiner's own state can tell
    return transfer.Published(m, manifest_json, honest.views)


def honest_specs(honest: transfer.Published, **changes) -> dict[str, tuple[str, list[int]]]:
    return {**{e.key: (e.dtype, e.shape) for e in honest.manifest.entries}, **changes}


def grads_for(model: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def record(joiner: Joiner, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
    """The joiner's replica commits `step` (a recovering replica records the averaged update)."""
    grads = grads_for(model, step)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    joiner.record(record_of(step, opt, update=True))
    for p in model.parameters():
        p.grad = None
    return grads


def stepped(model: torch.nn.Module, opt: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
    """The honest sources' own step with the same averaged gradients."""
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    opt.step()


def wait_ready(joiner: Joiner, step: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not joiner.ready_at(step):
        assert joiner.error is None, joiner.error
        assert time.monotonic() < deadline, f"the joiner did not reach step {step}; fetched {joiner.fetched}"
        time.sleep(0.02)


def equal_state(model: torch.nn.Module, opt: torch.optim.Optimizer, peer: torch.nn.Module,
                peer_opt: torch.optim.Optimizer) -> bool:
    if not all(torch.equal(a, b) for a, b in zip(model.parameters(), peer.parameters())):
        return False
    return all(torch.equal(opt.state[a][k], peer_opt.state[b][k])
               for a, b in zip(model.parameters(), peer.parameters()) for k in ("exp_avg", "exp_avg_sq"))


@pytest.fixture
def servers():
    started: list[StateServer] = []

    def start(n: int) -> list[StateServer]:
        started.extend(StateServer("tok") for _ in range(n))
        return started[-n:]

    yield start
    for s in started:
        s.close()


def lies(honest: transfer.Published) -> dict[str, transfer.Published]:
    """Each a well-formed manifest of step 5 (the honest one's) or of a step nobody committed."""
    w = "model/0.weight"
    without_w = {**honest.manifest.skeleton, "model": {k: v for k, v in honest.manifest.skeleton["model"].items()
                                                        if k != "0.weight"}}
    return {
        "2 GiB of optimizer state": claiming(honest, specs=honest_specs(
            honest, **{"optimizer/state/0/exp_avg": ("float32", [1 << 29])})),
        "2 GiB under a key the model lacks": claiming(honest, specs=honest_specs(
            honest, **{"model/extra": ("float32", [1 << 29])})),
        "2 GiB as one of its parameters": claiming(honest, specs=honest_specs(honest, **{w: ("float32", [1 << 29])})),
        "another shape": claiming(honest, specs=honest_specs(honest, **{w: ("float32", [8, 16])})),
        "another dtype": claiming(honest, specs=honest_specs(honest, **{w: ("float64", [16, 8])})),
        "a parameter missing": claiming(honest, specs={k: v for k, v in honest_specs(honest).items() if k != w},
                                        skeleton=without_w),
        "a step nobody committed": claiming(honest, step=99),
        "a manifest longer than its state": claiming(honest, skeleton={**honest.manifest.skeleton,
                                                                       "padding": "x" * (48 << 20)}),
    }


@pytest.mark.parametrize("lie", ["2 GiB of optimizer state", "2 GiB under a key the model lacks",
                                 "2 GiB as one of its parameters", "another shape", "another dtype",
                                 "a parameter missing", "a step nobody committed", "a manifest longer than its state"])
def test_a_source_whose_manifest_cannot_fit_is_dropped_before_anything_is_allocated(servers, lie):
    """The liar is asked first and its step is the honest one's or higher: before, it won the
    1-1 tie and the joiner allocated the 2 GiB it claimed for a 1 KB model."""
    peer, peer_opt = model_and_optimizer(1, steps=2)
    honest = snapshot(5, peer, peer_opt)
    liar, source = servers(2)
    liar.publish_snapshot(lies(honest)[lie])
    source.publish_snapshot(honest)
    model, opt = model_and_optimizer(0, steps=0)  # a fresh replica: no optimizer state yet
    tracemalloc.start()
    try:
        joiner = Joiner(model, opt, "tok", torch.device("cpu"), None, need_from=5, sources=[liar.url, source.url],
                        timeout_s=20.0, max_record_bytes=1 << 30)
        try:
            grads = record(joiner, model, opt, 5)
            wait_ready(joiner, 6)
            _, peak = tracemalloc.get_traced_memory()
            joiner.take()
        finally:
            joiner.close()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak >> 20} MiB allocated for a snapshot of {honest.manifest.total_bytes} bytes"
    assert liar.url in joiner.sources.dropped and source.url not in joiner.sources.dropped
    assert [f[1] for f in joiner.fetched] == [honest.manifest.total_bytes]
    stepped(peer, peer_opt, grads)
    assert equal_state(model, opt, peer, peer_opt)


def test_a_lying_source_with_a_newer_step_does_not_win_and_a_majority_does(servers, monkeypatch):
    """An honest source at step 5 and a liar serving a well-formed snapshot of zeros at step 6
    (which was committed): no majority, so the joiner takes neither, however long it waits;
    once a second honest source serves step 5, it takes that."""
    monkeypatch.setattr(sources_module, "UNDECIDED_WAIT_S", 0.5)
    peer, peer_opt = model_and_optimizer(1, steps=2)
    honest, zeros = snapshot(5, peer, peer_opt), snapshot(6, peer, peer_opt, torch.zeros_like)
    first, liar, second = servers(3)
    first.publish_snapshot(honest)
    model, opt = model_and_optimizer(0, steps=0)
    joiner = Joiner(model, opt, "tok", torch.device("cpu"), None, need_from=5,
                    sources=[first.url, liar.url, second.url], timeout_s=20.0, max_record_bytes=1 << 30)
    try:
        grads = record(joiner, model, opt, 5)  # step 5 committed: a snapshot of step 6 is possible
        liar.publish_snapshot(zeros)
        time.sleep(1.5)
        assert joiner.fetched == [] and not joiner.ready_at(6), "the joiner took a snapshot no majority served"
        assert joiner.error is None and joiner.sources.dropped == {}
        second.publish_snapshot(snapshot(5, peer, peer_opt))
        wait_ready(joiner, 6)
        joiner.take()
    finally:
        joiner.close()
    assert [f[0] for f in joiner.fetched] == [5]
    stepped(peer, peer_opt, grads)
    assert equal_state(model, opt, peer, peer_opt)


def test_honest_sources_at_different_steps_are_asked_for_a_newer_snapshot_and_then_agree(servers, monkeypatch):
    """Two honest sources that keep snapshots of different steps (one became a source later)
    are no majority either: the joiner asks for a newer snapshot at its next commit, both
    take it at that commit, and it catches up from them."""
    monkeypatch.setattr(sources_module, "UNDECIDED_WAIT_S", 0.3)
    peer, peer_opt = model_and_optimizer(1, steps=2)
    a, b = servers(2)
    model, opt = model_and_optimizer(0, steps=0)
    joiner = Joiner(model, opt, "tok", torch.device("cpu"), None, need_from=5, sources=[a.url, b.url],
                    timeout_s=20.0, max_record_bytes=1 << 30)
    try:
        for step in (5, 6):
            record(joiner, model, opt, step)
        a.publish_snapshot(snapshot(5, peer, peer_opt))
        b.publish_snapshot(snapshot(6, peer, peer_opt))
        deadline = time.monotonic() + 10
        while not joiner._want_newer:  # the quorum request says so from the next commit on
            assert time.monotonic() < deadline and joiner.fetched == []
            time.sleep(0.02)
        record(joiner, model, opt, 7)
        assert joiner.need_from == 8  # what the coordinator passes to the sources as snapshot_from
        both = snapshot(8, peer, peer_opt)
        a.publish_snapshot(both)
        b.publish_snapshot(both)
        wait_ready(joiner, 8)
        joiner.take()
    finally:
        joiner.close()
    assert [f[0] for f in joiner.fetched] == [8] and joiner.sources.dropped == {}
    assert equal_state(model, opt, peer, peer_opt)


def fingerprint(params: list[torch.Tensor]) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in params)


def test_a_snapshot_the_verification_refuses_is_not_used_and_its_source_is_dropped(servers, monkeypatch):
    """A liar and an honest source serve step 5, the liar a well-formed snapshot of zeros. The
    joiner verifies what it builds against the committed parameters of that step (as the
    coordinator's fingerprint would): the zeros fail, their source is dropped, and the
    joiner builds from the honest one."""
    monkeypatch.setattr(sources_module, "UNDECIDED_WAIT_S", 0.3)
    peer, peer_opt = model_and_optimizer(1, steps=2)
    committed = {5: fingerprint(list(peer.parameters()))}
    verified: list[tuple[int, bool]] = []

    def verify(manifest: transfer.SnapshotManifest, shadow: Shadow, serving: int, others: int) -> SnapshotUse:
        ok = committed.get(manifest.step) == fingerprint(shadow.params)
        verified.append((manifest.step, ok))
        return SnapshotUse.USE if ok else SnapshotUse.REFUSE

    liar, source = servers(2)
    liar.publish_snapshot(snapshot(5, peer, peer_opt, torch.zeros_like))
    source.publish_snapshot(snapshot(5, peer, peer_opt))
    model, opt = model_and_optimizer(0, steps=0)
    joiner = Joiner(model, opt, "tok", torch.device("cpu"), None, need_from=5, sources=[liar.url, source.url],
                    timeout_s=20.0, max_record_bytes=1 << 30, verify=verify)
    try:
        grads = record(joiner, model, opt, 5)
        wait_ready(joiner, 6)
        joiner.take()
    finally:
        joiner.close()
    # Tied, the liar is tried first (the first asked); refused, the honest one is the majority.
    assert verified == [(5, False), (5, True)]
    assert list(joiner.sources.dropped) == [liar.url]
    stepped(peer, peer_opt, grads)
    assert equal_state(model, opt, peer, peer_opt)


def test_a_snapshot_that_fails_the_verification_is_never_replayed_on(servers):
    """A single source: nothing to compare with, so the verification is the only check; one
    that always fails leaves the joiner without a shadow until it gives up."""
    peer, peer_opt = model_and_optimizer(1, steps=2)
    (source,) = servers(1)
    source.publish_snapshot(snapshot(5, peer, peer_opt))
    model, opt = model_and_optimizer(0, steps=0)
    joiner = Joiner(model, opt, "tok", torch.device("cpu"), None, need_from=5, sources=[source.url],
                    timeout_s=2.0, max_record_bytes=1 << 30, verify=lambda m, s, serving, others: SnapshotUse.REFUSE)
    try:
        record(joiner, model, opt, 5)
        deadline = time.monotonic() + 15
        while joiner.error is None:
            assert not joiner.ready_at(6) and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        joiner.close()
    assert len(joiner.fetched) == 1 and source.url in joiner.sources.dropped
    assert "majority" in joiner.error
    assert all(p.abs().sum() > 0 for p in model.parameters())  # its own, untouched
