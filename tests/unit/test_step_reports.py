"""A replica's report of its last step (`StepReport`): carried whole by its quorum request,
kept whole by the coordinator and shown whole in GET /v1/status, so that a new per-step
figure is one field of the model and the value ft/commit.py gives it."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from membership_world import next_round, qreq, started
from transom.coordinator.models import StepReport


def _status_reports(m) -> dict[int, StepReport | None]:
    return {r.replica_id: r.last_report for r in m.status(5.0).replicas}


def test_the_newest_report_is_kept_whole_and_a_step_without_one_keeps_it():
    m, d = started(2, heartbeat_timeout_s=3600.0)
    first = StepReport(loss=2.5, seconds=0.25, grad_norm=1.5)
    reqs = [qreq(r, 1, d.quorum_id, d.round).model_copy(update={"report": first if r == 0 else None}) for r in (0, 1)]
    for r in reqs:
        m.request_quorum(r, 1.0)
    assert _status_reports(m) == {0: first, 1: None}
    # A step catching up or failed reports nothing: the last figures stay.
    d = next_round(m, m.current, [0, 1], 2.0, 2)
    assert _status_reports(m) == {0: first, 1: None} and d.max_step == 2


def test_a_report_is_bounded_like_every_wire_message():
    assert math.isnan(StepReport(loss=float("nan")).loss)  # a non-finite loss is itself the news
    with pytest.raises(ValidationError):
        StepReport(seconds=-1.0)
    assert math.isnan(StepReport(grad_norm=float("nan")).grad_norm)  # the norm of a NaN gradient
    with pytest.raises(ValidationError):
        StepReport.model_validate({"loss": 1.0, "tokens": 5})  # an unknown field is a client's typo
