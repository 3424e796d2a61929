"""Whether the exception that ends a worker is its own failure or the echo of a peer's death.

When a process of a replica dies (SIGKILL, an OOM kill, a crash), the replica's other
processes learn it from the collective they were in with it: Gloo raises "Connection
closed by peer" or "Connection reset by peer", NCCL "remote process exited". That error
comes within milliseconds, sooner than the dead process's launcher, which polls its
workers' exit statuses every 50 ms, reports the death. The coordinator keeps the first
report of an incarnation's failure, so the run named the survivor's Gloo error as the
replica's failure, and the SIGKILL was only in the launcher's log.

A worker whose exception is such an echo therefore reports it only after `ECHO_GRACE_S`,
in words that say it is not the cause (`echo_report`). Its launcher, which sees the dead
process's exit status, reports the signal first and then stops this worker, whose report
is then never sent (or, sent late, is ignored: the incarnation failed already). Where no
launcher reports (the dead peer was on another node, gone with its node), the delayed
report still tells the coordinator, a second later. Pure: the caller waits and reports.
"""

from __future__ import annotations

# What the collective backends say when the process at the other end went away.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited")
# How their errors are known from others that say the same (a dataset download's reset
# connection is the worker's own failure): torch.distributed's error classes (NCCL, the
# store), and Gloo's RuntimeError, which names its transport's source file.
COLLECTIVE_ERRORS = {"DistError", "DistBackendError", "DistNetworkError"}
GLOO_MARK = "gloo/transport"
# Longer than the launcher's poll of its workers (launch/supervisor.py POLL_S) and its report
# on loopback or the pod network; short next to a collective timeout (10 s and more).
ECHO_GRACE_S = 1.0


def lost_a_peer(exc: BaseException | None) -> bool:
    """True if `exc` (or an exception it was raised from) is a collective's error saying that
    the process at the other end went away."""
    seen = 0
    while exc is not None and seen < 8:  # a bounded walk: a cycle of causes is possible
        text = str(exc)
        collective = bool({c.__name__ for c in type(exc).__mro__} & COLLECTIVE_ERRORS) or GLOO_MARK in text
        if collective and any(mark in text for mark in PEER_LOST):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def echo_report(reason: str, exc: BaseException | None) -> tuple[str, float]:
    """(what to report, seconds to wait before reporting it) for a failure `reason` that `exc`
    caused: an echo of a peer's death waits, and says that the peer's exit is the cause."""
    if not lost_a_peer(exc):
        return reason, 0.0
    return (f"{reason} (a peer process of this replica went away first: its exit, which its launcher reports, "
            "is the cause)"), ECHO_GRACE_S
