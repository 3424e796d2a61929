"""A coordinator restart loses its memory, not the job's progress.

Two replicas train under `transom launch` (real processes); the coordinator is stopped
mid-run and a fresh one, with empty state, starts on the same port. The replicas' calls
retry while it is down, get 404 from the new one, register again, and the first round of
the new coordinator gathers them at the step they hold: no restart, no lost step.
"""

from __future__ import annotations

import json
import time

import pytest

from launching import kill_all, start_launcher
from transom import contract
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.membership import Settings
from transom.coordinator.thread import CoordinatorThread
from transom.launch.supervisor import free_port
from waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_replicas_survive_a_coordinator_restart(tmp_path):
    port, token = free_port(), "restart-token"
    settings = Settings(job="restart", num_replicas=2, min_replicas=1)
    coordinator = CoordinatorThread(settings, token, port=port)
    coordinator.start()
    launchers = [start_launcher(coordinator.url, token, 2, tmp_path, 500, **{contract.ENV_REPLICA_ID: str(r)})
                 for r in range(2)]
    try:
        m = coordinator.server.membership
        wait_until(lambda: coordinator.call(lambda: m.status(0).max_step) >= 10, 90, "step 10")
        coordinator.stop()
        time.sleep(1.5)  # the replicas are now retrying against a closed port
        coordinator = CoordinatorThread(settings, token, port=port)
        coordinator.start()
        # The event: the new coordinator's first round gathered both replicas. A few steps on, the job ends.
        m = coordinator.server.membership
        wait_until(lambda: coordinator.call(lambda: m.current is not None and len(m.current.members) == 2), 90,
                   "the new coordinator's first round of both replicas")
        end = CoordinatorClient(coordinator.url, token).finish(coordinator.call(lambda: m.step_limit) + 3)
        outputs = [p.communicate(timeout=150)[0] for p in launchers]
        assert [p.returncode for p in launchers] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    finally:
        kill_all(launchers)
        coordinator.stop()
    # Each replica ran as one incarnation (nothing restarted) and they ended identical.
    assert sorted(f.name for f in tmp_path.glob("steps-*.jsonl")) == ["steps-r0-g0-a0.jsonl", "steps-r1-g0-a0.jsonl"]
    finals = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("final-*.json"))]
    assert [f["step"] for f in finals] == [end, end]
    assert finals[0]["digest"] == finals[1]["digest"]
