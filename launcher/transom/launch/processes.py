"""Child processes that cannot outlive their owner.

Every worker runs in a process group of its own (it is the leader of a new session), and
the launcher signals the whole group: whatever the worker started (DataLoader workers, a
shell it ran) goes with it, also when the worker itself is already gone. On Linux a child
also asks the kernel to signal it when its parent dies (`PR_SET_PDEATHSIG`), so that a
launcher or a `transom run` that is SIGKILLed (nothing of its own can run then) does not
leave workers training for nobody. Pure standard library, no torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1


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


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to every process of group `pgid`; False if the group is empty."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a pid reused by someone else's group: not ours
        return False


def group_members(pgid: int) -> list[tuple[int, int, str]]:
    """(pid, parent pid, state) of every process in group `pgid`, from /proc (Linux)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid:
            out.append((int(stat.parent.name), int(fields[1]), fields[0]))
    return out


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
