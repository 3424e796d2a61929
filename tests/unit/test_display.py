"""What `transom run` prints (launch/display.py) and the closing table's rows (launch/summary.py)."""

from __future__ import annotations

import io
import json

from transom.launch import display
from transom.launch.display import Display, closing_table, event_line, progress_line
from transom.launch.summary import ReplicaRow, replica_rows


def test_progress_line_shows_step_loss_members_and_pause():
    line = progress_line(42, 1.23456, 2, 3, 7, [0, 2], False, 1)
    assert "step     42" in line and "loss   1.2346" in line
    assert "replicas [#.#] 2/3 healthy" in line and "quorum 7" in line and "restarts 1" in line
    assert "PAUSED" not in line
    assert "PAUSED" in progress_line(0, None, 0, 3, None, [], True, 0)
    assert "loss        -" in progress_line(0, None, 0, 3, None, [], False, 0)


def test_event_line_names_the_kind_in_words():
    assert event_line(3.5, "failed", "replica 1: killed").endswith("FAIL  replica 1: killed")
    assert "quorum  quorum 2" in event_line(1.0, "quorum", "quorum 2: replicas [0, 2] at step 20")


def test_a_pipe_gets_changed_lines_at_most_every_interval_unless_the_shape_changes(monkeypatch):
    out = io.StringIO()
    d = Display(out=out)
    assert not d.live  # a StringIO is no terminal
    clock = [100.0]
    monkeypatch.setattr(display.time, "monotonic", lambda: clock[0])
    d.progress("step 1", ((0, 1, 2), 0, False))
    d.progress("step 2", ((0, 1, 2), 0, False))  # too soon, same shape: not printed
    clock[0] += display.PIPE_INTERVAL_S
    d.progress("step 3", ((0, 1, 2), 0, False))
    d.progress("step 4", ((0, 2), 1, False))  # a replica left: printed at once
    d.progress("step 4", ((0, 2), 1, False))  # unchanged: never printed twice
    printed = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert printed == ["step 1", "step 3", "step 4"]


def test_quiet_prints_nothing():
    out = io.StringIO()
    d = Display(quiet=True, out=out)
    d.say("x")
    d.event("failed", "y")
    d.progress("z", ())
    assert out.getvalue() == ""


def test_replica_rows_count_incarnations_recoveries_and_commits(tmp_path):
    def write(name, records):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))

    write("steps-r0-g0-a0.jsonl", [{"step": s, "committed": True} for s in range(5)])
    write("steps-r1-g0-a0.jsonl", [{"step": 0, "committed": True}, {"step": 1, "committed": False}])
    write("steps-r1-g0-a1.jsonl", [{"step": 3, "committed": True, "recovering": True},
                                   {"step": 4, "committed": True}])
    (tmp_path / "final-r0-k0.json").write_text(json.dumps({"replica": 0, "rank": 0, "step": 5, "digest": "d"}))
    (tmp_path / "final-r1-k0.json").write_text(json.dumps({"replica": 1, "rank": 0, "step": 5, "digest": "d"}))
    rows = replica_rows(tmp_path, 3, {1: "/logs/replica-1.log"})
    assert rows == [
        ReplicaRow(replica=0, incarnations=1, recoveries=0, committed=5, final_step=5, log=None),
        ReplicaRow(replica=1, incarnations=2, recoveries=1, committed=3, final_step=5, log="/logs/replica-1.log"),
        ReplicaRow(replica=2, incarnations=0, recoveries=0, committed=0, final_step=None, log=None),
    ]
    table = closing_table(rows)
    assert table[0].split() == ["replica", "incarnations", "recoveries", "committed", "final", "step", "log"]
    assert table[2].split() == ["1", "2", "1", "3", "5", "/logs/replica-1.log"]
    assert table[3].split() == ["2", "0", "0", "0", "-", "-"]
