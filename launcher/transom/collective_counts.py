"""How many collectives this worker process has entered and completed: the evidence that names
the rank a hang waits for (transom/detect/hangs.py).

Two kinds of collective are counted, those Transom itself issues:

- `ftar`: the cross-replica all-reduces of the step (ft/ftar.py: one per bucket, and the guard's
  agreement). Counted per cross-replica group (`new_group` when the quorum rebuilds it): every
  member of one quorum issues the same sequence, so within a group the counts of rank k of
  every replica are comparable;
- `group`: the replica's own control collectives (ft/replica.py: the leader's broadcasts, the
  commit vote, gathers), over the worker's whole life: every rank of a replica calls them in
  the same order, so the ranks' counts are comparable.

A rank that *entered* collective n and has not *completed* it waits in it; a rank whose count
stops below the others' never arrived. Each count is incremented by one thread only (a bucket's
all-reduce may start from the autograd engine's thread, the waits end on the training thread),
so no lock is taken: the counts are plain slots of a shared page, 8-byte aligned, that the
launcher reads (launch/signal_forwarder.py) without a system call on the worker's side, like the
waiting byte of ft/guard.py. A reader may see one slot updated before another; `read` clamps
what it returns so that completed never exceeds entered.

Stdlib only: the workers (with torch) write it, the launcher (without) reads it.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from transom import worker_files

SLOTS = ("group_id", "ftar_entered", "ftar_completed", "group_entered", "group_completed")
_FORMAT = "<" + "q" * len(SLOTS)
SIZE = struct.calcsize(_FORMAT)
MAX_COUNT = 2**62  # the wire models' bound (coordinator/models.py CollectiveCounts)
GROUP_ID, FTAR_ENTERED, FTAR_COMPLETED, GROUP_ENTERED, GROUP_COMPLETED = range(len(SLOTS))


@dataclass(frozen=True)
class Counts:
    """One rank's counts as read at one moment."""

    group_id: int  # the quorum id of the cross-replica group the ftar counts are of (-1: none yet)
    ftar_entered: int
    ftar_completed: int
    group_entered: int
    group_completed: int


class CollectiveCounter:
    """The process's counts: kept in memory, and mirrored into a file once `attach`ed."""

    def __init__(self) -> None:
        self._values = [-1, 0, 0, 0, 0]
        self._map: mmap.mmap | None = None
        # A close between another thread's check and its store would fail that store (and
        # with it a collective): replicas as threads of one process share this counter.
        self._lock = threading.Lock()

    def attach(self, path: Path) -> None:
        """Mirror the counts into `path` from now on (created, SIZE bytes)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, struct.pack(_FORMAT, *self._values), 0)
            with self._lock:
                self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)

    def detach(self) -> None:
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None

    def _set(self, slot: int, value: int) -> None:
        with self._lock:
            self._values[slot] = value
            if self._map is not None:
                struct.pack_into("<q", self._map, 8 * slot, value)

    def new_group(self, group_id: int) -> None:
        """A new cross-replica group (a rebuilt quorum): its collectives are counted from 0."""
        self._set(FTAR_ENTERED, 0)
        self._set(FTAR_COMPLETED, 0)
        self._set(GROUP_ID, max(group_id, -1))

    def ftar_entered(self) -> None:
        self._set(FTAR_ENTERED, self._values[FTAR_ENTERED] + 1)

    def ftar_completed(self, n: int = 1) -> None:
        self._set(FTAR_COMPLETED, self._values[FTAR_COMPLETED] + n)

    def group_entered(self) -> None:
        self._set(GROUP_ENTERED, self._values[GROUP_ENTERED] + 1)

    def group_completed(self) -> None:
        self._set(GROUP_COMPLETED, self._values[GROUP_COMPLETED] + 1)

    def counts(self) -> Counts:
        return _counts(self._values)


def _counts(values: list[int] | tuple[int, ...]) -> Counts:
    """Bounded and consistent: completed never above entered (a read between two slots' updates)."""
    group_id, fe, fc, ge, gc = (min(max(v, -1 if i == GROUP_ID else 0), MAX_COUNT) for i, v in enumerate(values))
    return Counts(group_id, fe, min(fc, fe), ge, min(gc, ge))


def read(path: Path) -> Counts | None:
    """A worker's counts from its file; None if it has none (yet), or it is no regular file
    (the launcher never waits on a worker's file: worker_files.py)."""
    data = worker_files.read(path, SIZE)
    if data is None or len(data) < SIZE:
        return None
    return _counts(struct.unpack(_FORMAT, data[:SIZE]))


# The process's counter: the collectives (ft/ftar.py, ft/replica.py) count into it, the step
# guard (ft/guard.py) attaches it to the launcher's signals directory.
COUNTER = CollectiveCounter()
