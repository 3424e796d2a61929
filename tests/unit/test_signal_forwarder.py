"""The launcher's forwarding of step rows and its hang watchdog (launch/signal_forwarder.py), on real files."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest

from transom.collective_counts import CollectiveCounter
from transom.coordinator.models import DuplicateDataFinding, Identity, SignalAnswer
from transom.detect.step_rows import DetectionSettings, Signal, write_trace
from transom.errors import CoordinatorError
from transom.launch.signal_forwarder import SignalForwarder

ME = Identity(replica_id=1, generation=2, attempt=0)
FILE = "signals-r1-g2-a0-k0.csv"


class FakeClient:
    def __init__(self, fail: int | None = None, pace: float = 1.0):
        self.batches: list = []
        self.fail, self.pace = fail, pace
        self.duplicate_data: DuplicateDataFinding | None = None

    def report_signals(self, batch, timeout_s: float) -> SignalAnswer:
        if self.fail is not None:
            raise CoordinatorError("refused", self.fail)
        self.batches.append(batch)
        return SignalAnswer(verdicts=0, next_post_s=self.pace, duplicate_data=self.duplicate_data)


def rows(*steps: int, header: bool = False) -> str:
    out = io.StringIO(newline="")
    write_trace([Signal(step=s, replica=1, rank=0, step_seconds=0.5, loss=1.0) for s in steps], out, header=header)
    return out.getvalue()


def write(path: Path, text: str) -> None:
    with open(path, "a", newline="") as f:
        f.write(text)


def test_rows_are_forwarded_at_most_once_a_second_and_a_partial_line_waits(tmp_path):
    client = FakeClient()
    fw = SignalForwarder(tmp_path, ME, 0, [0], client, DetectionSettings())
    third = rows(2)
    write(tmp_path / FILE, rows(0, 1, header=True) + third[:5])  # the third row is being written
    fw.poll(100.0)
    write(tmp_path / FILE, third[5:])
    fw.poll(100.5)  # within the second: held
    assert [[r.step for r in b.rows] for b in client.batches] == [[0, 1]]
    fw.poll(101.1)
    assert [[r.step for r in b.rows] for b in client.batches] == [[0, 1], [2]]
    assert all(b.identity == ME for b in client.batches)


def test_a_worker_without_progress_is_hung_unless_it_waits_for_others(tmp_path):
    fw = SignalForwarder(tmp_path, ME, 0, [0], FakeClient(), DetectionSettings(hang_timeout_s=10))
    assert fw.poll(0.0) is None  # no row yet: the clock has not started (imports, restore)
    write(tmp_path / FILE, rows(0, 1, 2, header=True))
    assert fw.poll(1.0) is None
    (tmp_path / "waiting-r1-g2-a0-k0").write_bytes(b"1")
    assert fw.poll(30.0) is None  # waiting for its quorum or a peer: bounded by those timeouts
    (tmp_path / "waiting-r1-g2-a0-k0").write_bytes(b"0")
    assert fw.poll(35.0) is None
    hang = fw.poll(40.5)
    assert hang is not None and (hang.rank, hang.step) == (0, 3) and hang.stalled_s >= 10


def test_rows_of_an_incarnation_the_coordinator_dropped_are_discarded_others_kept(tmp_path):
    write(tmp_path / FILE, rows(0, header=True))
    away = FakeClient(fail=503)
    fw = SignalForwarder(tmp_path, ME, 0, [0], away, DetectionSettings())
    fw.poll(0.0)
    assert len(fw._buffer) == 1  # the coordinator is away: kept for later
    fw.client = FakeClient(fail=409)
    fw.flush()
    assert fw._buffer == []  # evicted: nobody will judge these rows


def test_the_forwarder_keeps_the_pace_the_coordinator_asks_for_within_bounds(tmp_path):
    client = FakeClient(pace=12.5)
    fw = SignalForwarder(tmp_path, ME, 0, [0], client, DetectionSettings())
    write(tmp_path / FILE, rows(0, header=True))
    fw.poll(100.0)
    write(tmp_path / FILE, rows(1))
    fw.poll(105.0)  # asked to wait 12.5 s
    assert [[r.step for r in b.rows] for b in client.batches] == [[0]]
    fw.poll(112.6)
    assert [[r.step for r in b.rows] for b in client.batches] == [[0], [1]]
    for asked, kept in ((0.01, 1.0), (1e9, 30.0)):  # bounded
        client.pace = asked
        write(tmp_path / FILE, rows(2))
        fw.poll(1000.0 + len(client.batches) * 100)
        assert fw.interval_s == kept


def test_any_bytes_in_a_workers_file_are_skipped_counted_and_warned_about_once_a_minute(tmp_path, caplog):
    """The launcher used to die (exit 1: a new generation instead of an in-place restart) on
    bytes that are not UTF-8 or on a cell past csv's 128 KiB limit in its worker's file."""
    client = FakeClient()
    fw = SignalForwarder(tmp_path, ME, 0, [0], client, DetectionSettings())
    garbage = [b"\xff\xfe not utf-8\n", b"1,1,0,0.5," + b"9" * 200_000 + b",,,,,,,,\n", b"1,1,0,0.5,nan,,,,,,,,\n",
               b"1,1,-1,0.5,,,,,,,,,\n", b"1,1,2097152,0.5,,,,,,,,,\n",  # a rank id past what the coordinator takes
               b"1,1,0\n"]
    with open(tmp_path / FILE, "ab") as f:
        f.write(rows(0, header=True).encode() + b"".join(garbage) + rows(1).encode())
    with caplog.at_level("WARNING", logger="transom.launch"):
        fw.poll(100.0)
        write(tmp_path / FILE, "\x00garbage again\n" + rows(2))
        fw.poll(110.0)  # within the minute: counted, not logged again
        fw.poll(161.0)
    assert [[r.step for r in b.rows] for b in client.batches] == [[0, 1], [2]]
    warnings = [r.getMessage() for r in caplog.records if "malformed signal row" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "skipped 6 malformed signal row(s)" in warnings[0] and "(7 in all" in warnings[1]


def test_the_finding_that_replicas_train_on_the_same_data_is_logged_once(tmp_path, caplog):
    client = FakeClient()
    fw = SignalForwarder(tmp_path, ME, 0, [0], client, DetectionSettings())
    write(tmp_path / FILE, rows(0, header=True))
    with caplog.at_level("WARNING", logger="transom.launch"):
        fw.poll(100.0)  # no finding yet
        client.duplicate_data = DuplicateDataFinding(step=0, replicas=[0, 1], message="replicas 0 and 1 ...")
        for t in (102.0, 104.0):
            write(tmp_path / FILE, rows(int(t)))
            fw.poll(t)
    assert len(client.batches) == 3
    assert [r.getMessage() for r in caplog.records] == ["duplicate data: replicas 0 and 1 ..."]


def test_collective_counts_go_with_the_posts_when_they_changed_and_all_with_a_hang(tmp_path):
    """The workers' counts (transom/collective_counts.py) travel without rows too, once a row
    has gone: a hung replica's ranks write no rows, and their counts are what name the rank a
    hang waits for."""
    client = FakeClient()
    fw = SignalForwarder(tmp_path, ME, 0, [0], client, DetectionSettings(hang_timeout_s=10))
    counter = CollectiveCounter()
    counter.attach(tmp_path / "collectives-r1-g2-a0-k0")
    counter.new_group(3)
    counter.ftar_entered()
    fw.poll(99.0)  # no row yet: an incarnation's first post is its first row (coordinator/detection.py)
    assert client.batches == []
    write(tmp_path / FILE, rows(0, header=True))
    fw.poll(100.0)
    (batch,) = client.batches
    assert [r.step for r in batch.rows] == [0]
    assert [(c.rank, c.group_id, c.ftar_entered, c.ftar_completed) for c in batch.collectives] == [(0, 3, 1, 0)]
    fw.poll(101.5)  # unchanged: no post
    assert len(client.batches) == 1
    counter.ftar_completed()
    fw.poll(103.0)
    assert client.batches[-1].rows == [] and [c.ftar_completed for c in client.batches[-1].collectives] == [1]
    write(tmp_path / FILE, rows(1))
    (tmp_path / "stacks-r1-g2-a0-k0.txt").write_text("Thread 1 (most recent call first):\n")
    fw.poll(104.5)
    assert client.batches[-1].collectives == []  # the row went alone: the counts did not change
    hang = fw.poll(115.0)
    assert hang is not None
    fw.report_hang(hang, [])
    last = client.batches[-1]
    assert last.stacks and [c.ftar_completed for c in last.collectives] == [1]  # sent again, with the stacks
    counter.detach()


def returns_within(seconds: float, call, unblock: list[Path]):
    """`call()`'s value if it returns within `seconds`; else the FIFOs in `unblock` are opened
    for writing (which lets a reader stuck in open() go on, so no thread is left behind) and
    the test fails."""
    done: list = []
    t = threading.Thread(target=lambda: done.append(call()), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for fifo in unblock:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail(f"blocked for more than {seconds}s on a worker's file")
    return done[0]


@pytest.mark.parametrize("name", [FILE, "collectives-r1-g2-a0-k0", "waiting-r1-g2-a0-k0", "stacks-r1-g2-a0-k0.txt"])
def test_a_fifo_in_place_of_a_workers_file_never_blocks_the_launcher(tmp_path, caplog, name):
    """A worker that replaced a file with a FIFO froze the supervisor's only loop thread in
    open(): a crash after that was never restarted (issue 43, item 2)."""
    client = FakeClient()
    fw = SignalForwarder(tmp_path, ME, 0, [0], client, DetectionSettings(hang_timeout_s=10))
    if name != FILE:
        write(tmp_path / FILE, rows(0, header=True))
    if name != "stacks-r1-g2-a0-k0.txt":
        (tmp_path / "stacks-r1-g2-a0-k0.txt").write_text("Thread 1 (most recent call first):\n")
    os.mkfifo(tmp_path / name)
    fifos = [tmp_path / name]
    with caplog.at_level("WARNING", logger="transom.launch"):
        for t in (100.0, 101.5, 103.0):
            returns_within(5.0, lambda t=t: fw.poll(t), fifos)
        hang = returns_within(5.0, lambda: fw.poll(120.0), fifos)
        if hang is not None:
            stacks = returns_within(10.0, lambda: fw.report_hang(hang, []), fifos)
            assert "--- rank 0 ---" in stacks
    refused = [r.getMessage() for r in caplog.records if "a FIFO" in r.getMessage()]
    assert len(refused) == 1, refused  # once, not once a poll
