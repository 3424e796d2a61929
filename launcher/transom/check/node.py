"""The node check: room on disk for snapshots, and a clock that agrees with the coordinator's.

Disk: `snapshot_dir` must have `snapshot_bytes` free (a checkpoint's staging, a spare's
copy): a full disk fails the first snapshot otherwise, long after the replica joined. The
value is the free bytes.

Clock: the coordinator's `/healthz` (no token needed) answers with a Date header, which has
a resolution of one second. The request is bracketed by this node's clock (sent, received):
the coordinator's clock read some moment in [Date, Date + 1 s) while this one read some
moment in [sent, received], so the skew is the smallest difference those intervals allow
(0 where they overlap): never more than the true skew, so only a real one fails.
Skipped without a coordinator URL. A coordinator that does not answer is not evidence
against this node: it is created with the job's first pods and may still be starting (seen
in CI: a pod's check ran before the coordinator listened, and the node was excluded), so the
GET is retried for up to CLOCK_PATIENCE_S of the budget and, with no answer, the clock is
reported as not compared and the check passes on its disk half.
"""

from __future__ import annotations

import email.utils
import http.client
import shutil
import time

from transom.check import http_probe
from transom.check.context import Budget, CheckContext
from transom.check.result import CheckResult, measured

NAME = "node"
# Beyond a few seconds NTP is not running or not reaching the node. Traces and step signals
# from every node are joined by time (detection, `transom detect replay`), tokens carry
# issue and expiry times, and logs are read side by side: a skew of seconds misorders them.
MAX_SKEW_S = 5.0
PROBE_TIMEOUT_S = 5.0
# How long the clock reading waits for a coordinator that is still starting, at most; the
# rest of the budget is the other checks'.
CLOCK_PATIENCE_S = 10.0
RETRY_INTERVAL_S = 0.5


def check(context: CheckContext, budget: Budget) -> CheckResult:
    free = shutil.disk_usage(context.snapshot_dir).free
    disk_expected = f">= {_gib(context.snapshot_bytes)} free at {context.snapshot_dir}"
    if free < context.snapshot_bytes:
        return measured(NAME, float(free), False, disk_expected, f"{_gib(free)} free at {context.snapshot_dir}")
    what = f"{_gib(free)} free at {context.snapshot_dir}"
    if context.coordinator_url is None:
        return measured(NAME, float(free), True, disk_expected, what + "; clock not compared (no coordinator)")
    skew = _clock_skew(context, budget)
    if skew is None:
        return measured(NAME, float(free), True, disk_expected,
                        f"{what}; clock not compared (coordinator {context.coordinator_url} did not answer)")
    skew_expected = f"clock skew <= {MAX_SKEW_S:g} s"
    if skew > MAX_SKEW_S:
        return measured(NAME, skew, False, skew_expected,
                        f"clock at least {skew:.1f} s off the coordinator's ({context.coordinator_url})")
    return measured(NAME, float(free), True, f"{disk_expected}; {skew_expected}",
                    f"{what}; clock skew {skew:.1f} s (the least the coordinator's 1 s Date allows)")


def _clock_skew(context: CheckContext, budget: Budget) -> float | None:
    """The smallest skew between this clock and the coordinator's that one GET allows; None
    when the coordinator cannot be reached in time. Raises (a failed check) when it answers
    without a Date: that is a coordinator that misbehaves, not one still starting."""
    assert context.coordinator_url is not None
    give_up = time.monotonic() + min(CLOCK_PATIENCE_S, budget.left() / 2)
    while True:
        try:
            answer = http_probe.get(context.coordinator_url, "/healthz", context.token,
                                    min(PROBE_TIMEOUT_S, max(0.001, give_up - time.monotonic())))
            break
        except (OSError, http.client.HTTPException):  # refused, reset, timed out: not up yet, or not reachable
            if time.monotonic() + RETRY_INTERVAL_S >= give_up or budget.stop.wait(RETRY_INTERVAL_S):
                return None
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
