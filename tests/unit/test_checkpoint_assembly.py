"""Joining a sharded checkpoint's parts into whole tensors (checkpoint/assemble.py), and what
an export keeps of a state (checkpoint/export.py: select, strip, plain), on hand-made parts."""

from __future__ import annotations

import pytest
import torch

from transom.checkpoint import export
from transom.checkpoint.assemble import Part, chunk_length, merge
from transom.errors import CorruptCheckpoint, IncompatibleCheckpoint


def shard_parts(full: torch.Tensor, ranks: int, dim: int = 0) -> list[Part]:
    """What `ranks` FSDP2 ranks store of `full` placed Shard(dim): torch.chunk's cut, empty after."""
    meta = {"placements": [["shard", dim]], "shape": list(full.shape), "stride": list(full.stride())}
    starts = [sum(chunk_length(full.shape[dim], ranks, r) for r in range(k)) for k in range(ranks)]
    return [Part(full.narrow(dim, s, chunk_length(full.shape[dim], ranks, k)).clone(), meta)
            for k, s in enumerate(starts)]


@pytest.mark.parametrize("n, ranks, lengths", [(8, 2, [4, 4]), (5, 4, [2, 2, 1, 0]), (1, 3, [1, 0, 0]), (0, 2, [0, 0])])
def test_chunk_length_is_torch_chunk_s_cut(n, ranks, lengths):
    assert [chunk_length(n, ranks, r) for r in range(ranks)] == lengths
    chunks = [len(c) for c in torch.arange(n).chunk(ranks)]  # fewer than `ranks` when n is small
    assert chunks + [0] * (ranks - len(chunks)) == lengths


@pytest.mark.parametrize("shape, dim, ranks", [((5, 3), 0, 4), ((4, 7), 1, 2), ((6,), 0, 3), ((2, 3), 0, 4)])
def test_sharded_parts_join_into_the_whole_tensor_bit_for_bit(shape, dim, ranks):
    full = torch.randn(shape)
    full.view(-1)[0] = float("nan")
    parts = shard_parts(full, ranks, dim)
    shards = [{"model": {"w": p, "b": torch.ones(2)}, "step": 7} for p in parts]
    out = merge(shards)
    assert out["step"] == 7 and torch.equal(out["model"]["b"], torch.ones(2))
    joined = out["model"]["w"]
    assert joined.shape == full.shape and torch.equal(joined.view(torch.int32), full.view(torch.int32))


def test_replicated_parts_are_taken_once_and_tuples_and_int_keys_survive():
    meta = {"placements": [["replicate"]], "shape": [3], "stride": [1]}
    t = torch.arange(3.0)
    shards = [{"optimizer": {"state": {0: {"step": torch.tensor(4.0), "m": Part(t.clone(), meta)}},
                             "param_groups": [{"betas": (0.9, 0.99), "params": [0]}]}} for _ in range(2)]
    out = merge(shards)
    assert torch.equal(out["optimizer"]["state"][0]["m"], t)
    assert out["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("case, error, message", [
    ("2-D mesh", IncompatibleCheckpoint, "2-dimensional device mesh"),
    ("wrong cut", IncompatibleCheckpoint, "not the \\[3, 2\\]"),
    ("differs", IncompatibleCheckpoint, "differs between ranks"),
    ("keys", IncompatibleCheckpoint, "different keys"),
    ("scalar", IncompatibleCheckpoint, "differs between ranks \\(1 on rank 0\\)"),
    ("half sharded", IncompatibleCheckpoint, "sharded on some ranks and not on others"),
    ("bad meta", CorruptCheckpoint, "malformed description"),
    ("bad dim", CorruptCheckpoint, "dimension 2 of a 2-dimensional"),
])
def test_what_cannot_be_joined_is_refused_with_the_reason(case, error, message):
    full = torch.randn(5, 2)
    parts = shard_parts(full, 2)
    meta = parts[0].meta
    shards = {
        "2-D mesh": [Part(p.local, {**meta, "placements": [["shard", 0], ["replicate"]]}) for p in parts],
        "wrong cut": [Part(full[:2], meta), Part(full[2:], meta)],
        "differs": [torch.zeros(2), torch.ones(2)],
        "keys": [{"a": 1}, {"b": 1}],
        "scalar": [1, 2],
        "half sharded": [parts[0], parts[1].local],
        "bad meta": [Part(p.local, {"placements": "shard", "shape": [5, 2]}) for p in parts],
        "bad dim": [Part(p.local, {**meta, "placements": [["shard", 2]]}) for p in parts],
    }[case]
    with pytest.raises(error, match=message):
        merge([{"model": {"w": s}} for s in shards])


def test_strip_takes_prefixes_off_in_order_and_refuses_a_collision(caplog):
    model = {"_orig_mod.module.fc.weight": 1, "_orig_mod.module.fc.bias": 2}
    assert export.strip(model, ["_orig_mod.", "module."]) == {"fc.weight": 1, "fc.bias": 2}
    assert export.strip(model, []) == model
    export.strip(model, ["module."])  # not at the front: nothing stripped, and a warning says so
    assert "no name in the model's state dict starts with 'module.'" in caplog.text
    with pytest.raises(IncompatibleCheckpoint, match="names two entries 'w'"):
        export.strip({"module.w": 1, "w": 2}, ["module."])


def test_select_keeps_the_model_alone_or_with_the_optimizer_and_the_step():
    state = {"model": {"w": torch.ones(1)}, "optimizer": {"state": {}, "param_groups": []}, "step": 3, "rng": {}}
    assert export.select(state, 9, False) == {"model": state["model"]}
    assert export.select(state, 9, True) == {"model": state["model"], "optimizer": state["optimizer"], "step": 9}
    with pytest.raises(IncompatibleCheckpoint, match="holds no model state dict"):
        export.select({"weights": {}}, 9, False)
    with pytest.raises(IncompatibleCheckpoint, match="holds no optimizer state dict"):
        export.select({"model": {}}, 9, True)


def test_plain_gives_a_view_memory_of_its_own_so_torch_save_writes_only_its_bytes(tmp_path):
    buffer = torch.zeros(1 << 16)
    view = buffer[100:104]
    out = export.plain({"model": {"w": view, "whole": buffer}, "t": (view,)})
    assert out["model"]["w"].untyped_storage().nbytes() == 16 and torch.equal(out["model"]["w"], view)
    assert out["model"]["whole"] is buffer and isinstance(out["t"], tuple)
    torch.save(out["model"]["w"], tmp_path / "w.pt")
    assert (tmp_path / "w.pt").stat().st_size < 4096


def test_an_unwritable_destination_fails_before_anything_is_read_and_leaves_nothing(tmp_path):
    (tmp_path / "file").write_text("x")
    for dest in (tmp_path / "missing" / "model.pt", tmp_path / "file" / "model.pt", tmp_path):
        with pytest.raises(OSError, match="cannot write"):
            with export.destination(dest):
                raise AssertionError("never reached")
    with pytest.raises(RuntimeError):
        with export.destination(tmp_path / "model.pt") as f:
            f.write(b"half")
            raise RuntimeError("the read failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
