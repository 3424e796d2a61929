"""How a job's owner ends it before its script's target (POST /v1/finish; `transom run
--end-on`): at a step, or at the earliest step it still can.

The members of the current round may be committing the step after its `max_step` already
(`step_limit`), so the first round that can end the job is one at that step. The round
that reaches the end step says so (`Decision.ends_job`, membership.py), and its members
complete the job where they are, each with its final checkpoint, as at the script's own
target. Pure: the caller holds the coordinator's lock and passes the time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transom.errors import JobCompleted
from transom.words import EventKind

if TYPE_CHECKING:
    from transom.coordinator.job_state import JobState


def finish(m: JobState, step: int, now: float) -> int:
    """End the job at `step`, or at the earliest step a round can still end it; returns the
    step it will end at. JobCompleted once it has completed."""
    if m.completed_step is not None:
        raise JobCompleted(f"the job completed at step {m.completed_step}")
    m.end_step = max(step, m.step_limit)
    m.event(now, EventKind.FINISHING, f"the job ends at step {m.end_step}, as its owner asked")
    return m.end_step
