"""Checkpoints on the real S3-compatible server of hack/testenv (SeaweedFS), through s3fs.

Credentials and endpoint come the way a pod gets them: the AWS variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL). The outage test stops the
server process itself and starts it again on the same ports and data.
"""

from __future__ import annotations

import secrets
import time

import boto3
import pytest
import torch

from testenv import cluster  # noqa: E402  (hack/ is on sys.path: tests/e2e/conftest.py)
from transom import compat
from transom.checkpoint import layout
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine
from transom.checkpoint.restore import load_latest

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def bucket(control_plane, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", control_plane.s3_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", control_plane.s3_secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", control_plane.s3_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3 = boto3.client("s3")
    name = f"ckpt-{secrets.token_hex(4)}"
    s3.create_bucket(Bucket=name)
    yield name
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=name, Key=obj["Key"])
    s3.delete_bucket(Bucket=name)


def test_s3_round_trip_two_parts_retention_and_dcp(bucket):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    uri = f"s3://{bucket}/jobs/tiny"
    for step in (10, 20, 30):
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        engines = [CheckpointEngine(CheckpointConfig(uri=uri, keep=2)) for _ in range(2)]
        for k, e in enumerate(engines):  # two replicas, one part each
            assert e.save(step, state, layout.Slot(writer=k, writers=2), f"attempt-{step}")
        for e in engines:
            assert e.wait_persisted(60)
            e.close()
        assert engines[0].committed_step == step
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"]]
    steps = sorted({k.split("/")[2] for k in keys})
    assert steps == [layout.step_dir(20), layout.step_dir(30)]  # keep=2
    assert f"jobs/tiny/{layout.step_dir(30)}/{layout.MANIFEST}" in keys
    restored = load_latest(uri)
    assert restored.step == 30 and restored.state["step"] == 30
    assert torch.equal(restored.state["model"]["weight"], model.weight.detach())
    momentum = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(restored.state["optimizer"]["state"][0]["momentum_buffer"], momentum)
    # torch.distributed.checkpoint reads the step straight from S3.
    target = {"model/weight": torch.zeros(256, 256)}
    compat.dcp_load(target, f"{uri}/{layout.step_dir(30)}")
    assert torch.equal(target["model/weight"], model.weight.detach())


def test_s3_outage_during_persist_training_goes_on_and_the_checkpoint_lands_after(bucket):
    """The S3 server is stopped while step 20 persists: the loop keeps stepping, nothing
    partial is ever visible, and step 20 is committed once the server is back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])  # ~100 MB of weights
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    uri = f"s3://{bucket}/jobs/outage"
    waits: list[float] = []
    engine = CheckpointEngine(CheckpointConfig(uri=uri, keep=3, retry_first_s=0.2, retry_max_s=1.0))

    def train_step() -> None:
        waits.append(engine.wait_snapshot())  # as FaultTolerant does before every optimizer step
        opt.step()
        model(torch.randn(4, 1024)).sum().backward()

    model(torch.randn(4, 1024)).sum().backward()
    assert engine.save(10, {"model": model.state_dict()})
    assert engine.wait_persisted(120) and engine.committed_step == 10
    train_step()

    assert engine.save(20, {"model": model.state_dict()})
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cluster.stop_s3()
    try:
        assert not engine.wait_persisted(0), "step 20 finished persisting before the server went away"
        # Training goes on, due checkpoints skipped: 20 steps end while step 20 persists against
        # the stopped server (a step waiting for the storage could not), none near a timeout.
        for step in range(21, 41):
            train_step()
            if step % 5 == 0:
                assert not engine.save(step, {"model": model.state_dict()})
        assert not engine.wait_persisted(0), "step 20 persisted while the server was stopped"
        assert max(waits[-20:]) < engine.config.snapshot_timeout_s / 10, f"a step waited {max(waits):.1f}s"
        assert engine.skipped == 4 and engine.committed_step == 10
        # What the replica's heartbeats would say (status.training.checkpointTrouble).
        deadline = time.monotonic() + 30
        while engine.trouble is None and time.monotonic() < deadline:
            time.sleep(0.1)
        failing = ("writing part 0 of step 20: ", "committing step 20: ")
        assert engine.trouble is not None and engine.trouble.startswith(failing), engine.trouble
    finally:
        cluster.start_s3()
    # From now on a reader sees step 10 or a complete step 20, never anything in between.
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        restored = load_latest(uri)
        assert restored.skipped == [], f"a committed checkpoint failed verification: {restored.skipped}"
        seen.append(restored.step)
        if restored.step == 20:
            break
        time.sleep(0.2)
    assert seen[-1] == 20, f"step 20 was not committed after the server returned (saw {sorted(set(seen))})"
    assert set(seen) <= {10, 20}
    for k, v in expected.items():
        assert torch.equal(restored.state["model"][k], v), f"{k} differs from the state saved at step 20"
    assert engine.wait_persisted(60)
    assert engine.trouble is None  # the writes went through again
    engine.close()
    assert engine.committed_step == 20 and engine.failed == 0
