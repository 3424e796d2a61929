"""The bounded wait on GPU work (`transom.cuda_wait`) and the snapshot's use of it.

CUDA events are stood in for by objects with `query()`: the poll loop is pure logic, and
the real event path runs on a GPU in tests/integration/test_cuda.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from transom.checkpoint.snapshot import Snapshot
from transom.cuda_wait import wait_for


class Event:
    """Completes after `pending` queries (never, if None)."""

    def __init__(self, pending: int | None) -> None:
        self.pending, self.queries = pending, 0

    def query(self) -> bool:
        self.queries += 1
        return self.pending is not None and self.queries > self.pending


def test_a_completed_event_returns_at_the_first_query():
    event = Event(0)
    wait_for(event, 1.0, "copy")
    assert event.queries == 1


def test_an_event_that_completes_later_is_waited_for():
    event = Event(20)
    started = time.monotonic()
    wait_for(event, 5.0, "copy")
    assert event.queries == 21 and time.monotonic() - started < 1.0


def test_an_event_that_never_completes_times_out_naming_the_work():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="collective not finished on the GPU after 0.2s"):
        wait_for(Event(None), 0.2, "collective")
    assert 0.2 <= time.monotonic() - started < 1.0


def test_a_snapshot_whose_gpu_copy_hangs_raises_instead_of_blocking():
    snap = Snapshot()
    snap.start({"w": torch.ones(4)})  # the host copy: a thread, done at once
    snap._event = Event(None)  # and a GPU copy that never completes
    with pytest.raises(TimeoutError, match="snapshot copy"):
        snap.wait(timeout_s=0.2)
    assert snap.busy  # still in flight: the next start() must not reuse the buffers
    snap._event = Event(3)
    assert torch.equal(snap.wait(timeout_s=1.0)["w"], torch.ones(4)) and not snap.busy
