"""Whether a worker was OOM-killed: the container's memory cgroup counts the kernel's kills.

When a container goes over its memory limit, the kernel's OOM killer kills the largest
process in the container's memory cgroup (a worker, as a rule) with SIGKILL; the launcher
sees only the signal. The cgroup counts each such kill: the `oom_kill N` line of
`memory.oom_control` (cgroup v1, kernels >= 4.13) or of `memory.events` (cgroup v2). A worker
that died while that counter rose was OOMKilled (`Counter`).

The cgroup is this process's own (/proc/self/cgroup), under the mount of its hierarchy
(/proc/self/mountinfo): in a container that is the mount point itself, whose root is the
container's cgroup. Parsing is pure (`locate`, `parse_oom_kills`, `parse_limit`), the reads
are apart. Anything missing or unreadable makes the answer "unknown" (None), never an
error: a launcher outside any memory cgroup, or on a kernel without the counter, supervises
as before and calls a SIGKILL a SIGKILL.

On cgroup v2 the kubelet (1.28 and later) sets `memory.oom.group`, so the kernel kills the
whole container, launcher included: there is no in-place restart to make, and the kubelet
reports the container OOMKilled to the operator. On cgroup v1 it kills one process.

Standard library only: the launcher imports this without torch.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

from transom import contract
from transom.launch.processes import describe_exit

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number; anything this
# large is no limit.
UNLIMITED = 1 << 62
# The kernel counts a kill right after it sends the signal; when another task's allocation
# chose the victim, the victim may be reaped a moment before the count. Looked at again this
# long before a SIGKILL is called a SIGKILL.
COUNT_PATIENCE_S = 0.2
_BINARY = (("Ei", 1 << 60), ("Pi", 1 << 50), ("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20))
_DECIMAL = (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6))
PAGE = 4096  # v1 rounds a limit down to whole pages: 600M is stored as 599998464


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup directory and the version of its hierarchy."""

    path: Path
    version: int  # 1 or 2

    @property
    def counter_file(self) -> Path:
        return self.path / ("memory.oom_control" if self.version == 1 else "memory.events")

    @property
    def limit_file(self) -> Path:
        return self.path / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")

    def oom_kills(self) -> int | None:
        """The kills counted so far; None if unknown."""
        return parse_oom_kills(_read(self.counter_file))

    def limit(self) -> int | None:
        """The memory limit in bytes; None if there is none or it is unknown."""
        return parse_limit(_read(self.limit_file))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def parse_oom_kills(text: str) -> int | None:
    """N of the `oom_kill N` line of memory.oom_control (v1) or memory.events (v2)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isascii() and value.strip().isdigit():
            return int(value)
    return None


def parse_limit(text: str) -> int | None:
    """Bytes of memory.limit_in_bytes (v1) or memory.max (v2); None for "max", no limit or garbage."""
    value = text.strip()
    if not (value.isascii() and value.isdigit()) or int(value) >= UNLIMITED:
        return None
    return int(value)


def quantity(n: int) -> str:
    """`n` bytes as a pod's resources.limits.memory would say it: 3Gi, 600M (which v1 stores
    rounded down to whole pages), 1536Ki, else the number."""
    for suffix, unit in _BINARY:
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    if n % PAGE == 0:
        for suffix, unit in _DECIMAL:
            whole = -(-n // unit)
            if n >= unit and whole * unit - n < PAGE:
                return f"{whole}{suffix}"
    return f"{n >> 10}Ki" if n % 1024 == 0 else str(n)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, file system type, super options) of each line of a mountinfo."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        out.append((fields[3], fields[4], tail[0], set(tail[2].split(","))))
    return out


def _under(root: str, path: str, mount_point: str) -> Path | None:
    """Where cgroup `path` is under a mount of the hierarchy at `root`; None if outside it."""
    if root == "/":
        relative = path.lstrip("/")
    elif path == root or path.startswith(root.rstrip("/") + "/"):
        relative = path[len(root):].lstrip("/")
    else:
        return None
    return Path(mount_point) / relative


def locate(proc_cgroup: str, mountinfo: str) -> MemoryCgroup | None:
    """This process's memory cgroup from /proc/self/cgroup and /proc/self/mountinfo: the v1
    memory controller's where there is one (hybrid hosts mount v2 beside it, without the
    memory controller), else the v2 hierarchy's."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    mounts = _mounts(mountinfo)
    if v1 is not None:
        for root, point, fstype, options in mounts:
            if fstype == "cgroup" and "memory" in options:
                found = _under(root, v1, point)
                if found is not None:
                    return MemoryCgroup(found, 1)
        return None
    if v2 is not None:
        for root, point, fstype, _ in mounts:
            if fstype == "cgroup2":
                found = _under(root, v2, point)
                if found is not None:
                    return MemoryCgroup(found, 2)
    return None


def find() -> MemoryCgroup | None:
    """This process's memory cgroup, if it has one with an OOM-kill counter."""
    cgroup = locate(_read(Path("/proc/self/cgroup")), _read(Path("/proc/self/mountinfo")))
    if cgroup is None or cgroup.oom_kills() is None:
        return None
    return cgroup


class Counter:
    """The OOM kills of one memory cgroup since `mark()` (no cgroup: always unknown)."""

    def __init__(self, cgroup: MemoryCgroup | None):
        self.cgroup = cgroup
        self._mark: int | None = None

    def mark(self) -> None:
        """Count from now (before an attempt's workers start)."""
        self._mark = self.cgroup.oom_kills() if self.cgroup is not None else None

    def rose(self, patience_s: float = 0.0) -> bool | None:
        """Whether the kernel OOM-killed a process of the cgroup since `mark()`, looking again
        for up to `patience_s` while it has not; None if unknown."""
        if self.cgroup is None or self._mark is None:
            return None
        deadline = time.monotonic() + patience_s
        while True:
            now = self.cgroup.oom_kills()
            if now is None:
                return None
            if now > self._mark or time.monotonic() >= deadline:
                return now > self._mark
            time.sleep(0.02)

    def limit(self) -> str | None:
        """The cgroup's memory limit as a quantity ("3Gi"); None if none or unknown."""
        limit = self.cgroup.limit() if self.cgroup is not None else None
        return quantity(limit) if limit is not None else None

    def limit_text(self) -> str:
        """"memory limit 3Gi", or "no memory limit" (none, or unknown)."""
        limit = self.limit()
        return f"memory limit {limit}" if limit else "no memory limit"

    def report(self, rank: int, code: int) -> str | None:
        """The failure report of worker `rank` (exit `code`, negative: a signal) that died
        while the kernel OOM-killed a process of the container: the worker itself (SIGKILL),
        or a process it started (a DataLoader worker), whose death it then died of. None when
        the counter did not rise, or is unknown."""
        killed = code == -signal.SIGKILL
        if not self.rose(COUNT_PATIENCE_S if killed else 0.0):
            return None
        if killed:
            return f"{contract.OOM_KILLED}: worker rank {rank} was {contract.OOM_KILLED} ({self.limit_text()})"
        return (f"{contract.OOM_KILLED}: worker rank {rank} {describe_exit(code)} after the kernel OOM-killed "
                f"a process of its container ({self.limit_text()})")
