"""The CUDA paths, on a real GPU: device placement, the backend each placement gets, the
pinned-memory checkpoint snapshot, FTAR with CUDA tensors, NCCL inside a replica, and a
SIGKILL with the model on the GPU.

Marked `cuda`: skipped (and reported as skipped) on a machine without a CUDA device;
`make test-gpu` runs them on the GPU machine, with that machine's own torch.
"""

from __future__ import annotations

import pytest
import torch

from test_checkpoint import assert_same
from test_fault_tolerance import CAP
from test_ftar import _average_worker, _run
from transom import compat
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine
from transom.checkpoint.restore import load_latest

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)"),
    pytest.mark.timeout(300),
]


@pytest.fixture
def replica_env(monkeypatch):
    for name, value in {"TRANSOM_JOB": "cuda", "TRANSOM_REPLICA_ID": "0", "TRANSOM_NUM_REPLICAS": "1",
                        "TRANSOM_COORDINATOR_URL": "http://127.0.0.1:9", "RANK": "0", "LOCAL_RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRANSOM_BACKEND", raising=False)


def test_a_process_gets_its_gpu_and_the_backend_follows_the_tensors(replica_env):
    from transom import ft
    from transom.ft import backend

    ctx = ft.init()
    assert ctx.device.type == "cuda" and ctx.backend == "auto"
    gpu = compat.gpu_id(ctx.device.index)
    assert backend.cross_replica("auto", tensor_device="cuda", member_gpus=[gpu, gpu]) == "gloo"
    with pytest.raises(backend.BackendError, match="share a GPU"):
        backend.cross_replica("nccl", tensor_device="cuda", member_gpus=[gpu, gpu])


def test_cuda_state_is_snapshotted_through_pinned_memory_and_restored_bit_identical(tmp_path):
    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(1024, 1024, device="cuda") for i in range(8)}, "step": 5}
    engine = CheckpointEngine(CheckpointConfig(uri=str(tmp_path)))
    try:
        assert engine.save(5, state)
        engine.wait_snapshot()
        assert engine.wait_persisted(120)
    finally:
        engine.close()
    restored = load_latest(str(tmp_path), device="cuda")
    assert restored.step == 5
    assert restored.state["model"]["w0"].device.type == "cuda"
    assert_same(state, restored.state)


def test_ftar_averages_cuda_gradients_between_replicas_sharing_the_gpu():
    results = _run(_average_worker, 3, "auto", "cuda")
    assert [r[1] for r in results] == [False, False, False]
    assert [r[3] for r in results] == ["gloo"] * 3  # one GPU shared: NCCL would refuse, Gloo carries CUDA tensors
    for _, _, grads, _ in results:
        assert torch.equal(torch.tensor(grads[0]), torch.full((5,), 1.5))


def test_sigkill_with_the_model_on_the_gpu(transom_run):
    # The job ends once the killed replica (a new process: Python, torch, CUDA, ~9 s on an
    # H200) is back and caught up; the others train on meanwhile, tens of ms a step.
    result = transom_run(["--replicas", "3", "--inject", "kill:replica=1,step=15", "--end-on", "caught_up:1"],
                         [*CAP, "--device", "ctx"])
    result.assert_finished_together(3)
    assert result.summary["replica_restarts"] >= 1 and result.incarnations(1) == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL inside a replica needs two GPUs")
def test_nccl_inside_a_replica_with_one_rank_per_gpu(transom_run):
    result = transom_run(["--replicas", "1", "--nproc-per-replica", "2", "--inject", "kill:replica=0,step=10,rank=1"],
                         ["--steps", "40", "--device", "ctx", "--inner", "ddp"])
    assert result.returncode == 0, result.output[-3000:]
    assert result.summary["steps_committed"] >= 40


def test_the_gpu_forms_of_the_preflight_checks_pass_and_a_corrupt_device_fails():
    """`transom check --device cuda`: cuBLAS matmul, device and pinned memory, the clock and disk."""
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "transom", "check", "--json", "--device", "cuda", "--checks", "compute,memory,node"]
    env = {k: v for k, v in os.environ.items() if k != "TRANSOM_FAULT"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and answer["passed"], done.stdout + done.stderr
    bad = subprocess.run(cmd, env={**env, "TRANSOM_FAULT": "corrupt:step=0"}, capture_output=True, text=True,
                         timeout=240)
    assert bad.returncode == 6 and "compute: " in bad.stdout, bad.stdout + bad.stderr


class _Server:
    """What a Source needs of its StateServer: the step it serves, and where it publishes."""

    snapshot_step = None

    def __init__(self) -> None:
        self.published: list = []

    def publish_snapshot(self, snapshot) -> None:  # noqa: ANN001 (a transfer.Published or None)
        self.published.append(snapshot)


def test_a_source_allocates_its_pinned_buffers_off_the_training_thread_and_snapshots_a_later_commit():
    """A catch-up snapshot of CUDA state needs pinned host buffers; the training thread does
    not wait for their allocation: the commit that finds none starts a helper and goes on,
    and a later commit copies into them."""
    import time

    from transom.ft.catchup import Source

    model = torch.nn.Linear(4096, 4096, device="cuda")  # 64 MiB of parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def capture(step: int) -> dict:
        return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}

    server = _Server()
    source = Source(server, localize=None)
    source.on_round(serve=True, snapshot_from=5)
    t0 = time.monotonic()
    params = lambda: list(model.parameters())  # noqa: E731  # what the fingerprint beside the copy sums
    source.after_commit(5, capture, params)
    assert time.monotonic() - t0 < 0.05 and source.snapshot_print(5) is None
    step = 5
    deadline = time.monotonic() + 30
    while source.snapshot_print(step) is None:
        assert time.monotonic() < deadline, "the reserved buffers never became ready"
        step += 1
        time.sleep(0.01)
        source.after_commit(step, capture, params)
    source.before_update(timeout_s=30)
    source.wait_publisher(60)
    published = server.published[-1]
    assert published is not None and published.manifest.step == step
    source.close()
    assert server.published[-1] is None
