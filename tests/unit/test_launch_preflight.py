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
