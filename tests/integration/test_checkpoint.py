"""The checkpoint engine against a real local file system and real torch state.

Round trip bit-identical (model, Adam state, RNG, step), two replicas writing one part
each, a step whose part never arrives (no manifest), corrupted and truncated shards
(skipped, the previous checkpoint restored), a writer SIGKILLed mid-persist, retention,
the skip policy while a persist is in flight, and DCP's own `dcp.load` reading a Transom
checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from transom.checkpoint import layout, persist
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine
from transom.checkpoint.restore import NoCheckpoint, load_latest

pytestmark = pytest.mark.timeout(120)


def make_state(seed: int = 0, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, width)).pow(2).mean().backward()
        opt.step()
    return model, opt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3,
                        "rng": torch.get_rng_state(), "data": {"epoch": 1, "offset": 4096}}


def save(engine: CheckpointEngine, step: int, state: dict, **kw) -> None:
    assert engine.save(step, state, **kw)
    engine.wait_snapshot()
    assert engine.wait_persisted(60)


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_round_trip_is_bit_identical_and_loads_into_fresh_objects(tmp_path):
    model, opt, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path)))
    save(engine, 3, state)
    engine.close()
    restored = load_latest(str(tmp_path))
    assert restored.step == 3 and restored.skipped == []
    assert_same(state, restored.state)
    model2, opt2, _ = make_state(seed=1)
    model2.load_state_dict(restored.state["model"])
    opt2.load_state_dict(restored.state["optimizer"])
    x = torch.randn(4, 64)
    assert torch.equal(model(x), model2(x))


def test_dcp_reads_a_transom_checkpoint(tmp_path):
    model, _, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=f"file://{tmp_path}"))
    save(engine, 7, state)
    engine.close()
    target = {f"model/{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(target, checkpoint_id=str(tmp_path / layout.step_dir(7)), no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(target[f"model/{k}"], v)


def test_two_replicas_each_write_a_part_and_one_commits(tmp_path):
    _, _, state = make_state()
    commits = []
    engines = [CheckpointEngine(CheckpointConfig(uri=str(tmp_path)), on_commit=lambda s, u: commits.append((s, u)))
               for _ in range(2)]
    for k, e in enumerate(engines):
        assert e.save(10, state, layout.Slot(writer=k, writers=2))
    for e in engines:
        assert e.wait_persisted(60)
        e.close()
    step_dir = tmp_path / layout.step_dir(10)
    for k in range(2):
        assert (step_dir / layout.part_dir(k) / "__0_0.distcp").stat().st_size > 0
    manifest = layout.Manifest.from_json((step_dir / layout.MANIFEST).read_text())
    assert {e.part for e in manifest.entries} == {0, 1} and manifest.num_parts == 2
    assert commits == [(10, f"{tmp_path}/{layout.step_dir(10)}")]
    assert_same(state, load_latest(str(tmp_path)).state)


def test_a_missing_part_never_commits_and_a_due_checkpoint_is_skipped_meanwhile(tmp_path):
    _, _, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), commit_timeout_s=1.5))
    assert engine.save(10, state, layout.Slot(writer=0, writers=2))  # part 1's writer never shows up
    engine.wait_snapshot()
    assert not engine.save(11, state) and engine.skipped == 1  # still persisting step 10
    assert engine.wait_persisted(30)
    engine.close()
    assert engine.failed == 1 and engine.committed_step is None
    assert (tmp_path / layout.step_dir(10) / "part-0" / layout.PART_DONE).exists()
    assert not (tmp_path / layout.step_dir(10) / layout.MANIFEST).exists()
    with pytest.raises(NoCheckpoint):
        load_latest(str(tmp_path))


def test_a_writer_that_skips_releases_the_committer_at_once(tmp_path):
    _, _, state = make_state()
    committer = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), commit_timeout_s=120))
    busy = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), commit_timeout_s=2))
    # `busy` commits step 5 and waits (2 s) for a partner that never comes: it is persisting.
    assert busy.save(5, state, layout.Slot(writer=0, writers=2))
    assert committer.save(10, state, layout.Slot(writer=0, writers=2))
    assert not busy.save(10, state, layout.Slot(writer=1, writers=2))  # skipped: leaves a marker when free
    t0 = time.monotonic()
    assert committer.wait_persisted(60)
    waited = time.monotonic() - t0
    for e in (committer, busy):
        e.close()
    assert (tmp_path / layout.step_dir(10) / "part-1" / layout.PART_SKIPPED).exists()
    assert not (tmp_path / layout.step_dir(10) / layout.MANIFEST).exists()
    assert committer.failed == 1 and waited < 30, f"the committer waited {waited:.1f}s instead of giving up"


def _newest_shard(root: Path, step: int) -> Path:
    return root / layout.step_dir(step) / "part-0" / "__0_0.distcp"


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_shard_is_detected_and_the_previous_checkpoint_restored(tmp_path, damage):
    _, _, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), keep=3))
    save(engine, 10, state)
    newer = dict(state, step=20, data={"epoch": 2, "offset": 0})
    save(engine, 20, newer)
    engine.close()
    shard = _newest_shard(tmp_path, 20)
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    else:
        data = data[: len(data) - 100]
    shard.write_bytes(bytes(data))
    restored = load_latest(str(tmp_path))
    assert restored.step == 10 and [s for s, _ in restored.skipped] == [20]
    assert ("bytes on storage" in restored.skipped[0][1]) is (damage == "truncate")
    assert_same(state, restored.state)


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    _, _, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), keep=2))
    for step in (1, 2, 3, 4):
        save(engine, step, dict(state, step=step))
    engine.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [layout.step_dir(3), layout.step_dir(4)]


def test_storage_errors_are_retried_until_they_pass(tmp_path, monkeypatch):
    _, _, state = make_state()
    real, calls = persist.write_part, []

    def flaky(*args, **kwargs):
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise ConnectionError("storage unreachable")
        return real(*args, **kwargs)

    monkeypatch.setattr("transom.checkpoint.engine.write_part", flaky)
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), retry_first_s=0.05, retry_max_s=0.1))
    save(engine, 5, state)
    engine.close()
    assert len(calls) == 3 and engine.committed_step == 5 and engine.failed == 0
    assert load_latest(str(tmp_path)).step == 5


WRITER = r'''
import sys, torch
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine
root = sys.argv[1]
engine = CheckpointEngine(CheckpointConfig(uri=root))
small = {"w": torch.ones(10), "step": 10}
engine.save(10, small); engine.wait_snapshot(); engine.wait_persisted(60)
print("committed 10", flush=True)
big = {"w%d" % i: torch.randn(4 * 1024 * 1024) for i in range(24)}  # 384 MiB, several seconds to write
big["step"] = 20
engine.save(20, big); engine.wait_snapshot()
print("persisting 20", flush=True)
engine.wait_persisted(600)
print("committed 20", flush=True)
'''


def test_writer_killed_mid_persist_leaves_no_manifest(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "committed 10"
        assert proc.stdout.readline().strip() == "persisting 20"
        part = tmp_path / layout.step_dir(20) / "part-0"
        deadline = time.monotonic() + 60
        while not (part.exists() and any(part.iterdir())):  # bytes are being written
            assert time.monotonic() < deadline and proc.poll() is None, "the persist never started"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (tmp_path / layout.step_dir(20) / layout.MANIFEST).exists()
    restored = load_latest(str(tmp_path))
    assert restored.step == 10 and restored.state["step"] == 10 and torch.equal(restored.state["w"], torch.ones(10))
