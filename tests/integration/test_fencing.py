"""Fencing against a real coordinator over HTTP on loopback, real storage in a tmp dir.

An incarnation that its replacement superseded commits no step (its quorum request is
refused, its optimizer is not stepped), writes no checkpoint object (a committer waiting for
the other parts writes neither the index nor the manifest once they arrive; the next
checkpoint writes nothing at all; a delete is refused), and serves no state. The coordinator
counts each refusal (`transom_coordinator_fenced_requests_total{endpoint}`) and tells it once
as an event; the incarnation logs one "fenced: ..." line. A coordinator that cannot be
reached holds a write back until it answers, and the write then lands. The whole scenario,
with real processes stopped past the heartbeat timeout, is test_partition.py.
"""

from __future__ import annotations

import logging
import re
import time
import urllib.request

import pytest
import torch

from transom import contract
from transom.checkpoint import layout
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.membership import Settings
from transom.coordinator.models import Identity, RegisterRequest
from transom.coordinator.thread import CoordinatorThread
from transom.errors import Evicted, Fenced
from transom.ft import FaultTolerant, FTConfig
from transom.ft.fencing import IncarnationFence
from transom.ft.replica import ReplicaContext
from transom.ft.state_server import StateServer
from transom.ft.transfer import http_get
from transom.launch.supervisor import free_port
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)
TOKEN = "fence-token"
# Heartbeats far apart: nothing here expires, and every refusal comes from what the test does.
SETTINGS = Settings(job="fence", num_replicas=2, min_replicas=1, heartbeat_interval_s=10.0, heartbeat_timeout_s=30.0)


def incarnation(replica: int, generation: int) -> Identity:
    return Identity(replica_id=replica, generation=generation, attempt=0)


def register(client: CoordinatorClient, identity: Identity) -> None:
    client.register(RegisterRequest(identity=identity, store_addr="127.0.0.1:1", state_endpoints=["http://127.0.0.1:1"]))


