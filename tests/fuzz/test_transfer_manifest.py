"""The snapshot manifest a joiner reads from a source, fuzzed: a dropped source, never a crash,
never an allocation its own state does not imply.

A real state server on loopback serves each example as its `/snapshot`; the joiner's side
(ft/sources.py `Sources.offer`, as its search calls it) reads it with its own 1 KB model and
a fresh optimizer (no state yet, so the rule for optimizer state it lacks is exercised
too). Each example replaces one value anywhere in an honest manifest (or the whole of it)
with arbitrary JSON or a huge number, or describes arbitrary tensors in a manifest that is
consistent in itself. The outcome must be the snapshot taken, the source dropped, or the
snapshot left for later (an older step); no other exception; a manifest taken claims no
more than the joiner's own state implies; and the peak of what Python allocated while
reading it stays far below what the manifest claims (tracemalloc; it sees the bytearray a
fetch would allocate).
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from conftest import JSON
from test_storage_and_peer_input import paths, replaced
from transom.checkpoint import blob, structure
from transom.ft import transfer
from transom.ft.expected import ExpectedState
from transom.ft.sources import Sources
from transom.ft.state_server import StateServer

STEP = 5
PEAK_LIMIT = 8 << 20  # the manifests below claim up to 16 TiB
HUGE = st.sampled_from([2**31, 2**32 + 1, 2**44, 2**44 + 1, 2**53 + 1, 2**62, 2**63, 2**64, 2**70, -(2**63), -1,
                        [2**31] * 3, [2**20] * 64, [1] * 65, "complex128", "float64", "bool", "uint8", "object",
                        json.loads("[" * 80 + "]" * 80), {"__tensor__": "model/0.weight"}, 1e308, float("inf")])


def model_and_optimizer(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


@pytest.fixture(scope="module")
def world():
    """(the state server, the honest snapshot it serves bytes of, the joiner's expectation)."""
    peer, peer_opt = model_and_optimizer(steps=2)
    tensors, skeleton = structure.flatten({"step": STEP, "model": peer.state_dict(),
                                           "optimizer": peer_opt.state_dict()}, torch.is_tensor)
    honest = transfer.publish(STEP, {k: v.detach().clone() for k, v in tensors.items()}, skeleton, chunk_bytes=512)
    expected = ExpectedState.of(*model_and_optimizer(steps=0))
    server = StateServer("tok")
    yield server, honest, expected
    server.close()


def outcome(world, body: bytes) -> str:
    """What the joiner makes of a source that serves `body` as its manifest."""
    server, honest, expected = world
    server.publish_snapshot(transfer.Published(honest.manifest, body, honest.views))
    sources = Sources(lambda: [server.url], "tok", 5.0, expected)
    tracemalloc.start()
    try:
        got = sources.offer(server.url, lambda: (STEP, STEP))
        if got is not None:
            bytearray(got[0].total_bytes)  # what the fetch would allocate next
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"{peak} bytes allocated reading a manifest of {len(body)}"
    if got is not None:
        assert got[0].total_bytes <= expected.max_total_bytes
        return "taken"
    return "dropped" if server.url in sources.dropped else "later"


def test_the_honest_manifest_is_taken_and_its_bounds_are_the_models(world):
    _, honest, expected = world
    assert outcome(world, honest.manifest_json) == "taken"
    # 178 parameters and Adam's state for them (twice the parameters, and 4 step counters).
    assert honest.manifest.total_bytes <= expected.max_total_bytes < 16 << 10
    assert len(honest.manifest_json) <= expected.max_manifest_bytes < 256 << 10


@given(data=st.data())
def test_a_manifest_with_any_value_replaced_is_taken_or_its_source_dropped(world, data):
    _, honest, _ = world
    manifest = json.loads(honest.manifest_json)
    path = data.draw(st.sampled_from(paths(manifest)))
    value = data.draw(JSON | HUGE)
    outcome(world, json.dumps(replaced(manifest, path, value)).encode())  # raises anything else


@given(text=st.text(max_size=200) | JSON.map(json.dumps) | st.binary(max_size=200).map(bytes.hex))
def test_any_text_as_a_manifest_drops_its_source(world, text):
    assert outcome(world, text.encode()) == "dropped"


KEYS = st.sampled_from(["model/0.weight", "model/0.bias", "model/2.weight", "optimizer/state/0/exp_avg",
                        "optimizer/state/0/step", "optimizer/state/3/exp_avg_sq", "optimizer/state/4/exp_avg",
                        "optimizer/state/00/step", "model/extra", "rng/torch"]) | st.text(min_size=1, max_size=20)
SHAPES = st.lists(st.integers(0, 2**40) | st.sampled_from([0, 1, 2, 8, 16]), max_size=4)


@given(specs=st.dictionaries(KEYS, st.tuples(st.sampled_from(sorted(blob.DTYPES)), SHAPES), min_size=1, max_size=12),
       step=st.integers(0, 2**40), keep_model=st.booleans())
def test_a_consistent_manifest_of_other_tensors_drops_its_source_before_anything_is_allocated(world, specs, step,
                                                                                              keep_model):
    """Offsets, total and digests agree (the schema takes it): only the joiner's own state
    can tell it is not a snapshot of this model; whatever it claims, up to 16 TiB."""
    _, honest, _ = world
    if keep_model:  # the honest tensors, with some of them replaced or added
        specs = {**{e.key: (e.dtype, e.shape) for e in honest.manifest.entries}, **specs}
    entries, offset = [], 0
    for key, (dtype, shape) in specs.items():
        offset = -(-offset // transfer.ALIGN) * transfer.ALIGN
        entries.append({"key": key, "dtype": dtype, "shape": shape, "offset": offset})
        offset += blob.nbytes_of(dtype, shape)
    assume(offset <= 1 << 44)
    body = {"step": step, "chunk_bytes": 1 << 30, "total_bytes": offset, "entries": entries,
            "skeleton": honest.manifest.skeleton if keep_model else None, "digests": [0] * -(-offset // (1 << 30))}
    got = outcome(world, json.dumps(body).encode())
    if offset > 16 << 10:
        assert got != "taken"
