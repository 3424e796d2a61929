"""The checkpoint engine against a real local file system and real torch state.

Round trip bit-identical (model, Adam state, RNG, step), two replicas writing one part
each, a step whose part never arrives (no manifest), a part left by another attempt at the
same step (never mixed in), corrupted and truncated shards and hostile files (skipped, the
previous checkpoint restored, nothing unpickled, a FIFO in a file's place never waited on),
a writer SIGKILLed mid-persist, retention, the skip policy while a persist is in flight,
and DCP's own `dcp.load` reading a Transom checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from transom import compat
from transom.checkpoint import layout, persist
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine
from transom.checkpoint.restore import NoCheckpoint, load_latest
from transom.checkpoint.storage import Storage

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


def assert_same(a, b, ordered: bool = False) -> None:
    """Equal, tensor for tensor (dtype, shape and bits); `ordered`: dicts' keys in the same order too."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b) if ordered else a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k], ordered)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, ordered)
    else:
        assert a == b


@pytest.mark.compat
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


@pytest.mark.compat
def test_dcp_reads_a_transom_checkpoint(tmp_path):
    model, _, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=f"file://{tmp_path}"))
    save(engine, 7, state)
    engine.close()
    target = {f"model/{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    compat.dcp_load(target, str(tmp_path / layout.step_dir(7)))
    for k, v in model.state_dict().items():
        assert torch.equal(target[f"model/{k}"], v)


def test_two_replicas_each_write_a_part_and_one_commits(tmp_path):
    _, _, state = make_state()
    commits = []
    engines = [CheckpointEngine(CheckpointConfig(uri=str(tmp_path)), on_commit=lambda s, u: commits.append((s, u)))
               for _ in range(2)]
    for k, e in enumerate(engines):
        assert e.save(10, state, layout.Slot(writer=k, writers=2), attempt="round-7")
    for e in engines:
        assert e.wait_persisted(60)
        e.close()
    step_dir = tmp_path / layout.step_dir(10)
    for k in range(2):
        assert (step_dir / layout.data_path("round-7", k)).stat().st_size > 0
    manifest = layout.Manifest.from_json((step_dir / layout.MANIFEST).read_text())
    assert {e.part for e in manifest.entries} == {0, 1} and manifest.num_parts == 2
    assert commits == [(10, f"{tmp_path}/{layout.step_dir(10)}")]
    assert_same(state, load_latest(str(tmp_path)).state)


def test_writers_whose_states_differ_never_commit_one_checkpoint(tmp_path):
    # Two replicas write the parts of step 10, each with the fingerprint of the state it
    # holds: equal, the step commits; different (diverged replicas), no manifest is written
    # and the committer says why.
    _, _, state = make_state()
    for step, digests in ((10, (7, 7)), (20, (7, 8))):
        engines = [CheckpointEngine(CheckpointConfig(uri=str(tmp_path))) for _ in range(2)]
        for k, e in enumerate(engines):
            assert e.save(step, state, layout.Slot(writer=k, writers=2), attempt=f"round-{step}",
                          digest=torch.tensor(digests[k]))
        for e in engines:
            assert e.wait_persisted(60)
        committer = engines[0]
        for e in engines:
            e.close()
        committed = (tmp_path / layout.step_dir(step) / layout.MANIFEST).exists()
        assert committed == (digests[0] == digests[1])
    assert "checkpoint of step 20 not committed: the replicas that wrote shard 0 hold different parameters" in \
        str(committer.trouble)
    assert load_latest(str(tmp_path)).step == 10


def test_a_missing_part_never_commits_and_a_due_checkpoint_is_skipped_meanwhile(tmp_path):
    _, _, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), commit_timeout_s=1.5))
    assert engine.save(10, state, layout.Slot(writer=0, writers=2), "a")  # part 1's writer never shows up
    engine.wait_snapshot()
    assert not engine.save(11, state) and engine.skipped == 1  # still persisting step 10
    assert engine.wait_persisted(30)
    engine.close()
    assert engine.failed == 1 and engine.committed_step is None
    assert (tmp_path / layout.step_dir(10) / layout.attempt_dir("a") / "part-0" / layout.PART_DONE).exists()
    assert not (tmp_path / layout.step_dir(10) / layout.MANIFEST).exists()
    with pytest.raises(NoCheckpoint):
        load_latest(str(tmp_path))


