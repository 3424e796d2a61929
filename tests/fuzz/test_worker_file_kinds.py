"""Every file a worker controls, fed to every launcher reader of it: none blocks, none crashes.

A worker's script can put anything where the launcher reads its step rows, collective
counts, waiting byte, stacks and ScriptError record (the signals directory), and where
`transom run` reads step records, final digests, signal rows, podinfo labels and
termination messages (the stats directory): a FIFO, a directory, a symbolic link, a
file of a terabyte, bytes of any kind. Each reader must return within a few seconds with
what it makes of it (or nothing), never raise (read_assignment's OSError, documented,
aside), and the launcher's loop must go on (transom/worker_files.py). Arbitrary bytes are
drawn by hypothesis; the kinds of file are all tried on every reader.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import JSON
from transom import collective_counts, script_errors
from transom.coordinator.models import Identity, SignalAnswer
from transom.detect.step_rows import DetectionSettings
from transom.launch import signal_forwarder, spare, summary
from transom.launch.signal_forwarder import SignalForwarder

ME = Identity(replica_id=0, generation=0, attempt=0)
NAME = "r0-g0-a0-k0"
KINDS = ("fifo", "directory", "symlink", "dangling-symlink", "socket", "huge")
BOUND_S = 10.0


class Client:
    def report_signals(self, batch, timeout_s: float) -> SignalAnswer:
        return SignalAnswer(verdicts=0, next_post_s=1.0)


def forwarder_reads(d: Path) -> object:
    fw = SignalForwarder(d, ME, 0, [0], Client(), DetectionSettings(hang_timeout_s=1))  # type: ignore[arg-type]
    for t in (0.0, 1.5, 3.0):
        fw.poll(t)
    # What report_hang reads of the stacks (report_hang itself waits seconds for them to be
    # written: test_signal_forwarder.py runs it on a FIFO).
    stacks = d / f"stacks-{NAME}.txt"
    return signal_forwarder._size(stacks), signal_forwarder._read(stacks)


def summary_reads(d: Path) -> object:
    rows = summary.replica_rows(d, 1)
    return summary.summarize(d, 1, {}, 1.0), rows, summary.merge_trace(d, d.parent / "trace.csv")


def labels_read(d: Path) -> object:
    try:
        return spare.read_assignment(d)
    except OSError:  # documented: no regular file there (yet)
        return None


# Each reader and the names in its directory it reads (every one gets the same content).
READERS: dict[str, tuple[tuple[str, ...], Callable[[Path], object]]] = {
    "signal_forwarder": ((f"signals-{NAME}.csv", f"collectives-{NAME}", f"waiting-{NAME}", f"stacks-{NAME}.txt"),
                         forwarder_reads),
    "collective_counts": ((f"collectives-{NAME}",), lambda d: collective_counts.read(d / f"collectives-{NAME}")),
    "script_error": (("a0-r0.json",), lambda d: script_errors.read(d / "a0-r0.json")),
    "termination_log": (("termination-0",), lambda d: script_errors.read_termination_log(d / "termination-0")),
    "run_summary": (("steps-r0-g0-a0.jsonl", "final-r0-k0.json", f"signals-{NAME}.csv"), summary_reads),
    "podinfo_labels": (("labels",), labels_read),
}


def make(kind: str, path: Path, content: bytes = b"") -> None:
    if kind == "regular":
        path.write_bytes(content)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to("/dev/zero")  # endless: followed, it would never end
    elif kind == "dangling-symlink":
        path.symlink_to(path.parent / "nowhere")
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.write(content)
            f.truncate(1 << 36)  # sparse: 64 GiB of zeros after the content


def within_bound(read: Callable[[Path], object], d: Path) -> object:
    """`read(d)`'s value (what it raised, raised), or a failure if it did not return within BOUND_S (then
    the FIFOs in `d` are opened for writing, so that a reader stuck in open() goes on)."""
    out: list = []
    raised: list[BaseException] = []

    def target() -> None:
        try:
            out.append(read(d))
        except BaseException as e:  # raised again below, in the test's thread
            raised.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(BOUND_S)
    if t.is_alive():
        for p in d.iterdir():
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail(f"blocked for more than {BOUND_S}s")
    if raised:
        raise raised[0]
    return out[0]


def run(reader: str, kind: str, content: bytes = b"") -> object:
    names, read = READERS[reader]
    with tempfile.TemporaryDirectory() as top:
        d = Path(top) / "dir"
        d.mkdir()
        for name in names:
            make(kind, d / name, content)
        return within_bound(read, d)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", sorted(READERS))
def test_no_reader_blocks_or_crashes_on_any_kind_of_file(reader, kind):
    run(reader, kind, b"step,replica,rank\n")


@pytest.mark.parametrize("reader", sorted(READERS))
@given(content=st.binary(max_size=2048) | st.text(max_size=512).map(str.encode))
def test_no_reader_crashes_on_any_bytes(reader, content):
    run(reader, "regular", content)


@given(records=st.lists(JSON, max_size=6), final=JSON)
def test_the_run_summary_takes_any_json_a_script_writes_as_its_records(records, final):
    with tempfile.TemporaryDirectory() as top:
        d = Path(top)
        (d / "steps-r0-g0-a0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (d / "final-r0-k0.json").write_text(json.dumps(final))
        summary_reads(d)
