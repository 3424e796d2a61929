"""The pure pieces of fencing (ft/fencing.py, coordinator/fencing.py): when an effect may go
ahead, the line a refused one logs, the coordinator's count and its one event per
incarnation and endpoint, and the words for a checkpoint object."""

from __future__ import annotations

import pytest

from transom.checkpoint import layout
from transom.coordinator import fencing as refusals
from transom.coordinator.models import ErrorBody, Identity, IncarnationAnswer
from transom.coordinator.records import Replica
from transom.errors import Evicted, Fenced, TransomError
from transom.ft.fencing import fenced_line, suspect, verdict
from transom.inject import Fault
from transom.words import FailureKind, IncarnationState

OLD = Identity(replica_id=1, generation=0, attempt=0)
NEW = Identity(replica_id=1, generation=1, attempt=0)


@pytest.mark.parametrize("fenced, answer, elapsed_s, expected", [
    (None, "current", 0.01, "go"),
    (None, "current", 4.9, "go"),
    (None, "current", 5.1, "unconfirmed"),  # came back after a stop longer than a question may take
    (None, "none", 0.01, "unconfirmed"),  # the coordinator is away: nothing is written yet
    (None, "refused", 0.01, "fenced"),
    (None, "refused", 60.0, "fenced"),
    ("superseded", "current", 0.01, "fenced"),  # a restarted coordinator that forgot: still fenced
    ("failed", "none", 0.01, "fenced"),
])
def test_an_effect_goes_ahead_only_on_a_timely_yes_for_an_incarnation_never_refused(fenced, answer, elapsed_s,
                                                                                      expected):
    assert verdict(fenced, answer, elapsed_s, timeout_s=5.0) == expected


@pytest.mark.parametrize("vouched_at, now, expected", [(None, 0.0, True), (10.0, 12.9, False), (10.0, 13.1, True)])
def test_a_process_not_vouched_for_within_the_lease_is_suspect(vouched_at, now, expected):
    assert suspect(vouched_at, now, lease_s=3.0) is expected


def test_the_fenced_line_names_the_incarnation_its_state_and_what_did_not_happen():
    assert fenced_line(OLD, "superseded", "checkpoint part 1 of step 10 not written") == \
        "fenced: replica 1 generation 0 attempt 0 was superseded; checkpoint part 1 of step 10 not written"
    assert fenced_line(OLD, "failed", "step 7 not committed") == \
        "fenced: replica 1 generation 0 attempt 0 was declared failed; step 7 not committed"
    assert fenced_line(OLD, "evicted", "state not served").endswith("attempt 0 was evicted; state not served")


@pytest.mark.parametrize("path, words", [
    ("step-000000000010/attempt-0123456789abcdef/part-1/__0_0.distcp", "checkpoint part 1 of step 10"),
    ("step-000000000010/attempt-0123456789abcdef/part-1/checksums.json", "checksums of checkpoint part 1 of step 10"),
    ("step-000000000010/attempt-0123456789abcdef/part-3/skipped", "skipped marker of checkpoint part 3 of step 10"),
    ("step-000000000010/.metadata", "index (.metadata) of step 10"),
    ("step-000000000010/manifest.json", "manifest of step 10"),
    ("step-000000000008", "checkpoint of step 8"),
    ("elsewhere/x", "elsewhere/x"),
])
def test_checkpoint_objects_are_named_in_words(path, words):
    assert layout.describe(path) == words


def test_every_refusal_is_counted_and_each_incarnation_told_once_per_endpoint():
    r = refusals.Refusals()
    assert r.record("/v1/quorum", OLD) is True
    assert r.record("/v1/quorum", OLD) is False
    assert r.record("/v1/fence", OLD) is True  # another endpoint: what else it tried is told too
    assert r.record("/v1/quorum", NEW) is True
    assert r.counts == {"/v1/quorum": 3, "/v1/fence": 1}
    assert r.endpoints()[:len(refusals.ENDPOINTS)] == list(refusals.ENDPOINTS)


def test_what_is_remembered_as_told_is_bounded(monkeypatch):
    monkeypatch.setattr(refusals, "MAX_TOLD", 3)
    r = refusals.Refusals()
    for g in range(5):
        r.record("/v1/quorum", Identity(replica_id=0, generation=g, attempt=0))
    assert len(r._told) == 3 and r.counts["/v1/quorum"] == 5
    assert r.record("/v1/quorum", Identity(replica_id=0, generation=0, attempt=0)) is True  # forgotten: told again


