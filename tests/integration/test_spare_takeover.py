"""A hot spare's launcher takes over a replica whose pod died, and the job finishes identical.

Real processes, as in a pod: two replicas run `transom launch`; a third launcher runs as a
spare (TRANSOM_SPARE_ID, a labels file standing in for the downward-API volume) and starts
nothing. Replica 1's whole "pod" (launcher and workers) is SIGKILLed mid-run; then the
labels file is rewritten the way the operator's relabel reaches the kubelet. The spare
starts as replica 1 generation 1, catches up from replica 0, and both finish bit-identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.server import CoordinatorThread
from transom.launch.supervisor import free_port
from launching import start_launcher
from waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _kill_pod(launcher: subprocess.Popen) -> None:
    """SIGKILL a launcher and its workers (their own sessions), as a pod's death would."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == launcher.pid:  # ppid
            children.append(int(stat.parent.name))
    for pid in [launcher.pid, *children]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait(timeout=10)


def test_spare_launcher_takes_over_a_dead_replica(tmp_path):
    port, token = free_port(), "spare-token"
    coordinator = CoordinatorThread(Settings(job="spare", num_replicas=2, min_replicas=1), token, port=port)
    coordinator.start()
    stats = tmp_path / "stats"
    podinfo = tmp_path / "podinfo"
    stats.mkdir()
    podinfo.mkdir()
    (podinfo / "labels").write_text(f'{contract.LABEL_JOB}="spare"\n{contract.LABEL_SPARE}="0"\n'
                                    f'{contract.LABEL_GENERATION}="0"\n')
    launchers = {r: start_launcher(coordinator.url, token, 2, stats, 60, **{contract.ENV_REPLICA_ID: str(r)})
                 for r in range(2)}
    spare = start_launcher(coordinator.url, token, 2, stats, 60,
                           **{contract.ENV_SPARE_ID: "0", contract.ENV_PODINFO_DIR: str(podinfo)})
    try:
        m = coordinator.server.membership
        wait_until(lambda: coordinator.call(lambda: m.status(0).max_step) >= 10, 120, "step 10")
        assert spare.poll() is None and not list(stats.glob("steps-r1-g1-*"))  # the spare only waits
        _kill_pod(launchers[1])
        tmp = podinfo / "labels.new"
        tmp.write_text(f'{contract.LABEL_JOB}="spare"\n{contract.LABEL_REPLICA}="1"\n'
                       f'{contract.LABEL_GENERATION}="1"\n')
        tmp.rename(podinfo / "labels")
        outputs = [launchers[0].communicate(timeout=150)[0], spare.communicate(timeout=150)[0]]
        assert [launchers[0].returncode, spare.returncode] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    finally:
        for p in [*launchers.values(), spare]:
            if p.poll() is None:
                p.kill()
        coordinator.stop()
    # Replica 0 ran once; replica 1 ran as generation 0 (killed) and then as the spare, generation 1.
    assert sorted(f.name for f in stats.glob("steps-*.jsonl")) == [
        "steps-r0-g0-a0.jsonl", "steps-r1-g0-a0.jsonl", "steps-r1-g1-a0.jsonl"]
    finals = {f.name: json.loads(f.read_text()) for f in stats.glob("final-*.json")}
    assert sorted(finals) == ["final-r0-k0.json", "final-r1-k0.json"]  # written by r1-g1 (r1-g0 was killed)
    assert [f["step"] for f in finals.values()] == [60, 60]
    assert finals["final-r0-k0.json"]["digest"] == finals["final-r1-k0.json"]["digest"]
