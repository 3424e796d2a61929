"""`transom run --end-on`: which events end a local job, and when (launch/end_on.py)."""

from __future__ import annotations

import pytest

from transom.coordinator.models import Event
from transom.launch.config import RunConfig
from transom.launch.end_on import Awaited, EndOn


def ev(kind: str, replica: int | None = None) -> Event:
    return Event(time=0.0, kind=kind, message="", replica=replica)


@pytest.mark.parametrize("text,kind,replica", [("caught_up:1", "caught_up", 1), ("verdict", "verdict", None),
                                               ("resumed", "resumed", None)])
def test_an_awaited_event_is_a_known_kind_and_maybe_a_replica(text, kind, replica):
    a = Awaited.parse(text)
    assert (a.kind, a.replica, str(a)) == (kind, replica, text)


@pytest.mark.parametrize("text,message", [("caught-up", "unknown event kind"), ("", "unknown event kind"),
                                          ("caught_up:x", "replica index"), ("caught_up:-1", "replica index"),
                                          ("caught_up:\u00b9", "replica index")])
def test_a_wrong_event_is_refused_saying_why(text, message):
    with pytest.raises(ValueError, match=message):
        Awaited.parse(text)


def test_the_job_ends_a_margin_after_the_last_of_its_events():
    end = EndOn([Awaited.parse("caught_up:1"), Awaited.parse("caught_up:2")], margin_steps=3)
    end.observe([ev("caught_up", 2), ev("caught_up", 0), ev("failed", 1)])
    assert not end.met and end.due(40) is None
    assert end.summary()["waiting_for"] == ["caught_up:1"]
    end.observe([ev("caught_up", 1)])
    assert end.met and end.due(41) == 44
    end.asked(45)  # the coordinator may end it later than asked (the job was past 44)
    assert end.due(50) is None
    assert end.summary() == {"events": ["caught_up:1", "caught_up:2"], "met": True, "waiting_for": [],
                             "end_step": 45}


def test_a_run_with_nothing_awaited_never_ends_early():
    end = EndOn([], margin_steps=3)
    end.observe([ev("caught_up", 1)])
    assert not end.met and end.due(10) is None


def test_run_config_refuses_an_event_of_a_replica_it_does_not_have():
    with pytest.raises(ValueError, match="names replica 3"):
        RunConfig(command=["true"], replicas=3, end_on=[Awaited.parse("caught_up:3")])
    with pytest.raises(ValueError, match="end_margin"):  # a ValidationError; the CLI names the flag (flags.py)
        RunConfig(command=["true"], replicas=3, end_margin=-1)
