"""Traces and workers' signals files are written by user code: any bytes are read without a
traceback, a line that is no row is skipped and counted, and the rest is read on
(transom/detect/step_rows.py `TraceParser`, `transom detect replay`)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from transom.detect.step_rows import MAX_LINE_BYTES, Signal, TraceParser, read_trace, write_trace

HEADER = (b"step,replica,rank,step_seconds,tokens,sum_len_sq,loss,grad_norm,finite,fingerprint,recovery,batch_share,"
          b"input_digest\n")
# One of each kind of line that is no row; each used to raise, or to be taken as it was.
MALFORMED = {
    "a cell past csv's 131,072-character limit": b"1,0,0,0.5," + b"9" * 200_000 + b",,,,,,,,\n",
    "bad UTF-8": b"1,0,0,0.5,\xff\xfe,,,,,,,,\n",
    "NaN tokens": b"1,0,0,0.5,nan,,,,,,,,\n",
    "infinite tokens": b"1,0,0,0.5,inf,,,,,,,,\n",
    "NaN sum_len_sq": b"1,0,0,0.5,8,NaN,,,,,,,\n",
    "a negative step": b"-1,0,0,0.5,,,,,,,,,\n",
    "a negative replica": b"1,-3,0,0.5,,,,,,,,,\n",
    "a negative rank": b"1,0,-2,0.5,,,,,,,,,\n",
    "a step past 2^62": b"99999999999999999999,0,0,0.5,,,,,,,,,\n",
    "too few cells": b"1,0,0\n",
    "too many cells": b"1,0,0,0.5,,,,,,,,,,,\n",
    "a finite flag that is neither 0 nor 1": b"1,0,0,0.5,,,,,yes,,,,\n",
    "a fingerprint past 64 bits": b"1,0,0,0.5,,,,,,99999999999999999999999,,,\n",
    "NUL bytes": b"1,0\x00,0,0.5,,,,,,,,,\n",
    "an input digest past 64 bits": b"1,0,0,0.5,,,,,,,,,-99999999999999999999\n",
}


def _good(step: int, replica: int = 0, loss: float = 1.0) -> bytes:
    out = io.StringIO(newline="")
    write_trace([Signal(step=step, replica=replica, rank=0, step_seconds=0.5, loss=loss)], out, header=False)
    return out.getvalue().encode()


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_each_kind_of_malformed_line_is_skipped_and_counted_and_the_next_row_is_read(tmp_path, kind):
    path = tmp_path / "trace.csv"
    path.write_bytes(HEADER + _good(0) + MALFORMED[kind] + _good(1))
    parser = TraceParser()
    assert [s.step for s in read_trace(path, parser)] == [0, 1]
    assert parser.skipped == 1 and parser.first_skipped[0] == 3  # line 3 of the file


def test_a_non_finite_loss_is_a_row_not_a_malformed_line(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_bytes(HEADER + _good(0, loss=float("nan")) + _good(1, loss=float("inf")))
    parser = TraceParser()
    assert [str(s.loss) for s in read_trace(path, parser)] == ["nan", "inf"] and parser.skipped == 0


def test_a_line_without_end_is_not_kept_in_memory_past_the_bound():
    parser = TraceParser(columns=HEADER.decode().strip().split(","))
    for _ in range(40):  # 2.5 MiB without a newline, in pieces: dropped as it comes
        assert parser.feed(b"7" * 65_536) == []
        assert len(parser._partial) <= MAX_LINE_BYTES
    assert [s.step for s in parser.feed(b"\n" + _good(5))] == [5]
    assert parser.skipped == 1


def test_replay_skips_hostile_rows_reports_how_many_and_judges_the_rest(tmp_path):
    path = tmp_path / "trace.csv"
    rows = b"".join(_good(step, replica) for step in range(30) for replica in range(3))
    path.write_bytes(HEADER + rows + b"".join(MALFORMED.values()) + b"\xff" * 10)  # and a last line cut short
    out = subprocess.run([sys.executable, "-m", "transom", "detect", "replay", str(path), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert json.loads(out.stdout) == {"verdicts": [], "skipped": len(MALFORMED) + 1}
    assert f"skipped {len(MALFORMED) + 1} malformed row(s)" in out.stderr
    text = subprocess.run([sys.executable, "-m", "transom", "detect", "replay", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "no anomalies" in text.stdout and "skipped" in text.stderr


def test_replay_still_refuses_a_file_that_is_no_trace(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\xff\xfe\x00garbage\n1,2,3\n")
    out = subprocess.run([sys.executable, "-m", "transom", "detect", "replay", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not a trace" in out.stderr and "Traceback" not in out.stderr
