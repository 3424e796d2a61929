"""Pure rules of the checkpoint layout: names, partition, retention, manifest, structure."""

from __future__ import annotations

from typing import Any

import pytest

from transom.checkpoint import layout, structure


def test_step_dirs_sort_by_step_and_parse_back():
    names = [layout.step_dir(s) for s in (5, 40, 300)]
    assert names == sorted(names) and names[0] == "step-000000000005"
    assert [layout.parse_step_dir(n) for n in names] == [5, 40, 300]
    assert layout.parse_step_dir("step-5") is None and layout.parse_step_dir("s3://b/x/step-000000000007/") == 7
    with pytest.raises(ValueError):
        layout.step_dir(-1)


def test_partition_balances_bytes_and_is_deterministic():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 0}
    parts = layout.partition(sizes, 2)
    load = [sum(s for k, s in sizes.items() if parts[k] == p) for p in range(2)]
    assert sorted(load) == [110, 110] and layout.partition(dict(reversed(sizes.items())), 2) == parts
    assert set(layout.partition(sizes, 1).values()) == {0}
    assert set(layout.partition({"x": 1}, 3).values()) == {0}  # more parts than entries: some stay empty


@pytest.mark.parametrize("done, incomplete, keep, expected", [
    ([10, 20, 30], [], 2, [10]),
    ([10, 20, 30], [25, 40], 3, [25]),  # 40 may still be in flight; 25 was abandoned
    ([], [5], 2, []),  # nothing committed yet: keep every attempt
    ([30], [], 1, []),
])
def test_retention(done, incomplete, keep, expected):
    assert layout.to_delete(done, incomplete, keep) == expected


def _manifest(**changes) -> layout.Manifest:
    data = "attempt-x/part-1/__0_0.distcp"
    fields: dict[str, Any] = dict(step=3, attempt="q1/round5", num_parts=2,
                  entries=[layout.Entry(key="model/w", dtype="float32", shape=[2, 2], nbytes=16, crc32=7, part=1,
                                        file=data, offset=64, length=1600)],
                  structures=[{"model": {"w": {"__tensor__": "model/w"}}}], created=1.5,
                  files={data: layout.FileInfo(size=2000, crc32=9)})
    fields.update(changes)
    return layout.Manifest(**fields)


def test_manifest_round_trip_and_rejects_strangers():
    m = _manifest()
    assert layout.Manifest.from_json(m.to_json()) == m
    two_structures_one_shard = m.to_json().replace('"structures":[', '"structures":[{},')
    for bad in ("{}", "not json", '{"format": "transom-dcp-2"}', '{"format": "other"}', two_structures_one_shard,
                "[" * 10_000 + "]" * 10_000, m.to_json().replace('"step":3', '"step":"3"')):
        with pytest.raises(ValueError):
            layout.Manifest.from_json(bad)


@pytest.mark.parametrize("changes, why", [
    (dict(num_shards=0), "greater than or equal to 1"),
    (dict(num_parts=1), "out of range"),  # the entry is in part 1
    (dict(structures=[{"w": {"__tensor__": "model/missing"}}]), "names tensors it does not store"),
    (dict(structures=[{"w": {"__tensor__": 5}}]), "bad tensor reference"),
    (dict(files={"attempt-x/part-1/__0_0.distcp": layout.FileInfo(size=100, crc32=9)}), "are not inside"),
    (dict(files={"../secret": layout.FileInfo(size=2000, crc32=9)}), "not a path inside"),
])
def test_manifest_cross_references_are_checked(changes, why):
    with pytest.raises(ValueError, match=why):
        _manifest(**changes)


@pytest.mark.parametrize("entry, why", [
    (dict(dtype="qint8"), "unknown dtype"),
    (dict(shape=[2, 3]), "is 24 bytes, not 16"),
    (dict(shape=[-4, -1]), "invalid shape"),
    (dict(nbytes=-16), "greater than or equal to 0"),
    (dict(crc32=1 << 32), "less than 4294967296"),
])
def test_entries_must_describe_a_real_tensor(entry, why):
    fields = dict(key="w", dtype="float32", shape=[2, 2], nbytes=16, crc32=0, part=0)
    with pytest.raises(ValueError, match=why):
        layout.Entry(**{**fields, **entry})


