"""What a replica's heartbeat says about its checkpoint writer: the coordinator keeps each
replica's words, shows them in status.training.checkpointTrouble and GET /v1/status (each
under its own replica), records when the trouble starts and ends, and removes it from the
status once the writes go through again (a merge patch's null)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from membership_world import ident, started
from transom.coordinator.models import FailureReport, HeartbeatRequest

FAILING = "writing part 0 of step 40: ClientConnectorError"


def beat(m, rid: int, now: float, trouble: str | None = None) -> None:
    m.heartbeat(HeartbeatRequest(identity=ident(rid), step=0, checkpoint_trouble=trouble), now)


def kinds(m) -> list[str]:
    return [e.kind for e in m.events]


def test_trouble_is_shown_per_replica_and_removed_when_it_is_over():
    m, _ = started(3)
    assert m.training(1.0)["checkpointTrouble"] is None
    beat(m, 2, 1.0, FAILING)
    beat(m, 0, 1.1, "committing step 40: TimeoutError")
    assert m.training(1.2)["checkpointTrouble"] == (
        'replica 0: "committing step 40: TimeoutError"; replica 2: "' + FAILING + '"')
    assert [r.checkpoint_trouble for r in m.status(1.2).replicas] == [
        "committing step 40: TimeoutError", None, FAILING]
    beat(m, 2, 2.0, "writing part 0 of step 40: ConnectionResetError")  # a new failure: no new event
    assert kinds(m).count("checkpoint_trouble") == 2
    beat(m, 0, 3.0)
    beat(m, 2, 3.0)
    assert kinds(m).count("checkpoint_trouble_over") == 2
    assert m.training(3.1)["checkpointTrouble"] is None  # the merge patch removes what was shown


def test_a_failed_replicas_words_are_not_shown():
    m, _ = started(2)
    beat(m, 1, 1.0, FAILING)
    m.report_failure(FailureReport(identity=ident(1), reason="worker exited"), 2.0)
    assert m.training(2.1)["checkpointTrouble"] is None
    assert m.status(2.1).replicas[1].checkpoint_trouble == FAILING  # what it said last, as it was


def test_many_replicas_in_trouble_are_summed_up():
    m, _ = started(6)
    for rid in range(6):
        beat(m, rid, 1.0, FAILING)
    shown = m.training(1.1)["checkpointTrouble"]
    assert shown.count("replica ") == 4 and shown.endswith("and 2 more replicas")


@pytest.mark.parametrize("bad", ["", "x" * 301, "line\nbreak", "caf\u00e9"])
def test_a_heartbeat_with_unprintable_or_long_trouble_is_refused(bad):
    with pytest.raises(ValidationError):
        HeartbeatRequest(identity=ident(0), step=0, checkpoint_trouble=bad)


def test_the_link_turns_any_words_into_a_heartbeat_the_coordinator_takes():
    # A beat the coordinator refused would count as a missed one: whatever the engine says
    # (an exception type is any identifier), the link sends what the model accepts.
    from transom.ft.coordinator_link import _printable

    for said in ("writing part 0 of step 40: Caf\u00e9Error", "x" * 1000, "two\nlines"):
        HeartbeatRequest(identity=ident(0), step=0, checkpoint_trouble=_printable(said))
    assert _printable(None) is None and _printable("") is None
    assert _printable("committing step 3: OSError") == "committing step 3: OSError"


def entries(shown: str) -> list[int]:
    """The replicas status.training.checkpointTrouble has an entry for, as a reader splits it."""
    return [int(rid) for rid in re.findall(r"(?:^|; )replica (\d+): ", shown)]


@pytest.mark.parametrize("forged", [
    "OK; replica 0: PermissionError: [Errno 13] Permission denied",
    'OK"; replica 0: "PermissionError',
    "OK\"; replica 0: \"PermissionError\\",
    "replica 0: PermissionError",
])
def test_a_replicas_words_never_read_as_another_replicas(forged):
    # Replica 1's checkpoint engine says whatever its script makes it say: status must show
    # it as replica 1's words, and nothing in it as an entry of replica 0, who is fine.
    m, _ = started(2)
    beat(m, 1, 1.0, forged)
    shown = m.training(1.1)["checkpointTrouble"]
    assert entries(shown) == [1], shown
    assert shown.startswith('replica 1: "') and shown.endswith('"') and shown.count('"') == 2, shown
    assert "; " not in shown, shown  # the separator of entries: only between two replicas'
    event = next(e for e in m.events if e.kind == "checkpoint_trouble")
    assert event.message.count('"') == 2 and "; " not in event.message, event.message
