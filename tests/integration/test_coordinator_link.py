"""A replica leader's link to the coordinator (`transom.ft.coordinator_link`), over real HTTP and real
process groups.

- `close()` stops a quorum request that is retrying against a coordinator that went away
  (it would otherwise retry until quorum_timeout_s and, from a non-daemon thread, hold the
  worker's exit), and leaves no thread of the link running.
- `hand_outcome` keeps the replica's other ranks waiting for the leader's quorum longer than
  their control group's timeout (a pause below minReplicas), with two real processes.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import threading
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from transom.coordinator.client import CoordinatorClient, CoordinatorError
from transom.coordinator.membership import Settings
from transom.coordinator.models import Identity, QuorumRequest, RegisterRequest
from transom.coordinator.thread import CoordinatorThread
from transom.ft.coordinator_link import CoordinatorLink, hand_outcome
from transom.launch.supervisor import free_port

TOKEN = "link-test-token"


def _link(url: str, quorum_timeout_s: float) -> CoordinatorLink:
    identity = Identity(replica_id=0, generation=0, attempt=0)
    registration = RegisterRequest(identity=identity, store_addr="127.0.0.1:29500",
                                   state_endpoints=["http://127.0.0.1/0"])
    return CoordinatorLink(CoordinatorClient(url, TOKEN, timeout_s=5.0), registration, quorum_timeout_s, lambda: 0)


def _request(step: int = 0) -> QuorumRequest:
    return QuorumRequest(identity=Identity(replica_id=0, generation=0, attempt=0), step=step,
                         commit_quorum_id=-1, last_round=-1)


def _link_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("transom-quorum", "transom-heartbeat")]


def test_close_stops_a_quorum_request_retrying_against_a_gone_coordinator():
    coordinator = CoordinatorThread(Settings(job="link", num_replicas=2, heartbeat_timeout_s=30.0), TOKEN)
    url = coordinator.start()
    link = _link(url, quorum_timeout_s=900.0)
    try:
        # Two replicas are needed, one is registered: the request long-polls. The coordinator
        # then goes away, and the request retries against a closed port.
        pending = link.ask(_request())
        queued = link.ask(_request(1))  # behind it: never sent
        time.sleep(0.5)
        assert not pending.done()
    finally:
        coordinator.stop()
    time.sleep(1.0)
    assert not pending.done(), "the request should still be retrying (quorum_timeout_s is 900 s)"
    t0 = time.monotonic()
    link.close(None)
    with pytest.raises(CoordinatorError):
        pending.result(timeout=10)
    assert time.monotonic() - t0 < 5.0
    assert queued.cancelled()
    deadline = time.monotonic() + 5
    while _link_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _link_threads(), f"threads left running: {_link_threads()}"
    with pytest.raises(CoordinatorError, match="closed"):
        link.ask(_request(2)).result(timeout=1)


def _rank(rank: int, port: int, every_s: float, results) -> None:
    """Rank `rank` of a 2-process replica whose control group times out after 2 s; the leader's
    quorum answer comes after 5 s."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    future: concurrent.futures.Future | None = None
    if rank == 0:
        future = concurrent.futures.Future()
        threading.Timer(5.0, lambda: future.set_result(_request(7))).start()

    def from_leader(value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    try:
        answer = hand_outcome(from_leader, future, timeout_s=30.0, every_s=every_s)
        assert isinstance(answer, str), answer
        results[rank] = QuorumRequest.model_validate_json(answer).step
    except Exception as e:  # the control group's timeout
        results[rank] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("every_s, waits", [(0.5, True), (60.0, False)])
def test_other_ranks_wait_for_the_leaders_quorum_past_their_control_groups_timeout(every_s, waits):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, every_s, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, "a rank did not end"
        got = dict(results)
    if waits:  # both ranks got the answer given 5 s after the start, past the 2 s timeout
        assert got == {0: 7, 1: 7}
    else:  # the control: one wait of 5 s on the group outlasts its timeout
        assert isinstance(got.get(1), str), got