def test_the_refusal_event_says_who_was_refused_where_and_why():
    superseded = IncarnationAnswer(replica_id=1, state="superseded")
    assert refusals.refusal_message(OLD, "/v1/quorum", superseded, NEW) == \
        "refused replica 1 generation 0 attempt 0 on /v1/quorum: superseded by generation 1 attempt 0"
    assert refusals.refusal_message(OLD, "/v1/fence", superseded, NEW, "write checkpoint part 1 of step 10") == \
        ("refused replica 1 generation 0 attempt 0 on /v1/fence (write checkpoint part 1 of step 10): "
         "superseded by generation 1 attempt 0")
    failed = IncarnationAnswer(replica_id=1, state="failed", reason="no heartbeat for 3.2s")
    assert refusals.refusal_message(OLD, "/v1/heartbeat", failed, OLD) == \
        "refused replica 1 generation 0 attempt 0 on /v1/heartbeat: declared failed: no heartbeat for 3.2s"


def test_a_refusal_is_told_unless_the_incarnation_reported_its_own_failure():
    def record(identity: Identity, state: str, kind: FailureKind | None) -> Replica:
        return Replica(identity=identity, store_addr="", state_endpoints=[], state=IncarnationState(state),
                       failure_kind=kind)

    # Its worker or launcher said it failed: its launcher's last signal rows are no zombie's.
    assert refusals.told(OLD, record(OLD, "failed", FailureKind.REPORTED)) is False
    # Declared failed without its word (it may not know), or replaced: a zombie if it acts.
    for kind in (FailureKind.HEARTBEAT, FailureKind.HUNG, FailureKind.DETECTED, FailureKind.DIVERGED):
        assert refusals.told(OLD, record(OLD, "failed", kind)) is True
    assert refusals.told(OLD, record(NEW, "healthy", None)) is True
    assert refusals.told(OLD, record(NEW, "failed", FailureKind.REPORTED)) is True  # the newer one reported
    assert refusals.told(OLD, None) is True


def test_an_eviction_carries_the_state_the_coordinator_said_and_a_fenced_effect_is_an_eviction():
    assert Evicted("x", 409, state="superseded").state == "superseded"
    assert Evicted("x", 409, state="nonsense").state is None and Evicted("x").state is None
    assert issubclass(Fenced, Evicted) and issubclass(Fenced, TransomError) and Fenced("x").status == 409
    assert ErrorBody(error="x", state="failed").state == "failed"
    assert "state" not in ErrorBody(error="x").model_dump_json(exclude_none=True)


def test_a_process_can_be_stopped_in_the_middle_of_a_checkpoint():
    fault = Fault.parse("stop:step=10,phase=checkpoint")
    assert (fault.action, fault.step, fault.phase) == ("stop", 10, "checkpoint")


class _NotFound:
    """An HTTP server that answers every POST 404 with `body`: a coordinator older than
    fencing (aiohttp's own answer for a path without a route), or something in between."""

    def __init__(self, body: bytes, content_type: str = "text/plain"):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(404)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> _NotFound:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.thread.join(timeout=5)
        self.server.server_close()


def test_a_coordinator_older_than_fencing_lets_writes_go_ahead_with_one_warning(caplog):
    """The operator's coordinator image may lag the script's transom: a coordinator without
    /v1/fence answers its web server's own 404 (not the coordinator's JSON one), and the
    checkpoint is written unfenced rather than never (seen in make chaos with such a skew)."""
    from transom.coordinator.client import ROUTE_NOT_FOUND, CoordinatorClient
    from transom.ft.fencing import IncarnationFence

    with _NotFound(ROUTE_NOT_FOUND) as old:
        fence = IncarnationFence(CoordinatorClient(old.url, "t"), OLD)
        with caplog.at_level("WARNING", logger="transom.ft"):
            fence.confirm("write", "checkpoint part 1 of step 10")
            fence.confirm("write", "manifest of step 10")
        assert fence.fenced is None
        assert sum("predates fencing" in r.message for r in caplog.records) == 1


def test_a_404_page_from_something_in_between_is_no_answer_and_nothing_is_written():
    from transom.coordinator.client import CoordinatorClient
    from transom.errors import CoordinatorError
    from transom.ft.fencing import IncarnationFence

    with _NotFound(b"<html><body>404 page not found</body></html>", "text/html") as proxy:
        fence = IncarnationFence(CoordinatorClient(proxy.url, "t"), OLD)
        with pytest.raises(CoordinatorError, match="not written yet"):
            fence.confirm("write", "checkpoint part 1 of step 10")
        assert fence.fenced is None  # not fenced for ever: asked again later
