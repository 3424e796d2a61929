"""What `transom run` reads of its job: the coordinator's answer to GET /v1/status, the
same HTTP API and the same job token an operator or a dashboard would use, never the
coordinator's own objects (it runs in the runner's process only because one machine needs
no pod for it).

Pure functions of a `JobStatus`, apart from `EventFeed`, which remembers which of the
status's recent events were already shown.
"""

from __future__ import annotations

from transom.coordinator.models import Event, JobStatus
from transom.launch.display import progress_line
from transom.words import IncarnationState


def failed_incarnations(status: JobStatus) -> list[tuple[int, int, str | None]]:
    """(replica, generation, last failure) of each replica the coordinator declared failed."""
    return [(r.replica_id, r.generation, r.last_failure) for r in status.replicas if r.state == IncarnationState.FAILED]


def caught_up(status: JobStatus) -> set[int]:
    """The replicas that hold the job's state: healthy members of the current quorum at the
    newest step a healthy replica reported (one behind: a step in flight). A replica still
    catching up from a peer reports the step it started from until it holds the state."""
    healthy = [r for r in status.replicas if r.state == IncarnationState.HEALTHY and r.replica_id in status.members]
    newest = max((r.step for r in healthy), default=0)
    return {r.replica_id for r in healthy if r.step >= newest - 1}


def progress(status: JobStatus, restarts: int) -> str:
    """The progress line: step, the mean loss of the healthy replicas, who is in the quorum."""
    losses = [r.last_report.loss for r in status.replicas
              if r.last_report is not None and r.last_report.loss is not None and r.state == IncarnationState.HEALTHY]
    return progress_line(status.max_step, sum(losses) / len(losses) if losses else None, status.healthy_replicas,
                         status.num_replicas, status.quorum_id, list(status.members), status.paused, restarts)


class EventFeed:
    """The events of successive statuses that were not in an earlier one. A status holds the
    newest events in time order (the coordinator's clock never goes back); the feed remembers
    the newest time it passed on and how many events it passed on at that time."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._at_last = 0

    def new(self, events: list[Event]) -> list[Event]:
        fresh, skip = [], self._at_last
        for ev in events:
            if self._last is not None and ev.time < self._last:
                continue
            if self._last is not None and ev.time == self._last and skip > 0:
                skip -= 1
                continue
            fresh.append(ev)
        if events:
            newest = events[-1].time
            self._at_last = sum(1 for ev in events if ev.time == newest)
            self._last = newest
        return fresh
