"""What one pre-flight check found (`CheckResult`), the ways a check reports it, and the one
line a failed pre-flight leaves behind (`failure_message`): the launcher's termination
message, which the operator quotes when it moves the replica off the node."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from transom import contract

# A container's termination message is cut at 4096 bytes by the kubelet, and the operator
# quotes it in a condition and an Event: a quarter of that says which checks failed and how.
MAX_MESSAGE = 1024


@dataclass(frozen=True)
class CheckResult:
    name: str
    """One of contract.PREFLIGHT_CHECKS."""
    passed: bool
    seconds: float
    """How long the check ran."""
    value: float | None
    """The measured figure (max relative error, mismatching elements, GB/s, ms, s, free bytes)."""
    expected: str
    """The range it must be in, in words ("<= 1e-04")."""
    message: str
    """One line for people: "compute: max relative error 0.5 (expected <= 1e-04)"."""
    skipped: bool = False
    """Not applicable here (no checkpoint location, no peer): counts as passed, and says so."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def measured(name: str, value: float, passed: bool, expected: str, what: str) -> CheckResult:
    """A check's finding: `what` it measured in words, e.g. "max relative error 3.1e-07".
    Its seconds are filled in by the runner."""
    return CheckResult(name, passed, 0.0, value, expected, f"{name}: {what} (expected {expected})")


def skipped(name: str, why: str) -> CheckResult:
    return CheckResult(name, True, 0.0, None, "not applicable", f"{name}: skipped: {why}", skipped=True)


def failed(name: str, what: str, expected: str = "to complete") -> CheckResult:
    """A check that could not measure: it raised, or its time was spent."""
    return CheckResult(name, False, 0.0, None, expected, f"{name}: {what}")


def timed_out(name: str, given: float) -> CheckResult:
    return failed(name, f"timed out after {given:.1f} s", f"to complete within {given:.1f} s")


def failure_message(results: Iterable[CheckResult]) -> str | None:
    """None when every check passed; else "PreflightFailed: " and the failed checks'
    messages joined by "; ", at most MAX_MESSAGE characters."""
    failures = [r.message for r in results if not r.passed]
    if not failures:
        return None
    text = f"{contract.PREFLIGHT_FAILED}: " + "; ".join(failures)
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."
