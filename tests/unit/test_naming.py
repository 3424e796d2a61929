"""Deterministic child names: the table of what each object of a job is called."""

from __future__ import annotations

import pytest

from transom_operator import api, naming

JOB40 = "j" * api.MAX_JOB_NAME


@pytest.mark.parametrize("fn, args, expected", [
    (naming.worker_pod, ("demo", 0, 0, 0), "demo-r0-n0-g0"),
    (naming.worker_pod, ("demo", 3, 1, 7), "demo-r3-n1-g7"),
    (naming.worker_pod, (JOB40, 1023, 4095, 99999), f"{JOB40}-r1023-n4095-g99999"),
    (naming.spare_pod, ("demo", 1, 2, 3), "demo-s1-n2-g3"),
    (naming.coordinator, ("demo",), "demo-coordinator"),
    (naming.coordinator_token_secret, ("demo",), "demo-coordinator-token"),
    (naming.worker_service_account, ("demo",), "demo-worker"),
    (naming.worker_service_account, (JOB40,), f"{JOB40}-worker"),
    (naming.coordinator_token_secret, (JOB40,), f"{JOB40}-coordinator-token"),
    (naming.coordinator_url, ("demo", "ml"), "http://demo-coordinator.ml.svc:8080"),
])
def test_names(fn, args, expected):
    assert fn(*args) == expected
    if fn is not naming.coordinator_url:
        assert len(expected) <= naming.DNS_LABEL_MAX


def test_worker_names_are_distinct_per_identity():
    names = {naming.worker_pod("a", r, n, g) for r in range(12) for n in range(12) for g in range(12)}
    assert len(names) == 12 ** 3


@pytest.mark.parametrize("args", [
    ("demo", -1, 0, 0), ("demo", 0, -1, 0), ("demo", 0, 0, -1),
    (JOB40, 1023, 4095, api.MAX_GENERATION),  # 64 characters: refused, never truncated
])
def test_bad_worker_names_raise(args):
    with pytest.raises(ValueError):
        naming.worker_pod(*args)