def test_a_writer_that_skips_releases_the_committer_at_once(tmp_path):
    _, _, state = make_state()
    committer = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), commit_timeout_s=120))
    busy = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), commit_timeout_s=2))
    # `busy` commits step 5 and waits (2 s) for a partner that never comes: it is persisting.
    assert busy.save(5, state, layout.Slot(writer=0, writers=2), "a5")
    assert committer.save(10, state, layout.Slot(writer=0, writers=2), "a10")
    assert not busy.save(10, state, layout.Slot(writer=1, writers=2), "a10")  # skipped: leaves a marker when free
    t0 = time.monotonic()
    assert committer.wait_persisted(60)
    waited = time.monotonic() - t0
    for e in (committer, busy):
        e.close()
    assert (tmp_path / layout.step_dir(10) / layout.attempt_dir("a10") / "part-1" / layout.PART_SKIPPED).exists()
    assert not (tmp_path / layout.step_dir(10) / layout.MANIFEST).exists()
    assert committer.failed == 1 and waited < 30, f"the committer waited {waited:.1f}s instead of giving up"


def _newest_shard(root: Path, step: int) -> Path:
    (path,) = (root / layout.step_dir(step)).glob(f"attempt-*/part-0/{layout.DATA_FILE}")
    return path


def test_a_part_left_by_another_attempt_is_never_mixed_in(tmp_path):
    # A crashed run left part 1 of step 10; the run that resumed reaches step 10 again with
    # other weights. Its committer must take only its own attempt's parts.
    _, _, state_a = make_state(seed=1)
    _, _, state_b = make_state(seed=2)
    crashed = CheckpointEngine(CheckpointConfig(uri=str(tmp_path)))
    assert crashed.save(10, state_a, layout.Slot(writer=1, writers=2), attempt="run-a/round-9")
    assert crashed.wait_persisted(60)
    crashed.close()
    alone = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), commit_timeout_s=1.5))
    save(alone, 10, state_b, slot=layout.Slot(writer=0, writers=2), attempt="run-b/round-4")
    alone.close()
    assert alone.committed_step is None and not (tmp_path / layout.step_dir(10) / layout.MANIFEST).exists()

    engines = [CheckpointEngine(CheckpointConfig(uri=str(tmp_path))) for _ in range(2)]
    for k, e in enumerate(engines):
        assert e.save(10, state_b, layout.Slot(writer=k, writers=2), attempt="run-b/round-5")
    for e in engines:
        assert e.wait_persisted(60)
        e.close()
    restored = load_latest(str(tmp_path))
    assert restored.step == 10
    assert_same(state_b, restored.state)  # every tensor from run b, none from run a
    manifest = layout.Manifest.from_json((tmp_path / layout.step_dir(10) / layout.MANIFEST).read_text())
    assert manifest.attempt == "run-b/round-5"
    assert {e.file.split("/")[0] for e in manifest.entries} == {layout.attempt_dir("run-b/round-5")}


def _steps_10_and_20(tmp_path) -> dict:
    """Commit checkpoints of steps 10 and 20 under tmp_path; the state saved at 10."""
    _, _, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), keep=3))
    save(engine, 10, state)
    save(engine, 20, dict(state, step=20))
    engine.close()
    return state


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {_RunsCode.marker}",))


@pytest.mark.parametrize("target", ["dcp-index", "data-file", "part-record"])
def test_a_pickle_planted_in_storage_never_runs(tmp_path, target):
    _steps_10_and_20(tmp_path)
    _RunsCode.marker = tmp_path / "code-ran"
    step_dir = tmp_path / layout.step_dir(20)
    path = {"dcp-index": step_dir / layout.DCP_METADATA, "data-file": _newest_shard(tmp_path, 20),
            "part-record": _newest_shard(tmp_path, 20).parent / layout.PART_DONE}[target]
    with open(path, "wb") as f:
        pickle.dump(_RunsCode(), f)
    restored = load_latest(str(tmp_path))
    assert not _RunsCode.marker.exists(), "restore ran code from storage"
    # Transom never reads DCP's index; a planted data file fails its checksum: the older one is used.
    assert restored.step == (20 if target in ("dcp-index", "part-record") else 10)


def _break(manifest: dict, case: str) -> dict:
    entry = manifest["entries"][0]
    if case == "unknown-dtype":
        entry["dtype"] = "qint4"
    elif case == "huge-shape":
        entry["shape"], entry["nbytes"] = [10**8, 10**8, 10**4], 4 * 10**20
    elif case == "negative-shape":
        entry["shape"] = [-1] + entry["shape"][1:]
    elif case == "skeleton-names-a-missing-key":
        manifest["structures"][0]["model"]["extra"] = {"__tensor__": "model/nowhere"}
    elif case == "no-shards":
        manifest["num_shards"] = 0
    elif case == "offset-past-the-file":
        entry["offset"] = 10**12
    elif case == "path-outside":
        manifest["files"]["../../etc/passwd"] = manifest["files"].pop(entry["file"])
        for e in manifest["entries"]:
            e["file"] = "../../etc/passwd"
    elif case == "another-step":
        manifest["step"] = 10
    elif case == "deep-skeleton":
        manifest["structures"][0]["deep"] = json.loads("[" * 500 + "]" * 500)
    return manifest


