"""`trainer.batches()` over an iterable that Transom cannot position: a generator of synthetic
batches, a list, a DataLoader without an `ft.ReplicaSampler` (ft/data.py has the loader that
can be positioned, and `batches()` picks between the two).

Such an iterable has a position of its own, which only moves forward, one batch per
`next()`. What each kind of step then gets:

- a new step takes the iterable's next batch;
- a retried step (the last attempt was not committed) gets the same batch again, the same
  object: it is kept until the step index moves on, as a failed step must run again on
  the data it failed on (rule 2 of training-api.md);
- a step the replica jumped to (it recovered from a peer and goes on at the peer's step, or
  it started at a restored checkpoint's step or `start_step`) also takes the next batch:
  an arbitrary iterator cannot be moved to the batch of a step. After a jump the replica's
  batches follow its own count of batches taken, not the job's step (logged, once per
  jump). For random batches that changes nothing; for data read in order, that replica
  trains on its stream from where it stopped (a restarted one: from the start), not on the
  samples a replica that never failed would train at that step.
- at its end, an iterable that can start again (`iter()` gives a new iterator: a list, a
  DataLoader) starts from its beginning, as an epoch; a one-shot iterator (a generator)
  that runs out before the target raises `UsageError`, as does one that yields nothing:
  every retry would run out at the same place.

Nothing here is replica state: a replica restarted in place builds its iterable again from
the script, from its beginning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from transom.errors import UsageError

log = logging.getLogger("transom.ft")


class Stream:
    """The batches of one iterable, in order; it starts again at its end if it can."""

    def __init__(self, data: Any):
        try:
            self._it = iter(data)
        except TypeError:
            raise UsageError(f"trainer.batches() takes an iterable of batches (a DataLoader, a list, a generator), "
                             f"got {type(data).__name__}") from None
        self._data = data
        self.restartable = self._it is not data  # iter() of a generator or an iterator is itself
        self.taken = 0

    def next(self, step: int, num_steps: int) -> Any:
        """The next batch, for `step` of a job of `num_steps`."""
        try:
            batch = next(self._it)
        except StopIteration:
            batch = self._again(step, num_steps)
        self.taken += 1
        return batch

    def _again(self, step: int, num_steps: int) -> Any:
        if not self.restartable:
            raise UsageError(f"trainer.batches(): the iterator ran out after {self.taken} batches, at step {step} of "
                             f"{num_steps}; give it at least as many batches as steps, or an iterable that can start "
                             "again (a list, a DataLoader)") from None
        self._it = iter(self._data)
        try:
            return next(self._it)
        except StopIteration:
            raise UsageError("trainer.batches(): the iterable yields no batch") from None


def batches(trainer, stream: Stream, num_steps: int) -> Iterator[tuple[int, Any]]:
    """`(step, batch)` from `stream` until `num_steps` steps are committed (`trainer.steps()`)."""
    current: int | None = None
    batch: Any = None
    for step in trainer.steps(num_steps):
        if step != current:
            if current is not None and step != current + 1:
                log.warning("replica %s: trainer.batches() jumped from step %d to step %d (the replica caught up "
                            "with its peers): a plain iterable cannot be positioned at a step, so it goes on with its "
                            "next batch", trainer.replica_id, current, step)
            elif current is None and step > 0:
                log.info("replica %s starts at step %d with the iterable's first batch (a plain iterable cannot be "
                         "positioned at a step)", trainer.replica_id, step)
            batch = stream.next(step, num_steps)
            current = step
        yield step, batch
