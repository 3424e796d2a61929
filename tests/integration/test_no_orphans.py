"""After any stop, nothing that Transom started is left running.

Real process trees: `transom run` -> one `transom launch` per replica -> workers, and each
worker starts a long-running child of its own (as a DataLoader worker or a helper tool
would). The run is stopped with SIGTERM or SIGKILL, or a worker is killed and its replica
restarted, and the test then looks through /proc for anything of the tree that still runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.server import CoordinatorThread
from transom.launch.supervisor import free_port
from launching import start_launcher
from waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
SMALL_JOB = Path(__file__).parent / "scripts" / "small_job.py"


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running (a zombie has finished; only its parent's bookkeeping is left)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat(int(stat.parent.name))
        if fields is not None:
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def started_children(pid_dir: Path) -> list[int]:
    """The pids of the children the workers started (files named <worker pid>-<child pid>)."""
    return [int(f.name.split("-")[1]) for f in pid_dir.iterdir()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopping_transom_run_stops_every_launcher_worker_and_child(tmp_path, sig):
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = [sys.executable, "-m", "transom", "run", "--replicas", "2", "--quiet", "--",
           sys.executable, str(SMALL_JOB), "--steps", "100000", "--step-seconds", "0.02", "--child-pid-dir", str(pids)]
    runner = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(list(pids.iterdir())) == 2, 90, "both workers started their children")
        tree = descendants(runner.pid)
        assert set(started_children(pids)) <= tree and len(tree) >= 6  # 2 launchers, 2 workers, 2 children
        runner.send_signal(sig)
        code = runner.wait(timeout=60)
        assert code == (128 + sig if sig == signal.SIGTERM else -sig)
        wait_until(lambda: not any(alive(p) for p in tree), 30, "every process of the run to end")
    finally:
        if runner.poll() is None:
            runner.kill()


def test_a_restarted_replica_leaves_no_process_of_its_failed_attempt(transom_run, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    result = transom_run(["--replicas", "2", "--inject", "kill:replica=1,step=5"],
                         ["--steps", "120", "--step-seconds", "0.02", "--child-pid-dir", str(pids)], script=SMALL_JOB)
    assert result.returncode == 0, result.output[-3000:]
    assert result.incarnations(1) == 2
    children = started_children(pids)
    assert len(children) == 3  # replica 0's, replica 1's first attempt's (SIGKILLed) and its restart's
    assert not [pid for pid in children if alive(pid)], "a worker's child outlived its worker"


def test_sigterm_while_waiting_for_node_0_stops_the_launcher_at_once(tmp_path):
    """Node 1 of a two-node replica waits (up to 300 s) for node 0's address, which never
    comes: SIGTERM (a pod deleted meanwhile) ends it within a second, with no worker started."""
    port, token = free_port(), "rendezvous-token"
    coordinator = CoordinatorThread(Settings(job="rdzv", num_replicas=1), token, port=port)
    coordinator.start()
    launcher = start_launcher(coordinator.url, token, 1, tmp_path, 10, **{
        contract.ENV_REPLICA_ID: "0", contract.ENV_NODE_RANK: "1", contract.ENV_NNODES: "2",
        "TRANSOM_LOG_LEVEL": "INFO"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("for node 0 to publish" in line for line in lines), 60, "the rendezvous wait")
        time.sleep(0.5)  # inside the wait's poll loop
        sent = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - sent < 2.0
    finally:
        if launcher.poll() is None:
            launcher.kill()
        coordinator.stop()
    reader.join(timeout=5)
    assert not any("started 1 workers" in line for line in lines), "".join(lines)[-2000:]
