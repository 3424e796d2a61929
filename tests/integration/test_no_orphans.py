"""After any stop, nothing that Transom started is left running.

Real process trees: `transom run` -> one `transom launch` per replica -> workers, and each
worker starts a long-running child of its own (as a DataLoader worker or a helper tool
would), in its process group or outside it (a child that calls `os.setsid()`, as a daemon
does). The run is stopped with SIGTERM or SIGKILL, completes, or a worker fails or a
launcher is SIGKILLed and its replica restarted, and the test then looks through /proc for
anything of the tree that still runs.
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

from launching import start_launcher
from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.thread import CoordinatorThread
from transom.launch.supervisor import free_port
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
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def started_children(pid_dir: Path) -> list[int]:
    """The pids of the children the workers started (files named <worker pid>-<child pid>)."""
    return [int(f.name.split("-")[1]) for f in pid_dir.iterdir()]


def setsid_children(pid_dir: Path) -> list[int]:
    """The running children that workers started with `--setsid-child-dir pid_dir`, found by
    their command line (a pid alone could be reused)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if b"import os, time; os.setsid(); time.sleep(600)" in cmdline and str(pid_dir).encode() in cmdline \
                and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


@pytest.fixture
def setsid_dir(tmp_path):
    """Where the workers record their setsid children; any left running are killed at the end."""
    d = tmp_path / "setsid"
    d.mkdir()
    yield d
    for pid in setsid_children(d):
        os.kill(pid, signal.SIGKILL)


def start_run(replicas: int, pids: Path, setsid_dir: Path, *run_args: str) -> subprocess.Popen:
    """`transom run` of SMALL_JOB for as long as it is let run, each worker with both kinds of child."""
    cmd = [sys.executable, "-m", "transom", "run", "--replicas", str(replicas), "--quiet", *run_args, "--",
           sys.executable, str(SMALL_JOB), "--steps", "100000", "--step-seconds", "0.02", "--child-pid-dir", str(pids),
           "--setsid-child-dir", str(setsid_dir)]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopping_transom_run_stops_every_launcher_worker_and_child(tmp_path, setsid_dir, sig):
    pids = tmp_path / "pids"
    pids.mkdir()
    runner = start_run(2, pids, setsid_dir)
    try:
        wait_until(lambda: len(list(pids.iterdir())) == 2 and len(setsid_children(setsid_dir)) == 2, 90,
                   "both workers started their children")
        tree = descendants(runner.pid)
        # 2 launchers, 2 workers, 2 children in their groups and 2 outside them
        assert set(started_children(pids)) | set(setsid_children(setsid_dir)) <= tree and len(tree) >= 8
        runner.send_signal(sig)
        code = runner.wait(timeout=60)
        assert code == (128 + sig if sig == signal.SIGTERM else -sig)
        wait_until(lambda: not any(alive(p) for p in tree), 30, "every process of the run to end")
    finally:
        if runner.poll() is None:
            runner.kill()


def test_a_setsid_child_of_a_worker_does_not_outlive_a_completed_run(transom_run, setsid_dir):
    result = transom_run(["--replicas", "2"], ["--steps", "30", "--setsid-child-dir", str(setsid_dir)],
                         script=SMALL_JOB)
    assert result.returncode == 0, result.output[-3000:]
    assert len(list(setsid_dir.iterdir())) == 2
    assert setsid_children(setsid_dir) == [], "a worker's setsid child outlived the run"


def test_a_failed_attempts_setsid_child_is_stopped_when_the_attempt_ends(tmp_path, setsid_dir):
    """The launcher stops what left its workers' groups at the end of each attempt, not only
    at its own end: the failed attempt's child is gone while the restarted replica trains."""
    pids = tmp_path / "pids"
    pids.mkdir()
    runner = start_run(2, pids, setsid_dir, "--inject", "raise:replica=1,step=5")
    try:  # replica 0's worker, replica 1's failed attempt and its restart each started one
        wait_until(lambda: len(list(setsid_dir.iterdir())) == 3, 120, "the restarted worker's child")
        wait_until(lambda: len(setsid_children(setsid_dir)) == 2, 10, "the failed attempt's setsid child to end")
        assert runner.poll() is None
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) == 128 + signal.SIGTERM
        assert setsid_children(setsid_dir) == [], "a worker's setsid child outlived the run"
    finally:
        if runner.poll() is None:
            runner.kill()


def test_what_a_sigkilled_launcher_left_is_stopped_by_transom_run(tmp_path, setsid_dir):
    """A SIGKILLed launcher cannot stop its worker's setsid child (the worker dies with the
    launcher, PR_SET_PDEATHSIG): the child is re-parented to `transom run`, a subreaper,
    which stops it when the run ends."""
    pids = tmp_path / "pids"
    pids.mkdir()
    runner = start_run(1, pids, setsid_dir)
    try:
        wait_until(lambda: len(setsid_children(setsid_dir)) == 1, 90, "the worker's setsid child")
        (first,) = setsid_children(setsid_dir)
        (launcher,) = [pid for pid in descendants(runner.pid) if (_stat(pid) or [0, 0])[1] == str(runner.pid)]
        os.kill(launcher, signal.SIGKILL)
        wait_until(lambda: (_stat(first) or [0, 0])[1] == str(runner.pid), 10, "transom run to adopt the child")
        wait_until(lambda: len(list(setsid_dir.iterdir())) == 2, 90, "the replica's next generation")
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) == 128 + signal.SIGTERM
        assert setsid_children(setsid_dir) == [], "a setsid child of a SIGKILLed launcher's worker outlived the run"
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
