"""Helpers shared by the benchmark scripts: run a command with a hard deadline, clean up.

Not a benchmark itself. `transom run` starts launchers that start workers in sessions of
their own, so killing one process group is not enough to clean up after a run that timed
out (a SIGSTOPped worker would survive it): `run_bounded` follows the whole process tree
through /proc and kills it pid by pid. A pid is identified by (pid, start time), so a pid
reused by an unrelated process after ours exited is never signalled.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) of a live pid, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ... starttime(field 22)": comm may hold spaces and parentheses
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every live descendant of `pid`: {pid: start time}."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[0], []).append((int(entry), st[1]))
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            found[child] = start
            todo.append(child)
    return found


def kill_known(procs: dict[int, int]) -> int:
    """SIGKILL each (pid, start time) that is still the same process; returns how many."""
    n = 0
    for pid, start in procs.items():
        st = _stat(pid)
        if st is None or st[1] != start:
            continue  # exited (or the pid now belongs to someone else)
        try:
            os.kill(pid, signal.SIGKILL)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


@dataclass
class Result:
    returncode: int | None  # None: killed at the deadline
    seconds: float
    output: str
    leftovers_killed: int = 0  # descendants still alive after the command ended

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, chars: int = 3000) -> str:
        return self.output[-chars:]


def run_bounded(cmd: list[str], timeout_s: float, log_path: Path, env: dict[str, str] | None = None) -> Result:
    """Run `cmd` from the repository root (stdout+stderr to `log_path`), bounded in time.

    Descendants are sampled while it runs, so workers orphaned by a launcher that died
    first (re-parented to init) are still found. At the deadline, or after a normal exit,
    whatever of the tree is still alive is killed.
    """
    t0 = time.monotonic()
    seen: dict[int, int] = {}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        deadline = t0 + timeout_s
        code: int | None = None
        while (code := proc.poll()) is None:
            if time.monotonic() > deadline:
                seen.update(descendants(proc.pid))
                proc.kill()
                proc.wait()
                break
            seen.update(descendants(proc.pid))
            time.sleep(0.25)
    seconds = time.monotonic() - t0
    time.sleep(0.2)
    leftovers = kill_known(seen)
    return Result(code, seconds, Path(log_path).read_text(errors="replace"), leftovers)


def available_memory_bytes() -> int:
    """MemAvailable of this machine (what can be allocated without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def require_room(*, disk_path: str | None, disk_bytes: int, memory_bytes: int, what: str) -> None:
    """Exit with a message, before anything is written, if the run would not fit: a benchmark
    that fills the disk or the memory measures nothing and can take the machine down."""
    gib = 2**30
    if disk_path is not None:
        free = shutil.disk_usage(disk_path).free
        if free < disk_bytes:
            raise SystemExit(f"{what} needs {disk_bytes / gib:.1f} GiB free under {disk_path}, and there are "
                             f"{free / gib:.1f} GiB: use a smaller --size-mb or another --dir")
    have = available_memory_bytes()
    if have < memory_bytes:
        raise SystemExit(f"{what} needs {memory_bytes / gib:.1f} GiB of available memory, and there are "
                         f"{have / gib:.1f} GiB: use a smaller --size-mb")
