"""Pre-flight checks in real launchers (`transom.launch.preflight`, `transom check`).

- A replica whose compute check is made to fail (a fault injected into the check's device
  result: a device that computes wrong) never starts a worker: its launcher exits 6 with
  `PreflightFailed: compute: ...`, the runner replaces it (on Kubernetes the operator also
  excludes the node: tests/unit/test_reconcile_preflight.py, and on real nodes
  tests/e2e/test_real_nodes.py), and the job trains on to its end, bit-identical.
- A hot spare whose periodic check fails while it waits exits the same way with its workers
  stopped, so a promotion that comes after finds nobody to promote.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from launching import start_launcher
from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.thread import CoordinatorThread
from transom.launch.supervisor import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_replica_whose_compute_check_fails_never_joins_and_the_job_trains_on(transom_run):
    checks = {"checks": ["compute", "memory", "link", "node"]}
    result = transom_run(["--replicas", "2", "--preflight", json.dumps(checks),
                          "--inject", "corrupt:replica=1,step=0,phase=preflight"], ["--steps", "20"])
    result.assert_finished_together(2)
    assert result.summary["completed_step"] == 20
    assert "replica 1 launcher exited with 6 (PreflightFailed: compute: max relative error" in result.output, \
        result.output[-3000:]
    assert "starting generation 1" in result.output
    # The failed incarnation never trained, nor even registered: no worker of replica 1
    # generation 0 wrote a step; generation 1 trained to the end.
    assert not list(result.stats_dir.glob("steps-r1-g0-*")), sorted(p.name for p in result.stats_dir.iterdir())
    assert list(result.stats_dir.glob("steps-r1-g1-*")) and result.incarnations(0) == 1


def test_a_spare_whose_periodic_check_fails_exits_and_is_never_promoted(tmp_path):
    port, token = free_port(), "preflight-token"
    coordinator = CoordinatorThread(Settings(job="pf", num_replicas=1, min_replicas=1), token, port=port)
    coordinator.start()
    stats, podinfo, termination = tmp_path / "stats", tmp_path / "podinfo", tmp_path / "termination-log"
    stats.mkdir()
    podinfo.mkdir()
    (podinfo / "labels").write_text(f'{contract.LABEL_JOB}="pf"\n{contract.LABEL_SPARE}="0"\n'
                                    f'{contract.LABEL_GENERATION}="0"\n')
    spare = start_launcher(coordinator.url, token, 1, stats, 20, **{
        contract.ENV_SPARE_ID: "0", contract.ENV_PODINFO_DIR: str(podinfo),
        contract.ENV_PREFLIGHT: json.dumps({"checks": ["compute"], "spareIntervalSeconds": 1}),
        # The spare's first check passes; its second, while it waits, finds the device wrong.
        contract.ENV_FAULT: "corrupt:step=1,phase=preflight",
        contract.ENV_TERMINATION_LOG: str(termination),
    })
    try:
        output, _ = spare.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        spare.kill()
        output, _ = spare.communicate()
        raise AssertionError(f"the spare did not exit:\n{output[-3000:]}") from None
    finally:
        coordinator.stop()
    assert spare.returncode == contract.EXIT_PREFLIGHT_FAILED, output[-3000:]
    message = termination.read_text()
    assert message.startswith("PreflightFailed: compute: "), message
    assert not list(stats.glob("steps-*")), "a spare that failed its check must not have trained"
