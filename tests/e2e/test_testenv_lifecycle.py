"""`hack/testenv.sh up|env|down` as a user runs it: idempotent up, and down leaves nothing.

A second, private control plane (its own state directory; every port is a free one) is
started through the real script, so the session's shared control plane is not disturbed.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "testenv.sh"

pytestmark = pytest.mark.timeout(240)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_up_is_idempotent_and_down_leaves_no_process(tmp_path, control_plane):
    env = dict(os.environ, TRANSOM_TESTENV_STATE=str(tmp_path / "state"))
    run = lambda *a: subprocess.run([str(SCRIPT), *a], env=env, capture_output=True, text=True, timeout=180)  # noqa: E731
    t0 = time.monotonic()
    first = run("up", "--nodes", "1")
    warm_up_s = time.monotonic() - t0
    assert first.returncode == 0, first.stderr[-3000:]
    exports = dict(
        line.removeprefix("export ").split("=", 1) for line in first.stdout.splitlines() if line.startswith("export ")
    )
    kubeconfig = exports["KUBECONFIG"]
    assert kubeconfig.startswith(str(tmp_path))
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    pids = {name: p["pid"] for name, p in state["procs"].items()}
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "weed"}
    print(f"warm up of a 1-node control plane: {warm_up_s:.1f}s")

    nodes = subprocess.run(
        [str(control_plane.bin_dir / "kubectl"), f"--kubeconfig={kubeconfig}", "get", "nodes", "-o", "name"],
        capture_output=True, text=True, timeout=30, check=True,
    )
    assert nodes.stdout.split() == ["node/kwok-node-0"]

    again = run("up", "--nodes", "1")  # reuses what runs: same processes, same credentials
    assert again.returncode == 0 and again.stdout.splitlines()[:5] == first.stdout.splitlines()[:5]
    procs = json.loads((tmp_path / "state" / "state.json").read_text())["procs"]
    assert {n: p["pid"] for n, p in procs.items()} == pids
    assert run("env").stdout.splitlines()[0] == f"export KUBECONFIG={kubeconfig}"

    down = run("down")
    assert down.returncode == 0, down.stderr
    assert not [name for name, pid in pids.items() if _alive(pid)], "down left processes running"
    assert not (tmp_path / "state").exists()
    gone = run("env")
    assert gone.returncode == 1 and "hack/testenv.sh up" in gone.stderr
