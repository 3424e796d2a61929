"""What `transom run` shows while a job runs and when it ends: a progress line, the job's
events as they happen, and a closing table per replica.

On a terminal the progress line is redrawn in place and each event is printed above it;
into a pipe or a file every changed progress line is printed, at most one every
`PIPE_INTERVAL_S` unless the replicas or the quorum changed, so a log stays readable.
Pure formatting apart from `Display.write`, so the lines are checked in unit tests.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from transom.launch.summary import ReplicaRow

PIPE_INTERVAL_S = 2.0

# What each coordinator event kind reads as (membership.py writes the kinds).
_MARKS = {"failed": "FAIL", "registered": "join", "quorum": "quorum", "completed": "done", "left": "left",
          "paused": "PAUSE", "resumed": "resume", "checkpoint": "ckpt", "caught_up": "synced"}


def progress_line(step: int, loss: float | None, healthy: int, replicas: int, quorum_id: int | None,
                  members: list[int], paused: bool, restarts: int) -> str:
    loss_text = f"{loss:8.4f}" if loss is not None else "       -"
    bar = "".join("#" if i in members else "." for i in range(replicas))
    return (f"step {step:6d}  loss {loss_text}  replicas [{bar}] {healthy}/{replicas} healthy"
            f"  quorum {quorum_id if quorum_id is not None and quorum_id >= 0 else '-'}  restarts {restarts}"
            + ("  PAUSED (below minReplicas)" if paused else ""))


def event_line(elapsed_s: float, kind: str, message: str) -> str:
    return f"[{elapsed_s:7.2f}s] {_MARKS.get(kind, kind):>6s}  {message}"


def closing_table(rows: list[ReplicaRow]) -> list[str]:
    """One line per replica: incarnations, recoveries, committed steps, final step, log."""
    header = f"{'replica':>7s}  {'incarnations':>12s}  {'recoveries':>10s}  {'committed':>9s}  {'final step':>10s}  log"
    lines = [header]
    for r in rows:
        final = str(r.final_step) if r.final_step is not None else "-"
        lines.append(f"{r.replica:>7d}  {r.incarnations:>12d}  {r.recoveries:>10d}  {r.committed:>9d}  "
                     f"{final:>10s}  {r.log or '-'}")
    return lines


class Display:
    def __init__(self, quiet: bool = False, out: TextIO | None = None):
        self.out = out or sys.stdout
        self.quiet = quiet
        self.live = not quiet and self.out.isatty()
        self._t0 = time.monotonic()
        self._shown = ""  # the progress line on screen (terminal) or last printed (pipe)
        self._shown_at = 0.0
        self._shape: tuple = ()

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def say(self, text: str) -> None:
        """A line of its own (above the progress line on a terminal)."""
        self.write(f"[{self.elapsed():7.2f}s] {text}")

    def event(self, kind: str, message: str) -> None:
        self.write(event_line(self.elapsed(), kind, message))

    def progress(self, line: str, shape: tuple) -> None:
        """`shape`: what makes a pipe print at once (members, quorum, paused)."""
        if self.quiet or line == self._shown:
            return
        if self.live:
            self._shown = line
            self.out.write("\r\033[K" + line)
            self.out.flush()
            return
        now = time.monotonic()
        if shape != self._shape or now - self._shown_at >= PIPE_INTERVAL_S:
            self._shown, self._shown_at, self._shape = line, now, shape
            self.write(f"[{self.elapsed():7.2f}s] {line}")

    def write(self, text: str) -> None:
        if self.quiet:
            return
        if self.live:  # clear the progress line, print, draw it again below
            self.out.write("\r\033[K" + text + "\n" + self._shown)
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def end_live(self) -> None:
        if self.live and self._shown:
            self.out.write("\n")
            self.out.flush()
            self._shown = ""
