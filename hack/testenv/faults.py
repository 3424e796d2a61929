"""Faults a cluster throws, done to the running test environment's real nodes (for
`make chaos` and the e2e chaos tests).

- `stop_node` / `start_node`: a machine lost and back. The node's kubelet, kube-proxy and
  containerd are SIGKILLed at once, then every process in its cgroups (the containers)
  and its containerd shims, as a power loss would; the Node goes NotReady when its lease
  runs out. `start_node` starts the three again with the arguments `up` gave them.
- `cut` / `heal`: a network partition. The node's link to the switch goes down (pods on
  other nodes are out of reach) and the forwarder stops carrying its connections to the
  API server and S3 (forward.py's `cut.json`): the node runs on, alone.
- `restart_containerd`: containerd stopped and started again; its shims, and so the
  containers, keep running (a runtime upgrade or crash).
- `stop_s3` / `start_s3` are cluster.py's.

Every function takes the node's index and acts only on processes and links that `up`
recorded for that node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from testenv import cluster, forward, hostguard, network, nodes

NODE_PROCESSES = ("kubelet", "kube-proxy", "containerd")
STOP_TIMEOUT_S = 15.0


def _state() -> tuple[Path, dict]:
    d = cluster.state_dir()
    return d, json.loads((d / cluster.STATE_FILE).read_text())


def _entry(state: dict, name: str) -> dict:
    try:
        return state["procs"][name]
    except KeyError:
        raise RuntimeError(f"the test environment has no {name}: start it with real nodes") from None


def _signal(entry: dict, sig: int) -> None:
    if cluster._alive(entry):
        os.kill(entry["pid"], sig)


def _wait_gone(entries: list[dict], timeout_s: float = STOP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while any(cluster._alive(e) for e in entries):
        for e in entries:  # reap those this process started (a test session's own `up`)
            try:
                os.waitpid(e["pid"], os.WNOHANG)
            except ChildProcessError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"node processes did not stop within {timeout_s:.0f}s: {entries}")
        time.sleep(0.1)


def _shims(d: Path, node: network.NodeNet) -> list[int]:
    """The containerd shims of the node (they outlive containerd by design)."""
    socket = str(nodes.containerd_socket(d, node))
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and socket.encode() in b" ".join(argv):
                pids.append(int(entry))
    return pids


def stop_node(index: int) -> int:
    """Power loss: the node's processes, containers and shims SIGKILLed at once; how many
    container processes died with it."""
    d, state = _state()
    node = network.NodeNet(index)
    entries = [_entry(state, f"{p}-{node.name}") for p in NODE_PROCESSES]
    for e in entries:
        _signal(e, signal.SIGKILL)
    killed = hostguard.kill_cgroups(node.netns)
    for pid in _shims(d, node):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_gone(entries)
    return killed


def _restart(d: Path, state: dict, name: str) -> None:
    entry = _entry(state, name)
    if cluster._alive(entry):
        return
    procs = state["procs"]
    cluster._start(name, entry["argv"], d, procs, exe=entry["exe"])


def start_node(index: int) -> None:
    """The node back: containerd first (the kubelet needs it), then kubelet and kube-proxy."""
    d, state = _state()
    node = network.NodeNet(index)
    _restart(d, state, f"containerd-{node.name}")
    nodes.wait_containerd({"ctr": _ctr()}, d, node)
    for p in ("kubelet", "kube-proxy"):
        d, state = _state()  # _start recorded the new pid
        _restart(d, state, f"{p}-{node.name}")


def restart_containerd(index: int) -> None:
    """containerd stopped (SIGTERM: its shims and containers run on) and started again."""
    d, state = _state()
    node = network.NodeNet(index)
    entry = _entry(state, f"containerd-{node.name}")
    _signal(entry, signal.SIGTERM)
    _wait_gone([entry])
    _restart(d, state, f"containerd-{node.name}")
    nodes.wait_containerd({"ctr": _ctr()}, d, node)


def _ctr() -> str:
    from testenv import build
    return build.NODE_TOOLS["ctr"]


def _set_cut(index: int, cut: bool) -> None:
    d, state = _state()
    node = network.NodeNet(index)
    path = d / forward.CUT_FILE
    current = set(json.loads(path.read_text())) if path.exists() else set()
    current = current | {node.netns_path} if cut else current - {node.netns_path}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sorted(current)))
    os.replace(tmp, path)
    link = ["ip", "-n", network.SWITCH_NS, "link", "set", f"n{index}", "down" if cut else "up"]
    subprocess.run(link, check=True, capture_output=True, timeout=30)
    _signal(_entry(state, "forwarder"), signal.SIGUSR1)


def cut(index: int) -> None:
    """Partition the node from the rest of the cluster (its processes run on)."""
    _set_cut(index, True)


def heal(index: int) -> None:
    """End the partition."""
    _set_cut(index, False)


def cut_nodes() -> list[str]:
    """Namespaces cut now (for `down`, and to check a scenario healed what it cut)."""
    d, _ = _state()
    path = d / forward.CUT_FILE
    return sorted(json.loads(path.read_text())) if path.exists() else []