@pytest.mark.parametrize("case", ["unknown-dtype", "huge-shape", "negative-shape", "skeleton-names-a-missing-key",
                                  "no-shards", "offset-past-the-file", "path-outside", "another-step",
                                  "deep-skeleton", "not-json"])
def test_a_bad_manifest_is_a_bad_checkpoint_not_a_crash(tmp_path, case):
    state = _steps_10_and_20(tmp_path)
    path = tmp_path / layout.step_dir(20) / layout.MANIFEST
    path.write_text("{not json" if case == "not-json" else json.dumps(_break(json.loads(path.read_text()), case)))
    restored = load_latest(str(tmp_path))
    assert restored.step == 10 and [s for s, _ in restored.skipped] == [20]
    assert_same(state, restored.state)


@pytest.mark.timeout(20)  # before reads refused FIFOs, opening the manifest waited forever for a writer
@pytest.mark.parametrize("fifos", [("manifest",), ("data",), ("manifest", "data")], ids="+".join)
def test_a_fifo_in_place_of_a_file_is_a_bad_checkpoint_not_a_hang(tmp_path, fifos):
    state = _steps_10_and_20(tmp_path)
    paths = {"manifest": tmp_path / layout.step_dir(20) / layout.MANIFEST, "data": _newest_shard(tmp_path, 20)}
    for name in fifos:
        paths[name].unlink()
        os.mkfifo(paths[name])
    start = time.monotonic()
    restored = load_latest(str(tmp_path))
    assert restored.step == 10 and [s for s, _ in restored.skipped] == [20]
    assert "not a regular file" in restored.skipped[0][1]
    assert time.monotonic() - start < 5
    assert_same(state, restored.state)


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
    assert ("bytes on storage" if damage == "truncate" else "CRC-32") in restored.skipped[0][1]
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
    real, calls, trouble = persist.write_part, [], []

    def flaky(*args, **kwargs):
        calls.append(time.monotonic())
        trouble.append(engine.trouble)  # what the replica's heartbeats would say now
        if len(calls) <= 2:
            raise ConnectionError("storage unreachable")
        return real(*args, **kwargs)

    monkeypatch.setattr("transom.checkpoint.engine.write_part", flaky)
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), retry_first_s=0.05, retry_max_s=0.1))
    save(engine, 5, state)
    engine.close()
    assert len(calls) == 3 and engine.committed_step == 5 and engine.failed == 0
    assert load_latest(str(tmp_path)).step == 5
    failing = "writing part 0 of step 5: ConnectionError"  # the type, never the error's text
    assert trouble == [None, failing, failing] and engine.trouble is None


def test_a_failed_prune_neither_holds_the_report_nor_the_next_checkpoint(tmp_path, monkeypatch):
    # Pruning was retried until storage came back, after the commit and before its report:
    # status kept the previous checkpoint, and checkpoints due meanwhile were skipped.
    _, _, state = make_state()
    reported: list[int] = []
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), keep=1, retry_first_s=0.05, retry_max_s=0.1),
                              on_commit=lambda step, uri: reported.append(step))
    real_remove = engine.storage.remove

    def away(path):
        raise ConnectionError("storage unreachable")

    save(engine, 5, state)
    monkeypatch.setattr(engine.storage, "remove", away)
    save(engine, 10, state)
    assert reported == [5, 10] and engine.trouble == "pruning old checkpoints: ConnectionError"
    monkeypatch.setattr(engine.storage, "remove", real_remove)
    save(engine, 15, state)
    engine.close()
    assert reported == [5, 10, 15] and engine.skipped == 0 and engine.trouble is None
    assert sorted(d.name for d in tmp_path.iterdir() if d.name.startswith("step")) == [layout.step_dir(15)]


def test_a_manifest_storage_fails_to_return_for_a_moment_is_asked_again_not_skipped(tmp_path, monkeypatch):
    # S3 answered 500 ("We encountered an internal error") for a moment after it came back:
    # the newest checkpoint counted as unusable and a reader fell back to an older one, or
    # to none.
    _, _, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path)))
    save(engine, 5, state)
    save(engine, 10, state)
    engine.close()
    real, failures = Storage.read_text, [OSError(121, "We encountered an internal error")] * 2

    def flaky(self, *parts, **kwargs):
        if parts[-1] == layout.MANIFEST and failures:
            raise failures.pop()
        return real(self, *parts, **kwargs)

    monkeypatch.setattr(Storage, "read_text", flaky)
    assert load_latest(str(tmp_path)).step == 10 and not failures
    failures.extend([FileNotFoundError(2, "gone")])  # a manifest that is not there is not waited for
    assert load_latest(str(tmp_path)).step == 5


