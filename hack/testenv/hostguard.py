"""What the real nodes change on the host, recorded before `up` and put back by `down`.

A kubelet is written for a machine it owns: at start it rewrites three global sysctls,
creates directories at fixed host paths whatever its configuration says, and its pods
leave mounts (volumes, container root filesystems, network namespace handles) and
cgroups behind if anything is stopped out of order. `record()` notes what exists before
the first node starts; `restore()` kills whatever still runs in the nodes' cgroups,
unmounts what lies under our directories, removes our cgroups and the host paths that
did not exist before, and writes the sysctls back.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

# Global (not per network namespace) sysctls the kubelet sets at start (setupKernelTunables).
KUBELET_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
# Host paths the kubelet, containerd and the CNI plugins create regardless of configuration.
FIXED_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/var/lib/cni", "/run/containerd",
               "/run/netns", "/etc/cni", "/opt/cni", "/var/lib/containerd", "/run/runc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def record() -> dict:
    """What `restore` needs to put back: a snapshot taken before the first node starts."""
    return snapshot()


def cgroup_dirs(name: str) -> list[Path]:
    """The node's cgroup (cgroupRoot of its kubelet) in every mounted hierarchy."""
    out = []
    for hierarchy in sorted(CGROUP_ROOT.iterdir()) if CGROUP_ROOT.exists() else []:
        if hierarchy.is_dir() and not hierarchy.is_symlink() and (hierarchy / "cgroup.procs").exists():
            out.append(hierarchy / name)
    return out


def make_cgroups(name: str) -> None:
    for d in cgroup_dirs(name):
        d.mkdir(exist_ok=True)
        if d.parent.name == "cpuset":  # a new cpuset has no CPUs or memory nodes until given them
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text((d.parent / f).read_text())


def _pids_in(d: Path) -> set[int]:
    pids: set[int] = set()
    for procs in d.rglob("cgroup.procs"):
        try:
            pids.update(int(x) for x in procs.read_text().split())
        except OSError:
            pass
    return pids


def kill_cgroups(name: str, timeout_s: float = 10.0) -> int:
    """SIGKILL every process left in the node's cgroups (containers, shims); how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = set().union(*(_pids_in(d) for d in cgroup_dirs(name) if d.exists()))
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return len(killed)


def remove_cgroups(name: str) -> None:
    for d in cgroup_dirs(name):
        if d.exists():
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                _rmdir(sub)
            _rmdir(d)


def _rmdir(d: Path) -> None:
    for _ in range(50):  # a cgroup whose last process just died may be busy for a moment
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def mounts_under(prefixes: list[str]) -> list[str]:
    """Mount points at or below any of `prefixes`, deepest first."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
                points.append(point)
    return sorted(set(points), key=lambda p: -p.count("/"))


def unmount(prefixes: list[str]) -> None:
    for _ in range(3):  # stacked mounts come off one layer per pass
        points = mounts_under(prefixes)
        if not points:
            return
        for point in points:
            os.system(f"umount -l '{point}' 2>/dev/null")


def restore(before: dict) -> None:
    """Put back the sysctls and remove the host paths and the pods' netns handles that we
    created (the nodes' own namespaces are network.delete()'s)."""
    handles_before = set(before.get("netns", []))
    if os.path.isdir("/run/netns"):
        for entry in os.listdir("/run/netns"):
            if entry not in handles_before and entry.startswith("cni-"):
                path = f"/run/netns/{entry}"
                os.system(f"umount '{path}' 2>/dev/null")
                try:
                    os.unlink(path)
                except OSError:
                    pass
    unmount([p for p in FIXED_PATHS if p not in before.get("paths", [])])
    for path in FIXED_PATHS:
        if path not in before.get("paths", []) and os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
    for key, value in before.get("sysctls", {}).items():
        try:
            Path("/proc/sys", key).write_text(value)
        except OSError:
            pass


def kill_netns(path: str) -> int:
    """SIGKILL every process whose network namespace is the one at `path` (a node's
    containerd shims outlive containerd); how many."""
    try:
        target = os.stat(path).st_ino
    except OSError:
        return 0
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
        except OSError:
            pass
    return killed


NODE_BINARIES = ("containerd", "containerd-shim-runc-v2", "kubelet", "kube-proxy", "runc", "coredns", "pause")


# buildah's own storage (hack/testenv/dockerfiles.py builds the images there, beside the tests):
# it mounts its overlay root once and a container's root while the build reads it, and
# unmounts those itself; the test environment's nodes never use it.
BUILDAH_STORAGE = "/var/lib/containers/storage"


def snapshot() -> dict:
    """What `down` must leave as `up` found it, in a form two calls can compare."""
    hierarchies = [h for h in sorted(CGROUP_ROOT.iterdir()) if h.is_dir() and not h.is_symlink()] \
        if CGROUP_ROOT.exists() else []
    return {
        "sysctls": {k: Path("/proc/sys", k).read_text().strip() for k in KUBELET_SYSCTLS},
        "paths": [p for p in FIXED_PATHS if os.path.lexists(p)],
        "netns": sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else [],
        "mounts": sorted({point for line in open("/proc/self/mountinfo")
                          if not (point := line.split()[4]).startswith(BUILDAH_STORAGE)}),
        "cgroups": sorted(f"{h.name}/{d.name}" for h in hierarchies for d in h.iterdir() if d.is_dir()),
        "node_processes": sorted(node_processes()),
    }


def node_processes() -> list[str]:
    """`pid exe` of every running process of a node binary (none should outlive `down`)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                exe = os.readlink(f"/proc/{entry}/exe").removesuffix(" (deleted)")
            except OSError:
                continue
            if os.path.basename(exe) in NODE_BINARIES:
                out.append(f"{entry} {exe}")
    return out


def differences(before: dict, after: dict) -> list[str]:
    """Human-readable differences between two snapshots (empty: the host is as it was)."""
    out = []
    for key in before.keys() | after.keys():
        a, b = before.get(key), after.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            added, removed = sorted(set(b) - set(a)), sorted(set(a) - set(b))
            out.append(f"{key}: added {added[:10]}, removed {removed[:10]}")
        else:
            out.append(f"{key}: {a} -> {b}")
    return sorted(out)
