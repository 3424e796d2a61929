"""The node check: room on disk for snapshots, and a clock that agrees with the coordinator's.

Disk: `snapshot_dir` must have `snapshot_bytes` free (a checkpoint's staging, a spare's
copy): a full disk fails the first snapshot otherwise, long after the replica joined. The
value is the free bytes.

Clock: the coordinator's `/healthz` (no token needed) answers with a Date header, which has
a resolution of one second. The request is bracketed by this node's clock (sent, received):
the coordinator's clock read some moment in [Date, Date + 1 s) while this one read some
moment in [sent, received], so the skew is the smallest difference those intervals allow
(0 where they overlap): never more than the true skew, so only a real one fails.
Skipped without a coordinator URL.
"""

from __future__ import annotations

import email.utils
import shutil

from transom.check import http_probe
from transom.check.context import Budget, CheckContext
from transom.check.result import CheckResult, measured

NAME = "node"
# Beyond a few seconds NTP is not running or not reaching the node. Traces and step signals
# from every node are joined by time (detection, `transom detect replay`), tokens carry
# issue and expiry times, and logs are read side by side: a skew of seconds misorders them.
MAX_SKEW_S = 5.0
PROBE_TIMEOUT_S = 5.0


def check(context: CheckContext, budget: Budget) -> CheckResult:
    free = shutil.disk_usage(context.snapshot_dir).free
    disk_expected = f">= {_gib(context.snapshot_bytes)} free at {context.snapshot_dir}"
    if free < context.snapshot_bytes:
        return measured(NAME, float(free), False, disk_expected, f"{_gib(free)} free at {context.snapshot_dir}")
    what = f"{_gib(free)} free at {context.snapshot_dir}"
    if context.coordinator_url is None:
        return measured(NAME, float(free), True, disk_expected, what + "; clock not compared (no coordinator)")
    skew = _clock_skew(context, budget)
    skew_expected = f"clock skew <= {MAX_SKEW_S:g} s"
    if skew > MAX_SKEW_S:
        return measured(NAME, skew, False, skew_expected,
                        f"clock at least {skew:.1f} s off the coordinator's ({context.coordinator_url})")
    return measured(NAME, float(free), True, f"{disk_expected}; {skew_expected}",
                    f"{what}; clock skew {skew:.1f} s (the least the coordinator's 1 s Date allows)")


def _clock_skew(context: CheckContext, budget: Budget) -> float:
    """The smallest skew between this clock and the coordinator's that one GET allows;
    raises (a failed check) when the coordinator does not answer with a Date."""
    assert context.coordinator_url is not None
    answer = http_probe.get(context.coordinator_url, "/healthz", context.token,
                            min(PROBE_TIMEOUT_S, max(0.001, budget.left())))
    if answer.status != 200 or answer.date is None:
        raise ConnectionError(f"coordinator {context.coordinator_url} answered GET /healthz with {answer.status} "
                              f"and {'no' if answer.date is None else 'a'} Date header")
    theirs = email.utils.parsedate_to_datetime(answer.date).timestamp()
    # Theirs was in [theirs, theirs + 1); ours in [sent, received].
    if theirs + 1.0 < answer.sent:
        return answer.sent - (theirs + 1.0)
    if theirs > answer.received:
        return theirs - answer.received
    return 0.0


def _gib(n: int | float) -> str:
    return f"{n / (1 << 30):.1f} GiB"
