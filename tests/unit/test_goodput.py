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


def test_the_clock_stops_when_the_job_completes():
    g = GoodputClock()
    for k in range(11):
        g.observe(float(k), k)
    g.finish(10.0)
    # After the last step nothing is left to train: a late joiner's rounds and the time until
    # every replica left are no time of the job's.
    g.observe(15.0, 10)
    g.observe(18.0, 10)
    assert g.value(10.0) == g.value(28.0) == pytest.approx(1.0)
    g.finish(30.0)  # a second completion report changes nothing
    assert g.value(40.0) == pytest.approx(1.0)


def test_a_completed_jobs_goodput_does_not_fall_while_a_replica_catches_up_and_leaves():
    """The run issue 34 saw: goodput 0.954 at step 600, 0.358 18 s later while the killed
    replica relaunched, rejoined and left. Through the membership, as the coordinator runs it."""
    from membership_world import ident, next_round, started
    from transom.coordinator.models import LeaveRequest

    m, d = started(2)
    for step in range(1, 11):
        d = next_round(m, d, [0, 1], float(step), step)
    m.leave(LeaveRequest(identity=ident(0), step=10, completed=True), 10.5)
    done = m.goodput.value(10.5)
    assert done is not None and done > 0.9
    assert m.goodput.value(28.5) == done and m.status(28.5).goodput == done
