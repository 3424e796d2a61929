"""`run_checks`: the pre-flight checks, in order, within one time budget.

Each check runs in a daemon thread of its own, and the runner waits for it only as long as
the budget has left: a check stuck in a driver call, a hung mount or a dead peer's socket
cannot be interrupted from Python, so it is abandoned (its thread ends when the call does,
or with the process) and reported as timed out. A check that holds processes (collective)
is told through its budget's `stop` and given GRACE_S to kill and reap them, so nothing it
started outlives `run_checks`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from transom import contract, defaults
from transom.check import collective, compute, link, memtest, node, storage
from transom.check.context import Budget, CheckContext
from transom.check.result import CheckResult, failed, timed_out

log = logging.getLogger("transom.check")
Check = Callable[[CheckContext, Budget], CheckResult]
CHECKS: dict[str, Check] = {
    "compute": compute.check, "memory": memtest.check, "collective": collective.check,
    "link": link.check, "storage": storage.check, "node": node.check,
}
# How long a timed-out check that holds child processes gets to kill and reap them; the
# others hold nothing that outlives their thread, and are not waited for at all.
GRACE_S = 5.0
HOLDS_PROCESSES = frozenset({"collective"})


def run_checks(context: CheckContext, names: Sequence[str] = contract.PREFLIGHT_CHECKS,
               timeout_s: float = defaults.PREFLIGHT_TIMEOUT_S) -> list[CheckResult]:
    """The results of the checks `names`, run in contract.PREFLIGHT_CHECKS order, all within
    `timeout_s`: each gets the time the ones before it left. ValueError for an unknown name."""
    unknown = sorted(set(names) - set(contract.PREFLIGHT_CHECKS))
    if unknown:
        raise ValueError(f"unknown pre-flight checks {unknown}: the checks are {', '.join(contract.PREFLIGHT_CHECKS)}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    results = [_run_one(name, context, deadline) for name in contract.PREFLIGHT_CHECKS if name in names]
    for r in results:
        log.info("pre-flight %s", r.message)
    return results


def _run_one(name: str, context: CheckContext, deadline: float) -> CheckResult:
    started = time.monotonic()
    budget = Budget(deadline, given=max(0.0, deadline - started))
    if budget.over():  # a check with no time cannot pass: not started, rather than started and abandoned
        return failed(name, "not run: the pre-flight's time was spent before it", "time to run")
    outcome: list[CheckResult] = []
    thread = threading.Thread(target=lambda: outcome.append(_guarded(name, context, budget)),
                              name=f"transom-check-{name}", daemon=True)
    thread.start()
    thread.join(budget.left())
    if not outcome:
        budget.stop.set()
        if name in HOLDS_PROCESSES:
            thread.join(GRACE_S)
        result = timed_out(name, budget.given)
    else:
        result = outcome[0]
    return dataclasses.replace(result, seconds=time.monotonic() - started)


def _guarded(name: str, context: CheckContext, budget: Budget) -> CheckResult:
    """The check's result; a check that raised failed, and says with what."""
    try:
        return CHECKS[name](context, budget)
    except Exception as e:
        log.debug("pre-flight %s raised", name, exc_info=True)
        return failed(name, f"failed: {type(e).__name__}: {_one_line(str(e))}")


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."
