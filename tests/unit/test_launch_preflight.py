"""The launcher's side of the pre-flight (`transom.launch.preflight`): what TRANSOM_PREFLIGHT
may say, which failures run the checks again before an in-place restart, and how the
answer of `transom check --json` becomes the termination message.
"""

from __future__ import annotations

import json
import signal

import pytest

from transom import contract
from transom.launch import preflight
from transom.launch.preflight import PreflightSpec


def spec_of(value) -> PreflightSpec | None:
    return PreflightSpec.from_environ({contract.ENV_PREFLIGHT: json.dumps(value)})


def test_the_spec_is_read_from_the_environment():
    assert PreflightSpec.from_environ({}) is None  # unset: no checks (the local runner's default)
    assert spec_of({"checks": []}) is None
    got = spec_of({"checks": ["compute", "memory"], "timeoutSeconds": 12, "spareIntervalSeconds": 60})
    assert got == PreflightSpec(("compute", "memory"), 12.0, 60.0)
    assert spec_of({}).checks == contract.PREFLIGHT_CHECKS


@pytest.mark.parametrize("bad", [{"checks": ["gpu-burn"]}, {"timeoutSeconds": 0}, {"timeoutSeconds": "x"},
                                 {"spareIntervalSeconds": -1}, [1, 2]])
def test_a_malformed_spec_is_refused_with_what_is_wrong(bad):
    with pytest.raises(ValueError, match=contract.ENV_PREFLIGHT):
        spec_of(bad)


def test_the_checks_run_again_only_after_a_hardware_class_failure():
    assert preflight.hardware_class("worker local rank 0 died", [-signal.SIGBUS, None])
    assert preflight.hardware_class("coordinator declared the replica failed: SilentDataCorruption: ...", [])
    assert preflight.hardware_class("coordinator declared the replica failed: FailSlow: 2.0x", [])
    assert not preflight.hardware_class("worker local rank 0 exited with code 1", [1])
    assert not preflight.hardware_class("coordinator declared the replica failed: Hang: ...", [-signal.SIGKILL])


def test_the_answer_becomes_the_termination_message():
    passed = json.dumps({"passed": True, "checks": [{"name": "compute", "passed": True}]})
    assert preflight._failure(0, passed) is None
    failed = json.dumps({"passed": False, "checks": [
        {"name": "compute", "passed": False, "message": "compute: max relative error 0.5 (expected <= 1e-04)"},
        {"name": "memory", "passed": True, "message": "memory: 0 wrong"}]})
    assert preflight._failure(contract.EXIT_PREFLIGHT_FAILED, failed) == (
        "PreflightFailed: compute: max relative error 0.5 (expected <= 1e-04)")
    # No answer (a crash of the checks themselves) is a failure too, never a pass.
    assert preflight._failure(1, "Traceback ...").startswith("PreflightFailed: `transom check` exited 1")
    assert preflight._failure(0, "") is not None


def test_a_store_or_a_peer_that_fails_is_told_but_fails_no_pod():
    """A checkpoint store that is down would fail every new pod on every node: the node is
    not to blame, so the launcher logs it and starts its workers."""
    answer = {"passed": False, "checks": [
        {"name": "compute", "passed": True, "message": "compute: ok"},
        {"name": "storage", "passed": False, "message": "storage: s3://b/x: connection refused"},
        {"name": "link", "passed": False, "message": "link: peer unreachable"}]}
    assert preflight._failure(contract.EXIT_PREFLIGHT_FAILED, json.dumps(answer)) is None
    answer["checks"][0] = {"name": "memory", "passed": False, "message": "memory: 3 wrong"}
    assert preflight._failure(contract.EXIT_PREFLIGHT_FAILED, json.dumps(answer)) == "PreflightFailed: memory: 3 wrong"


class _FakeCheck:
    """Stands in for a `transom check` child: answers once `answers` is set; records stops."""

    made: list[_FakeCheck] = []

    def __init__(self, spec, env, environ, run_index, peer=None):  # noqa: ANN001 (Check's signature)
        self.run_index, self.answer, self.stopped = run_index, None, False
        _FakeCheck.made.append(self)

    def poll(self) -> tuple[bool, str | None]:
        return (self.answer is not None, self.answer or None)

    def stop(self) -> None:
        self.stopped = True


def test_a_waiting_spare_is_checked_every_interval_and_a_promotion_stops_a_check_in_flight(monkeypatch):
    monkeypatch.setattr(preflight, "Check", _FakeCheck)
    _FakeCheck.made = []
    now = [100.0]
    periodic = preflight.Periodic(PreflightSpec(checks=("compute",), spare_interval_s=60), env=None,
                                  environ={}, runs=1, clock=lambda: now[0])
    assert periodic.poll() is None and _FakeCheck.made == []  # not before the interval
    now[0] = 160.0
    assert periodic.poll() is None and [c.run_index for c in _FakeCheck.made] == [1]  # started, run index 1
    assert periodic.poll() is None  # still running
    _FakeCheck.made[0].answer = ""  # passed
    assert periodic.poll() is None and _FakeCheck.made[0].stopped and periodic.current is None
    now[0] = 219.0
    assert periodic.poll() is None and len(_FakeCheck.made) == 1  # the next one 60 s after the answer
    now[0] = 220.0
    periodic.poll()
    _FakeCheck.made[1].answer = "PreflightFailed: memory: 3 mismatching elements"
    assert periodic.poll() == "PreflightFailed: memory: 3 mismatching elements"
    now[0] = 400.0
    periodic.poll()  # a third one starts...
    periodic.stop()  # ... and the spare is promoted
    assert _FakeCheck.made[2].stopped and periodic.current is None
    now[0] = 10_000.0
    assert periodic.poll() is None and len(_FakeCheck.made) == 3  # never again once stopped


def test_a_spare_interval_of_zero_checks_a_waiting_spare_never(monkeypatch):
    monkeypatch.setattr(preflight, "Check", _FakeCheck)
    _FakeCheck.made = []
    periodic = preflight.Periodic(PreflightSpec(checks=("compute",), spare_interval_s=0), env=None,
                                  environ={}, runs=0, clock=lambda: 1e9)
    assert periodic.poll() is None and _FakeCheck.made == []
