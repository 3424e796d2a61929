"""Checkpoint manifests from storage and state from peers, fuzzed: data, never a crash.

A real checkpoint is written once; each example replaces one value anywhere in its
manifest (or the whole manifest) with arbitrary JSON, and restoring that step must either
give the state or raise CorruptCheckpoint (IncompatibleCheckpoint for a sharding that does
not fit): never another exception, which would crash a restore instead of falling back.
The same for the bytes a recovering replica gets from a peer (wire.decode: WireError).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import JSON
from transom.checkpoint import layout
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine
from transom.checkpoint.restore import CorruptCheckpoint, IncompatibleCheckpoint, load_step
from transom.checkpoint.storage import Storage
from transom.ft import wire

STATE = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)},
         "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
         "step": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Storage, str]:
    root = tmp_path_factory.mktemp("ckpt")
    engine = CheckpointEngine(CheckpointConfig(uri=str(root)))
    assert engine.save(3, STATE)
    engine.wait_snapshot()
    assert engine.wait_persisted(60)
    engine.close()
    storage = Storage(str(root))
    return storage, storage.read_text(layout.step_dir(3), layout.MANIFEST)


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths(v, (*prefix, i))
    return out


def replaced(node: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    copy = list(node) if isinstance(node, list) else dict(node)
    copy[path[0]] = replaced(node[path[0]], path[1:], value)
    return copy


def restore_outcome(storage: Storage, text: str) -> str:
    (storage.fs.open(storage.path(layout.step_dir(3), layout.MANIFEST), "w")).write(text)
    try:
        load_step(storage, 3)
        return "loaded"
    except (CorruptCheckpoint, IncompatibleCheckpoint):
        return "refused"


@given(data=st.data())
def test_a_manifest_with_any_value_replaced_restores_or_is_refused(checkpoint, data):
    storage, original = checkpoint
    manifest = json.loads(original)
    path = data.draw(st.sampled_from(paths(manifest)))
    value = data.draw(JSON)
    restore_outcome(storage, json.dumps(replaced(manifest, path, value)))  # raises anything else


@given(text=st.text(max_size=200) | JSON.map(json.dumps))
def test_any_text_as_a_manifest_is_refused(checkpoint, text):
    storage, _ = checkpoint
    assert restore_outcome(storage, text) == "refused"


def test_the_untouched_manifest_still_restores(checkpoint):
    storage, original = checkpoint
    assert restore_outcome(storage, original) == "loaded"


@given(data=st.data())
def test_peer_state_with_any_byte_changed_decodes_or_is_refused(data):
    payload = bytearray(wire.encode(STATE))
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.none() | st.integers(0, len(payload)))
    try:
        wire.decode(bytes(payload[:cut] if cut is not None else payload))
    except wire.WireError:
        pass


@given(blob=st.binary(max_size=2048))
def test_arbitrary_bytes_from_a_peer_are_refused(blob):
    with pytest.raises(wire.WireError):
        wire.decode(wire.MAGIC + blob)