@pytest.mark.parametrize("path, inside", [
    ("attempt-1/part-0/__0_0.distcp", True), (".metadata", True), ("../x", False), ("a/../../x", False),
    ("/etc/passwd", False), ("a b", False), ("", False),
])
def test_paths_stay_inside_the_step_directory(path, inside):
    assert layout.is_inside(path) is inside


def test_attempts_get_their_own_directories():
    assert layout.attempt_dir("q/round1") != layout.attempt_dir("q/round2")
    assert layout.data_path("q/round1", 3).startswith(layout.attempt_dir("q/round1") + "/part-3/")
    with pytest.raises(ValueError):
        layout.attempt_dir("")


class T:  # stands in for a tensor
    def __init__(self, v):
        self.v = v


def test_flatten_keeps_int_keys_tuples_and_escapes_slashes():
    state = {"model": {"fc.weight": T(1), "a/b": T(2)},
             "optimizer": {"state": {0: {"exp_avg": T(3), "step": 4}}, "param_groups": [{"betas": (0.9, 0.99)}]},
             "step": 7, "name": None}
    tensors, skeleton = structure.flatten(state, lambda x: isinstance(x, T))
    assert sorted(tensors) == ["model/a%2Fb", "model/fc.weight", "optimizer/state/0/exp_avg"]
    import json
    back = structure.unflatten(json.loads(json.dumps(skeleton)), tensors)
    assert back["optimizer"]["state"][0]["exp_avg"].v == 3
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert back["model"]["a/b"].v == 2 and back["step"] == 7 and back["name"] is None


@pytest.mark.parametrize("replica_rank,replicas,rank,world,sharded,part,num_parts", [
    (0, 1, 0, 1, False, 0, 1),
    (2, 3, 0, 1, False, 2, 3),  # one process per replica: replica k writes part k
    (1, 2, 1, 2, False, 3, 4),  # DDP: every rank of every replica writes a share of one shard
    (1, 3, 0, 2, True, 1, 6),  # FSDP2: shard 0 is split between the 3 replicas' rank 0
    (2, 3, 1, 2, True, 5, 6),
])
def test_slot_assigns_every_part_once(replica_rank, replicas, rank, world, sharded, part, num_parts):
    slot = layout.Slot.of(replica_rank, replicas, rank, world, sharded)
    assert (slot.part, slot.num_parts) == (part, num_parts)
    everyone = {layout.Slot.of(k, replicas, r, world, sharded).part for k in range(replicas) for r in range(world)}
    assert everyone == set(range(num_parts))
    with pytest.raises(ValueError):
        layout.Slot(writer=2, writers=2)


def test_sharded_tensors_keep_a_description_and_a_prefix():
    state = {"w": T(5), "plain": T(6)}
    localize = lambda t: (T(t.v * 10), {"placements": [["shard", 0]]}) if t.v == 5 else (t, None)  # noqa: E731
    tensors, skeleton = structure.flatten(state, lambda x: isinstance(x, T), localize, prefix="shard-1/")
    assert sorted(tensors) == ["shard-1/plain", "shard-1/w"] and tensors["shard-1/w"].v == 50
    back = structure.unflatten(skeleton, tensors, rebuild=lambda t, meta: ("rebuilt", t.v, meta["placements"]))
    assert back["w"] == ("rebuilt", 50, [["shard", 0]]) and back["plain"].v == 6
    assert structure.unflatten(skeleton, tensors)["w"].v == 50  # no rebuild: the local part


def test_keys_that_would_collide_are_refused():
    # {1: a, "1": b} would store both tensors under one key and silently lose one.
    with pytest.raises(TypeError, match="two entries map to the checkpoint key"):
        structure.flatten({"state": {1: T(1), "1": T(2)}}, lambda x: isinstance(x, T))


