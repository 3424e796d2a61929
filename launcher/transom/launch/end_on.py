"""`transom run --end-on KIND[:REPLICA]`: end a local job a few steps after the events it
is run to see, instead of at a step count guessed long enough for them.

A run that shows a recovery (a replica killed, restarted, caught up from a peer) lasts as
long as the recovery takes, which depends on the machine: with a fixed step count the job
either ends before the recovery did, or trains on for nothing. With `--end-on caught_up:1`
the runner watches the coordinator's events (GET /v1/status), and once every event it was
given has happened it asks the coordinator to end the job `--end-margin` steps later
(POST /v1/finish): every replica completes the job there, with its final checkpoint. The
script's own step count stays the cap; a run that reached it first says so in its summary
(`end_on.met` false), naming the events it still waited for.

`EndOn` holds no I/O of its own: it is fed the events the runner read, and handed the call
that ends the job (the coordinator client's `finish`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transom.coordinator.models import Event
from transom.errors import JobCompleted
from transom.words import EventKind

MAX_MARGIN = 10_000  # steps after the events; more is a step count, which --steps already is


@dataclass(frozen=True)
class Awaited:
    """An event a run waits for: its kind, and the replica it is about (None: any)."""

    kind: EventKind
    replica: int | None = None

    @classmethod
    def parse(cls, text: str) -> Awaited:
        kind, _, replica = text.partition(":")
        if kind not in EventKind.__members__.values():
            raise ValueError(f"--end-on: unknown event kind {kind!r}; one of {', '.join(EventKind)}")
        if replica and not (replica.isascii() and replica.isdigit()):
            raise ValueError(f"--end-on: the replica after {kind!r} must be a replica index, got {replica!r}")
        return cls(EventKind(kind), int(replica) if replica else None)

    def matches(self, event: Event) -> bool:
        return event.kind == self.kind and (self.replica is None or event.replica == self.replica)

    def __str__(self) -> str:
        return self.kind if self.replica is None else f"{self.kind}:{self.replica}"


class EndOn:
    """Which awaited events have happened, and the step the job was asked to end at."""

    def __init__(self, awaited: list[Awaited], margin_steps: int):
        if not 0 <= margin_steps <= MAX_MARGIN:
            raise ValueError(f"--end-margin must be between 0 and {MAX_MARGIN} steps, got {margin_steps}")
        self.awaited, self.margin_steps = awaited, margin_steps
        self._seen: set[Awaited] = set()
        self._asked = False
        self.end_step: int | None = None  # the step the coordinator said it will end the job at

    def observe(self, events: list[Event]) -> None:
        for event in events:
            self._seen.update(a for a in self.awaited if a.matches(event))

    @property
    def met(self) -> bool:
        """Every awaited event happened (a run with none awaits nothing: never met)."""
        return bool(self.awaited) and len(self._seen) == len(set(self.awaited))

    def due(self, step: int) -> int | None:
        """The step to end at, if the job should be asked to end now that it is at `step`."""
        if self.met and not self._asked:
            return step + self.margin_steps
        return None

    def asked(self, end_step: int | None) -> None:
        """The job was asked to end: it ends at `end_step` (None: it had completed already)."""
        self._asked, self.end_step = True, end_step

    def watch(self, events: list[Event], step: int, finish: Callable[[int], int]) -> bool:
        """Take the new `events` of a job at `step`; once the awaited ones happened, end the job
        a margin later through `finish(step) -> the step it will end at`. True when it asked."""
        self.observe(events)
        end = self.due(step)
        if end is None:
            return False
        try:
            self.asked(finish(end))
        except JobCompleted:  # it reached its step count first
            self.asked(None)
        return True

    def news(self) -> str:
        return f"{', '.join(map(str, self.awaited))} happened: the job ends at step {self.end_step}"

    def summary(self) -> dict:
        """The summary's `end_on`: what was awaited, what happened, the step it ended at."""
        return {"events": [str(a) for a in self.awaited], "met": self.met,
                "waiting_for": [str(a) for a in self.awaited if a not in self._seen], "end_step": self.end_step}
