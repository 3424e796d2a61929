"""A pod that is going (deleted, preempted, drained: its launcher gets SIGTERM) says so.

Two replicas train under `transom launch` (real processes) against a coordinator the test
owns. Replica 1's launcher gets SIGTERM mid-run, as the kubelet sends it when the pod is
deleted: it reports the replica's failure before stopping its workers, so the coordinator
declares it `reported` at once and replica 0 trains on, instead of holding its next round
until replica 1 is missed (`hung` after the failed-step grace, or the heartbeat timeout).
"""

from __future__ import annotations

import json
import signal

import pytest

from launching import kill_all, start_launcher
from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.thread import CoordinatorThread
from transom.launch.supervisor import free_port
from waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_terminated_pod_reports_its_replica_at_once(tmp_path):
    # A long heartbeat timeout and grace: only the report can end the wait quickly.
    settings = Settings(job="sigterm", num_replicas=2, min_replicas=1, heartbeat_timeout_s=60.0,
                        failed_grace_s=30.0, round_timeout_s=60.0)
    coordinator = CoordinatorThread(settings, "sigterm-token", port=free_port())
    coordinator.start()
    launchers = [start_launcher(coordinator.url, "sigterm-token", 2, tmp_path, 60,
                                **{contract.ENV_REPLICA_ID: str(r)}) for r in range(2)]
    try:
        m = coordinator.server.membership
        wait_until(lambda: coordinator.call(lambda: m.status(0).max_step) >= 10, 120, "step 10")
        launchers[1].send_signal(signal.SIGTERM)
        out1 = launchers[1].communicate(timeout=60)[0]
        assert launchers[1].returncode == 128 + signal.SIGTERM, out1[-2000:]
        failures = coordinator.call(lambda: dict(m.failures_total))
        assert failures == {"reported": 1}, failures
        state = coordinator.call(lambda: (m.replicas[1].state, m.replicas[1].last_failure))
        assert state[0] == "failed" and state[1] == "received SIGTERM: the launcher is stopping (exit code 143)", state
        out0 = launchers[0].communicate(timeout=120)[0]  # replica 0 finishes alone, well within the grace
        assert launchers[0].returncode == 0, out0[-2000:]
    finally:
        kill_all(launchers)
        coordinator.stop()
    assert json.loads((tmp_path / "final-r0-k0.json").read_text())["step"] == 60
