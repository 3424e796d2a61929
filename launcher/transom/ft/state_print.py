"""`PrintLater`: a source's fingerprint of the state it took a joiner's snapshot of, summed on
a thread of its own.

A joiner checks the snapshot it was sent against the fingerprint the replicas report for
its step (ft/snapshot_check.py), so a source fingerprints its parameters and optimizer state
at the commit that starts the snapshot. Summed on the training thread that read (about
three times the model's size under Adam) would stall the source's next step; but nothing
changes the state between that commit and the next optimizer step, which waits for the
snapshot's copy anyway (ft/catchup.py `Source.before_update`). So the sum runs beside the
next step's forward and backward passes, the source waits for it where it waits for the
copy, and the guard writes the step's row once the value is there (ft/guard.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

import torch

from transom.ft.guard import fingerprint

log = logging.getLogger("transom.ft")


class PrintLater:
    """The fingerprint of `tensors`, which must not change until `wait()` returned."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.future: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(tensors,), name="transom-state-print", daemon=True)
        self._thread.start()

    def _run(self, tensors: list[torch.Tensor]) -> None:
        try:
            self.future.set_result(int(fingerprint(tensors).item()))
        except BaseException as e:  # the row goes without a fingerprint; the joiner says so
            log.warning("could not fingerprint the state of a joiner's snapshot: %s", e)
            self.future.set_exception(e)

    def wait(self, timeout_s: float) -> None:
        """Until the sum has read every tensor (or `timeout_s`: then the value, if it comes,
        may mix the state before and after the update, and the joiners refuse the snapshot
        on it, as they would a wrong one)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the fingerprint of a joiner's snapshot took more than %.0fs", timeout_s)