def test_tensor_keys_checks_a_skeleton_read_back():
    _, skeleton = structure.flatten({"a": [T(1), (T(2), {3: T(3)})], "b": None}, lambda x: isinstance(x, T))
    assert structure.tensor_keys(skeleton) == ["a/0", "a/1/0", "a/1/1/3"]
    for bad in ([{"__tensor__": "x"}, {"__tensor__": "x"}], {"__dict__": "nope"}, {"__tuple__": 3},
                {"__tensor__": "x", "other": 1}, json_nested(100)):
        with pytest.raises(ValueError):
            structure.tensor_keys(bad)


def json_nested(depth: int):
    node: list = []
    for _ in range(depth):
        node = [node]
    return node


def test_flatten_names_what_it_cannot_store():
    with pytest.raises(TypeError, match="data/sampler: cannot checkpoint a set"):
        structure.flatten({"data": {"sampler": {1, 2}}}, lambda x: False)


def test_files_read_in_ranges_on_several_streams_are_whole_and_checksummed_on_arrival(tmp_path, monkeypatch):
    import random
    import zlib

    from transom.checkpoint import storage as storage_module

    monkeypatch.setattr(storage_module, "READ_PART_BYTES", 1000)  # many ranges, finishing out of order
    rng = random.Random(7)
    files = {"step-1/a.distcp": rng.randbytes(10_500), "step-1/b.distcp": rng.randbytes(999), "step-1/c": b""}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(data)
    store = storage_module.Storage(str(tmp_path))
    got = store.read_files({k: len(v) for k, v in files.items()}, streams=4)
    assert {k: (bytes(b), c) for k, (b, c) in got.items()} == {k: (v, zlib.crc32(v)) for k, v in files.items()}
    assert store.read_files({"step-1/b.distcp": 999}, checksums=False)["step-1/b.distcp"][1] is None
    with pytest.raises(ValueError, match="does not hold"):
        store.read_files({"step-1/b.distcp": 1200}, streams=2)


def test_a_read_storage_never_answers_fails_the_restore_after_the_stall_timeout(tmp_path, monkeypatch):
    import threading
    import time

    from transom.checkpoint import storage as storage_module
    from transom.errors import StorageStalled

    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "a").write_bytes(b"x" * 100)
    (tmp_path / "step-1" / "stuck").write_bytes(b"y" * 100)
    release = threading.Event()
    opened = storage_module._open_regular

    def hanging_open(path):  # storage that never answers this file (a hung mount), until released
        if path.endswith("stuck"):
            release.wait(30)
        return opened(path)

    monkeypatch.setattr(storage_module, "_open_regular", hanging_open)
    store = storage_module.Storage(str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(StorageStalled, match="none of 1 reads in 1s"):
        store.read_files({"step-1/a": 100, "step-1/stuck": 100}, streams=2, stall_s=1.0)
    assert time.monotonic() - t0 < 5.0
    release.set()  # the stuck read ends, and its thread
    deadline = time.monotonic() + 5
    while any(t.name.startswith("transom-read") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name.startswith("transom-read") for t in threading.enumerate())


def test_a_blob_decodes_without_a_copy_where_it_is_aligned_and_with_one_where_not():
    import torch

    from transom.checkpoint import blob

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    data = bytearray(blob.encode(t))
    view = blob.decode(memoryview(data), "float32", [3, 4], copy=False)
    assert torch.equal(view, t)
    view.fill_(1.0)
    assert torch.equal(blob.decode(memoryview(data), "float32", [3, 4]), torch.ones(3, 4))
    shifted = bytearray(1) + bytearray(blob.encode(t))  # its data now starts at an odd address
    assert torch.equal(blob.decode(memoryview(shifted)[1:], "float32", [3, 4], copy=False), t)
    assert torch.equal(blob.decode(bytes(blob.encode(t)), "float32", [3, 4], copy=False), t)  # read-only: a copy
