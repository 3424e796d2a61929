"""Child processes that cannot outlive their owner.

Every worker runs in a process group of its own (it is the leader of a new session), and
the launcher signals the whole group: whatever the worker started (DataLoader workers, a
shell it ran) goes with it, also when the worker itself is already gone. On Linux a child
also asks the kernel to signal it when its parent dies (`PR_SET_PDEATHSIG`), so that a
launcher or a `transom run` that is SIGKILLed (nothing of its own can run then) does not
leave workers training for nobody.

A worker's child can leave its process group (`setsid`, a daemonizing double fork), and the
group's signals then miss it. So the launcher and `transom run` make themselves child
subreapers (`PR_SET_CHILD_SUBREAPER`): a process that loses its parent is re-parented to
them rather than to PID 1, and stays their descendant, and `kill_descendants` stops every
descendant found by walking the parent pids in /proc. Pure standard library, no torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved in the calling process; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def _set_parent_death_signal(sig: int, prctl: Callable[..., int] | None) -> bool:
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def dies_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` for Popen: the child gets `sig` when the process that started it dies.
    libc is looked up here, in the parent: between fork and exec the child only calls the
    function (a dlopen there could wait forever for a loader lock that another thread of the
    parent held at the fork)."""
    prctl = _prctl()

    def preexec() -> None:
        _set_parent_death_signal(sig, prctl)
    return preexec


def follow_parent(expected_parent: int, sig: int = signal.SIGTERM) -> bool:
    """Called by a child on itself: get `sig` once its parent dies; False if the parent is
    already gone (the caller should exit: nobody owns it any more)."""
    _set_parent_death_signal(sig, _prctl())
    return os.getppid() == expected_parent  # after prctl: a parent that died before is seen here


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants: one whose parent dies is
    re-parented here, not to PID 1, so `kill_descendants` still finds it. False off Linux."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to every process of group `pgid`; False if the group is empty."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a pid reused by someone else's group: not ours
        return False


def _stat(pid: int) -> tuple[int, int, str, str] | None:
    """(parent pid, process group, state, start time) of `pid`, from /proc; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[2]), fields[0], fields[19]
    except (OSError, IndexError, ValueError):
        return None


def _processes() -> dict[int, tuple[int, int, str, str]]:
    """`_stat` of every process (Linux)."""
    found = {int(name): _stat(int(name)) for name in os.listdir("/proc") if name.isascii() and name.isdigit()}
    return {pid: info for pid, info in found.items() if info is not None}


def group_members(pgid: int) -> list[tuple[int, int, str]]:
    """(pid, parent pid, state) of every process in group `pgid`, from /proc (Linux)."""
    return [(pid, parent, state) for pid, (parent, group, state, _) in _processes().items() if group == pgid]


def group_alive(pgid: int) -> bool:
    """True while some process of group `pgid` is running (zombies are done)."""
    if not Path("/proc").is_dir():
        return signal_group(pgid, 0)
    return any(state != "Z" for _, _, state in group_members(pgid))


def kill_group(pgid: int, timeout_s: float = 5.0) -> bool:
    """SIGKILL group `pgid` and wait until nothing of it runs; False if something outlived
    timeout_s. Orphans of the group that were re-parented to this process (it is PID 1 of a
    container, or a subreaper) are reaped here: nobody else will."""
    deadline = time.monotonic() + timeout_s
    while True:
        signal_group(pgid, signal.SIGKILL)
        if not group_alive(pgid):
            break
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    me = os.getpid()
    for pid, parent, state in group_members(pgid) if Path("/proc").is_dir() else []:
        if parent == me and state == "Z" and pid != pgid:  # never the leader: Popen reaps its own child
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return True


def descendants(root: int, table: dict[int, tuple[int, int, str, str]] | None = None) -> set[int]:
    """Every process whose chain of parents leads to `root` (not `root` itself)."""
    table = _processes() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (parent, *_) in table.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    frontier = [root]
    while frontier:
        new = [c for pid in frontier for c in children.get(pid, ()) if c not in found]
        found.update(new)
        frontier = new
    return found


def kill_descendants(timeout_s: float = 5.0, keep: Collection[int] = ()) -> bool:
    """SIGKILL every descendant of this process but those in `keep` and wait until none runs;
    False if one outlived timeout_s. Call it once the children it waits for itself (Popen)
    have been waited for: the zombies among its children, orphans it adopted, are reaped
    here. Nothing on a system without /proc."""
    if not Path("/proc").is_dir():
        return True
    me, deadline = os.getpid(), time.monotonic() + timeout_s
    while True:
        table = _processes()
        running = [pid for pid in descendants(me, table) if table[pid][2] != "Z" and pid not in keep]
        if not running:
            break
        if time.monotonic() > deadline:
            return False
        for pid in running:  # a process forked meanwhile is found on the next pass
            _kill_exact(pid, table[pid][3])
        time.sleep(0.02)
    for pid, (parent, _, state, _) in _processes().items():
        if parent == me and state == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return True


def _kill_exact(pid: int, start: str) -> None:
    """SIGKILL `pid` if it is still the process that started at `start`: the pid of one that
    ended meanwhile may already be someone else's. A pidfd makes the check and the kill one
    process; without one (Linux before 5.3) only a moment is left between them."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:
        fd = None
    try:
        info = _stat(pid)
        if info is None or info[3] != start:
            return
        if fd is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:  # gone meanwhile, or not ours to signal (another user's)
        pass
    finally:
        if fd is not None:
            os.close(fd)


def stop_launchers(launchers: list[subprocess.Popen], say: Callable[[str], None], grace_s: float) -> None:
    """SIGTERM the launchers still running (they stop their workers), SIGKILL after `grace_s`;
    then whatever a SIGKILLed launcher could not stop (`transom run` is their subreaper)."""
    for proc in launchers:
        if proc.poll() is None:
            proc.terminate()
    for proc in launchers:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # stuck in the kernel: the others still get stopped
                say(f"launcher pid {proc.pid} did not end after SIGKILL")
    # A launcher SIGKILLed (here or by anyone) could not stop what its workers started outside
    # their process groups: this process adopted it (a subreaper) and stops it now.
    if not kill_descendants():
        say("processes the replicas started survive SIGKILL")


def to_blame(codes: list[int | None]) -> int | None:
    """The worker (local rank) whose exit a failed attempt is reported by, from the workers'
    exit codes (None: running): one killed by a signal before one that exited non-zero, whose
    error is often its collective's echo of that death; else the lowest rank; None if none failed."""
    failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
    signalled = [rank for rank in failed if (codes[rank] or 0) < 0]
    chosen = signalled or failed
    return chosen[0] if chosen else None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