def test_a_write_the_storage_refuses_is_named_by_the_storages_error(tmp_path, monkeypatch, caplog):
    # torch.save turns an exception of the stream it writes to into "RuntimeError: unexpected
    # pos": status said `writing part 0 of step 20: RuntimeError` while S3 was down.
    _, _, state = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), retry_first_s=0.05, retry_max_s=0.1))
    real, refused = Storage.open_write, []

    @contextlib.contextmanager
    def refusing_once(self, *parts):
        with real(self, *parts) as f:
            class Sink:
                writes = 0

                def write(self, data):
                    self.writes += 1
                    if self.writes == 3 and not refused:  # inside torch.save of the first tensor
                        refused.append(True)
                        raise ConnectionError("the endpoint went away")
                    return f.write(data)

                def flush(self):
                    f.flush()
            yield Sink()

    monkeypatch.setattr(Storage, "open_write", refusing_once)
    save(engine, 5, state)
    engine.close()
    assert engine.committed_step == 5 and load_latest(str(tmp_path)).step == 5
    assert "writing part 0 of step 5 failed (ConnectionError: the endpoint went away)" in caplog.text


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
        step_dir = tmp_path / layout.step_dir(20)
        deadline = time.monotonic() + 60
        while not any(step_dir.glob(f"attempt-*/part-0/{layout.DATA_FILE}")):  # bytes are being written
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


def test_a_committed_step_whose_manifest_is_gone_is_reported(tmp_path, caplog):
    from transom import contract
    from transom.ft.checkpointing import Checkpoints
    from transom.ft.replica import ReplicaContext
    from transom.ft.state import ReplicaState

    env = contract.ReplicaEnv.from_environ({contract.ENV_COORDINATOR_URL: "http://127.0.0.1:1",
                                            contract.ENV_REPLICA_ID: "0", contract.ENV_NUM_REPLICAS: "1"})
    ctx = ReplicaContext(env=env, rank=0, local_rank=0, world_size=1, backend="gloo", device=torch.device("cpu"),
                         ctrl_group=None)
    model, opt, _ = make_state()
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path), keep=3))
    for step in (10, 20):
        save(engine, step, {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()})
    engine.close()
    (tmp_path / layout.step_dir(20) / layout.MANIFEST).unlink()
    checkpoints = Checkpoints(CheckpointConfig(uri=str(tmp_path)), ctx, ReplicaState(model, opt, ctx.device))
    try:
        with caplog.at_level("ERROR", logger="transom.ft"):
            # The coordinator recorded step 20 committed; storage no longer has its manifest.
            assert checkpoints.restore(lambda: (None, 20)) == 10
    finally:
        checkpoints.engine.close()
    assert "checkpoint step 20 was committed" in caplog.text and "it is lost" in caplog.text


def test_the_scripts_own_values_come_back_from_a_checkpoint(tmp_path):
    """`extra_state={"script": ScriptState(...)}` (nanoGPT's best_val_loss, iter_num) is in the
    checkpoint and a new incarnation's restore puts it back, beside the model."""
    from transom import contract
    from transom.ft import ScriptState
    from transom.ft.checkpointing import Checkpoints
    from transom.ft.replica import ReplicaContext
    from transom.ft.script_state import bundle
    from transom.ft.state import ReplicaState

    env = contract.ReplicaEnv.from_environ({contract.ENV_COORDINATOR_URL: "http://127.0.0.1:1",
                                            contract.ENV_REPLICA_ID: "0", contract.ENV_NUM_REPLICAS: "1"})
    ctx = ReplicaContext(env=env, rank=0, local_rank=0, world_size=1, backend="gloo", device=torch.device("cpu"),
                         ctrl_group=None)
    model, opt, _ = make_state()
    saved = ReplicaState(model, opt, ctx.device,
                         extra=bundle({"script": ScriptState(best_val_loss=1.25, iter_num=7, tag="run-a")}))
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path)))
    save(engine, 10, saved.capture(10))
    engine.close()

    fresh_model, fresh_opt, _ = make_state(seed=1)
    script = ScriptState(best_val_loss=1e9, iter_num=0, tag="fresh")
    restored = ReplicaState(fresh_model, fresh_opt, ctx.device, extra=bundle({"script": script}))
    checkpoints = Checkpoints(CheckpointConfig(uri=str(tmp_path)), ctx, restored)
    try:
        assert checkpoints.restore(lambda: (None, 10)) == 10
    finally:
        checkpoints.engine.close()
    assert dict(script) == {"best_val_loss": 1.25, "iter_num": 7, "tag": "run-a"}
    assert_same(fresh_model.state_dict(), model.state_dict())
