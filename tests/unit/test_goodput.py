"""Goodput accounting of the coordinator (transom.coordinator.goodput)."""

from __future__ import annotations

import pytest

from transom.coordinator.goodput import GoodputClock, as_decimal


def test_steady_training_is_all_goodput():
    g = GoodputClock()
    for k in range(11):
        g.observe(float(k), k)
    assert g.value(10.0) == pytest.approx(1.0)


def test_failed_steps_and_pauses_are_lost_time():
    g = GoodputClock()
    for k in range(5):  # steps 0..4, one second each
        g.observe(float(k), k)
    g.observe(5.0, 4)  # step 4 failed: round 5 starts again from 4
    g.observe(6.0, 4)  # and again (a pause below minReplicas)
    g.observe(7.0, 5)  # it went through: one more productive second
    # 5 productive seconds (0->1 .. 3->4, 6->7) out of 7.
    assert g.value(7.0) == pytest.approx(5 / 7)


def test_a_long_stall_before_a_commit_counts_as_lost_beyond_a_few_steps():
    g = GoodputClock(stall_factor=3.0)
    for k in range(5):
        g.observe(float(k), k)
    g.observe(34.0, 5)  # a 30 s collective timeout, then the survivors committed
    assert g.value(34.0) == pytest.approx((4 + 3) / 34)


def test_no_value_before_a_step_was_committed():
    g = GoodputClock()
    assert g.value(1.0) is None
    g.observe(0.0, 0)
    assert g.value(1.0) is None


@pytest.mark.parametrize("value, text", [(0.0, "0.000"), (0.9304, "0.930"), (1.0, "1.000"), (1.2, "1.000")])
def test_decimal_string_fits_the_crd_pattern(value, text):
    assert as_decimal(value) == text
