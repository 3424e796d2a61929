"""The link check: can this node reach a peer replica, and how quickly does it answer?

A joining or recovering replica takes its state from a peer's state server
(ft/state_server.py); a node that cannot reach one, or whose token the peer refuses,
cannot recover from a peer. The check GETs the peer's `/healthz` (authenticated with the
peer token, cheap, served by any incarnation) PROBES times, each on a fresh connection as
a transfer's first request is, and reports the fastest round trip in milliseconds.
Skipped without a peer (`peer_url` None: a lone replica, or none is up yet).
"""

from __future__ import annotations

from transom.check import http_probe
from transom.check.context import Budget, CheckContext
from transom.check.result import CheckResult, failed, measured, skipped, timed_out

NAME = "link"
PROBES = 3
PROBE_TIMEOUT_S = 5.0  # one GET of a few bytes; the budget caps it further
# A GET of a few bytes that takes a second, at best of three, is a link or a peer that will
# not move a snapshot of gigabytes in time; a data-centre round trip is well under 10 ms.
MAX_RTT_MS = 1000.0


def check(context: CheckContext, budget: Budget) -> CheckResult:
    if context.peer_url is None:
        return skipped(NAME, "no peer to reach")
    best_ms = float("inf")
    for _ in range(PROBES):
        if budget.over():
            return timed_out(NAME, budget.given)
        try:
            answer = http_probe.get(context.peer_url, "/healthz", context.peer_token,
                                    min(PROBE_TIMEOUT_S, budget.left()))
        except (OSError, ValueError) as e:
            return failed(NAME, f"peer {context.peer_url} unreachable: {type(e).__name__}: {e}",
                          "an answer from the peer")
        if answer.status != 200:
            return failed(NAME, f"peer {context.peer_url} answered {answer.status} to GET /healthz"
                          + (" (wrong peer token?)" if answer.status == 401 else ""), "200")
        best_ms = min(best_ms, answer.rtt_s * 1e3)
    expected = f"<= {MAX_RTT_MS:.0f} ms"
    return measured(NAME, best_ms, best_ms <= MAX_RTT_MS, expected,
                    f"round trip {best_ms:.1f} ms to {context.peer_url}")