def fenced_requests(url: str, endpoint: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    m = re.search(rf'^transom_coordinator_fenced_requests_total{{endpoint="{re.escape(endpoint)}"}} (\S+)$', text, re.M)
    assert m is not None, text
    return float(m.group(1))


def refused_events(client: CoordinatorClient) -> list[str]:
    return [e.message for e in client.status().events if e.kind == "refused"]


@pytest.fixture
def coordinator():
    c = CoordinatorThread(SETTINGS, TOKEN)
    c.start()
    yield c, CoordinatorClient(c.url, TOKEN, timeout_s=5.0)
    c.stop()


def small_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return {"model": model.state_dict(), "step": 10}


def test_a_superseded_committer_writes_no_index_no_manifest_and_deletes_nothing(coordinator, tmp_path, caplog):
    c, client = coordinator
    zombie = incarnation(0, 0)
    register(client, zombie)
    state = small_state()
    committer = CheckpointEngine(CheckpointConfig(uri=str(tmp_path)), fence=IncarnationFence(client, zombie).confirm)
    other_writer = CheckpointEngine(CheckpointConfig(uri=str(tmp_path)))  # replica 1's part: it stays current
    step_dir = tmp_path / layout.step_dir(10)
    attempt = step_dir / layout.attempt_dir("round-3")
    assert committer.save(10, state, layout.Slot(writer=0, writers=2), "round-3")
    # Its part is written (the coordinator vouched for it), and it waits for part 1.
    wait_until(lambda: (attempt / "part-0" / layout.PART_DONE).exists(), 30, "part 0 written")
    register(client, incarnation(0, 1))  # replica 0's replacement joins: the committer is a zombie now
    with caplog.at_level(logging.ERROR, logger="transom.checkpoint"):
        assert other_writer.save(10, state, layout.Slot(writer=1, writers=2), "round-3")
        assert other_writer.wait_persisted(30) and committer.wait_persisted(30)
    assert (attempt / "part-1" / layout.PART_DONE).exists(), "every part was there to commit"
    assert not (step_dir / layout.DCP_METADATA).exists() and not (step_dir / layout.MANIFEST).exists()
    assert (committer.fenced, committer.committed_step) == (1, None)
    assert "fenced: replica 0 generation 0 attempt 0 was superseded; index (.metadata) of step 10 not written" \
        in caplog.text
    # Its next checkpoint writes nothing at all, and it deletes nothing.
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert committer.save(20, state) and committer.wait_persisted(30)
    with pytest.raises(Fenced, match="checkpoint of step 10 not deleted"):
        committer.storage.remove(layout.step_dir(10))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert committer.fenced == 2
    assert fenced_requests(c.url, "/v1/fence") == 3
    assert refused_events(client) == ["refused replica 0 generation 0 attempt 0 on /v1/fence (write index (.metadata) "
                                      "of step 10): superseded by generation 1 attempt 0"]
    committer.close()
    other_writer.close()


def test_a_write_waits_for_a_coordinator_it_cannot_reach_and_lands_once_it_answers(tmp_path):
    port = free_port()
    c = CoordinatorThread(SETTINGS, TOKEN, port=port)
    c.start()
    client = CoordinatorClient(c.url, TOKEN, timeout_s=5.0)
    me = incarnation(0, 0)
    register(client, me)
    c.stop()
    config = CheckpointConfig(uri=str(tmp_path), retry_first_s=0.1, retry_max_s=0.5)
    engine = CheckpointEngine(config, fence=IncarnationFence(client, me, timeout_s=1.0).confirm)
    try:
        assert engine.save(5, small_state())
        time.sleep(2.0)
        assert list(tmp_path.iterdir()) == [], "written without the coordinator's word"
        c = CoordinatorThread(SETTINGS, TOKEN, port=port)  # a restarted coordinator knows nobody yet
        c.start()
        time.sleep(1.0)
        assert list(tmp_path.iterdir()) == [], "written for an incarnation the coordinator does not know"
        register(client, me)  # as the leader does after a coordinator restart
        assert engine.wait_persisted(30)
        assert engine.committed_step == 5 and engine.fenced == 0
        assert (tmp_path / layout.step_dir(5) / layout.MANIFEST).exists()
    finally:
        engine.close()
        c.stop()


def test_a_state_server_serves_nothing_once_its_incarnation_is_replaced(coordinator):
    c, client = coordinator
    zombie = incarnation(1, 0)
    register(client, zombie)
    fence = IncarnationFence(client, zombie, lease_s=0.5)
    server = StateServer(TOKEN, refusal=fence.refusal)
    try:
        server.publish_small(7, b"small state")
        assert http_get(server.url, "/small/7", TOKEN, 5.0) == (200, b"small state")
        register(client, incarnation(1, 1))
        time.sleep(0.6)  # the last confirmation no longer vouches for it
        status, body = http_get(server.url, "/small/7", TOKEN, 5.0)
        assert status == 409
        assert body.decode() == "fenced: replica 1 generation 0 attempt 0 was superseded; state not served"
        assert http_get(server.url, "/small/7", TOKEN, 5.0)[0] == 409  # for good, without asking again
        assert fenced_requests(c.url, "/v1/fence") == 1
        assert refused_events(client) == ["refused replica 1 generation 0 attempt 0 on /v1/fence (serve state): "
                                          "superseded by generation 1 attempt 0"]
    finally:
        server.close()


def test_a_superseded_incarnation_never_steps_its_optimizer(caplog):
    c = CoordinatorThread(SETTINGS.model_copy(update={"num_replicas": 1}), TOKEN)  # no other replica to wait for
    c.start()
    client = CoordinatorClient(c.url, TOKEN, timeout_s=5.0)
    env = contract.ReplicaEnv.from_environ({contract.ENV_COORDINATOR_URL: c.url, contract.ENV_COORDINATOR_TOKEN: TOKEN,
                                            contract.ENV_REPLICA_ID: "0", contract.ENV_NUM_REPLICAS: "1"})
    ctx = ReplicaContext(env=env, rank=0, local_rank=0, world_size=1, backend="gloo", device=torch.device("cpu"),
                         ctrl_group=None)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    trainer = FaultTolerant(model, torch.optim.SGD(model.parameters(), lr=0.1), ctx, checkpoint=None,
                            config=FTConfig(quorum_timeout_s=30))
    x = torch.randn(8, 4)
    try:
        for _ in trainer.steps(2):
            model(x).pow(2).mean().backward()
            trainer.optimizer.step()
        before = [p.detach().clone() for p in model.parameters()]
        register(client, incarnation(0, 1))  # its replacement joined
        with caplog.at_level(logging.ERROR, logger="transom.ft"), pytest.raises(Evicted) as refused:
            for _ in trainer.steps(4):
                model(x).pow(2).mean().backward()  # the quorum request of step 2 is refused here
                trainer.optimizer.step()
        assert refused.value.state == "superseded"
        assert trainer.step == 2 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert "fenced: replica 0 generation 0 attempt 0 was superseded; step 2 not committed" in caplog.text
        assert fenced_requests(c.url, "/v1/quorum") == 1
        assert refused_events(client) == ["refused replica 0 generation 0 attempt 0 on /v1/quorum: superseded by "
                                          "generation 1 attempt 0"]
    finally:
        trainer.close()
        c.stop()
