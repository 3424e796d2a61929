"""Checkpoints on the real S3-compatible server of hack/testenv (SeaweedFS), through s3fs.

Credentials and endpoint come the way a pod gets them: the AWS variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL).
"""

from __future__ import annotations

import secrets

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp

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
            assert e.save(step, state, layout.Slot(writer=k, writers=2))
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
    dcp.load(target, checkpoint_id=f"{uri}/{layout.step_dir(30)}", no_dist=True)
    assert torch.equal(target["model/weight"], model.weight.detach())
