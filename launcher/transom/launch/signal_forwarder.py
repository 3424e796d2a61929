"""The launcher's part of anomaly detection: forward the workers' step rows, watch for hangs.

Each worker appends one CSV row per committed step to its file in the launcher's signals
directory (ft/guard.py). `SignalForwarder.poll`, called from the launcher's watch loop,
reads what is new, and at most once a second posts it to the coordinator as one batch for
the pod (`POST /v1/signals`), where the detectors run; less often when the coordinator's
answer says so (a job with thousands of pods: transom/detect/step_rows.py `post_interval`).
Rows wait in a bounded buffer while the coordinator is away (the oldest are dropped first:
the detectors judge recent steps). The file is the worker's script's to write: a line that
is no row (any bytes) is skipped, counted, and reported in a warning at most once a minute;
the launcher goes on. Once the coordinator's answer carries the job's DuplicateData finding
(replicas that trained on identical inputs, detect/duplicates.py), the launcher logs it,
and again only when the replicas it names change.

The hang watchdog: a worker that has reported a step, and then reports none for
`hang_timeout_s` while not waiting for others (its quorum, the exchange, the votes: each wait
has a timeout of its own; a paused job or a hung peer's partner waits, it does not hang),
is hung. The launcher then has every worker write all its threads' stacks (SIGUSR1, which
the workers' faulthandler answers), logs them, sends them to the coordinator with a row
that says how long the rank made no progress (the detectors' `hang`), and restarts the
replica like any failure. With its posts go its workers' collective counts when they changed
(transom/collective_counts.py), and all of them with the stacks: they tell the coordinator
which rank the hang waits for (detect/hangs.py), which need not be the one the watchdog saw
stop.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from transom import collective_counts, worker_files
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.models import CollectiveCounts, Identity, SignalBatch, SignalRow
from transom.detect.step_rows import (
    FORWARD_INTERVAL_S,
    MAX_FORWARD_INTERVAL_S,
    OPTIONAL_COLUMNS,
    TRACE_COLUMNS,
    DetectionSettings,
    Signal,
    TraceParser,
)
from transom.errors import CoordinatorError, TooManyRequests

if TYPE_CHECKING:
    from transom.launch.workers import Worker

log = logging.getLogger("transom.launch")
MAX_BUFFERED_ROWS = 20_000
MAX_BATCH_ROWS = 4096
LATER_S = 0.5  # after a 429, the last flush of an attempt tries again this much later
RECOVERY_POST_S = 0.1  # rows of steps with recovery work: posted this often at most, whatever the pace
LAST_FLUSH_PATIENCE_S = 3.0
STACKS_WAIT_S = 3.0
MAX_STACKS_CHARS = 16_000
MAX_READ_BYTES = 1 << 20  # of one worker's file per poll (and of its stacks)
SKIPPED_WARNING_INTERVAL_S = 60.0  # a script that writes garbage every step gets a line a minute, not one a step
COLUMNS = (*TRACE_COLUMNS, *OPTIONAL_COLUMNS)


@dataclass
class _Worker:
    rank: int
    offset: int = 0
    last_step: int = -1
    progress_at: float | None = None  # when it last reported a step (None: not yet)

    def __post_init__(self) -> None:
        self.parser = TraceParser(COLUMNS)  # holds an unfinished last line until the rest comes
        self.skipped_reported = 0  # of parser.skipped, in a warning
        self.counts: collective_counts.Counts | None = None  # its collectives, as last read
        self.counts_sent: collective_counts.Counts | None = None  # as the coordinator last took them


def _row(signal: Signal) -> SignalRow:
    """What the coordinator takes (ValueError: out of its bounds, e.g. a rank id past 2^20)."""
    return SignalRow(step=signal.step, rank=signal.rank, step_seconds=signal.step_seconds, tokens=signal.tokens,
                     sum_len_sq=signal.sum_len_sq, loss=signal.loss, grad_norm=signal.grad_norm,
                     finite=signal.finite, fingerprint=signal.fingerprint, recovery=signal.recovery,
                     batch_share=signal.batch_share, input_digest=signal.input_digest)


@dataclass(frozen=True)
class Hang:
    rank: int
    step: int  # the step it did not finish
    stalled_s: float


class SignalForwarder:
    """One attempt's rows: read, forwarded, watched. Owns no thread (the watch loop polls it)."""

    def __init__(self, directory: Path, identity: Identity, node_rank: int, ranks: list[int],
                 client: CoordinatorClient, settings: DetectionSettings):
        self.dir, self.identity, self.node_rank = directory, identity, node_rank
        self.client, self.settings = client, settings
        self._workers = {k: _Worker(k) for k in ranks}
        self._buffer: list[SignalRow] = []
        self._next_post = 0.0
        self._next_urgent = 0.0  # rows of recovery steps go at most this often (_recovery_waits)
        self._recovery_rows = False  # the buffer holds such a row (set as rows are read, not searched for)
        self.interval_s = FORWARD_INTERVAL_S  # between posts; the coordinator's answers set it
        self._dropped = 0
        self._next_skipped_warning = 0.0
        self._duplicate_logged: list[int] | None = None  # the replicas of the finding last logged

    def _name(self, rank: int) -> str:
        i = self.identity
        return f"r{i.replica_id}-g{i.generation}-a{i.attempt}-k{rank}"

    def poll(self, now: float) -> Hang | None:
        for w in self._workers.values():
            self._read(w, now)
        if now >= self._next_post or self._recovery_waits(now):
            self._read_counts()
            if self._buffer or self._changed_counts():
                self.flush()  # its answer may set the pace
                self._next_post = now + self.interval_s
        return self._hung(now) if self.settings.enabled else None

    def _recovery_waits(self, now: float) -> bool:
        """A row of a step with recovery work (a source's snapshot fingerprint, a joiner's
        step) goes without waiting for the pace: a joiner checks its snapshot against the
        record those rows make, and trains without contributing until it can. At most one
        such post per RECOVERY_POST_S."""
        if now < self._next_urgent or not self._recovery_rows:
            return False
        self._next_urgent = now + RECOVERY_POST_S
        return True

    def _read(self, w: _Worker, now: float) -> None:
        # Bytes: the script may have written anything; and never a plain open(): the path may
        # be a FIFO, whose open() would stop this loop (worker_files.py).
        chunk = worker_files.read(self.dir / f"signals-{self._name(w.rank)}.csv", MAX_READ_BYTES, w.offset)
        if chunk is None:
            return  # not started yet, or no regular file
        w.offset += len(chunk)
        for parsed in w.parser.feed(chunk):
            try:
                row = _row(parsed)
            except ValueError as e:  # a row, but not one the coordinator takes
                w.parser.skip(" ".join(str(e).split()))
                continue
            w.last_step, w.progress_at = row.step, now
            self._buffer.append(row)
            self._recovery_rows = self._recovery_rows or row.recovery
        self._report_skipped(w, now)
        if len(self._buffer) > MAX_BUFFERED_ROWS:
            self._dropped += len(self._buffer) - MAX_BUFFERED_ROWS
            del self._buffer[: len(self._buffer) - MAX_BUFFERED_ROWS]

    def _read_counts(self) -> None:
        for w in self._workers.values():
            w.counts = collective_counts.read(self.dir / f"collectives-{self._name(w.rank)}") or w.counts

    def _changed_counts(self) -> list[CollectiveCounts]:
        """The workers' collective counts that changed since the coordinator took them: a
        healthy rank's change every step, a hung one's and those waiting for it stop. None
        before a worker reported its first row: the coordinator takes an incarnation's first
        post as its start (coordinator/detection.py forgets the previous one's history, and
        the detectors wait for its rows from the other replicas' step then), which must stay
        its first row, as it was before counts travelled; a hang needs a row first anyway."""
        if all(w.progress_at is None for w in self._workers.values()):
            return []
        return [CollectiveCounts(rank=w.rank, group_id=w.counts.group_id, ftar_entered=w.counts.ftar_entered,
                                 ftar_completed=w.counts.ftar_completed, group_entered=w.counts.group_entered,
                                 group_completed=w.counts.group_completed)
                for w in self._workers.values() if w.counts is not None and w.counts != w.counts_sent]

    def _report_skipped(self, w: _Worker, now: float) -> None:
        new = w.parser.skipped - w.skipped_reported
        if new and now >= self._next_skipped_warning:
            _, why = w.parser.first_skipped or (0, "")
            log.warning("rank %d: skipped %d malformed signal row(s) of its signals file (%d in all; the first: %s)",
                        w.rank, new, w.parser.skipped, why[:200])
            w.skipped_reported = w.parser.skipped
            self._next_skipped_warning = now + SKIPPED_WARNING_INTERVAL_S

    def _waiting(self, rank: int) -> bool:
        return worker_files.read(self.dir / f"waiting-{self._name(rank)}", 1) == b"1"

    def _hung(self, now: float) -> Hang | None:
        for w in self._workers.values():
            if w.progress_at is None:
                continue
            if self._waiting(w.rank):
                w.progress_at = now  # waiting for a quorum: bounded by its own timeout
            elif now - w.progress_at >= self.settings.hang_timeout_s:
                return Hang(w.rank, w.last_step + 1, now - w.progress_at)
        return None

    def flush(self, stacks: str | None = None, patience_s: float = 0.0) -> None:
        """Post what is buffered (and `stacks`); rows stay buffered if the coordinator is away
        or asks for them later (429), which an attempt's last flush waits out for `patience_s`."""
        deadline = time.monotonic() + patience_s
        counts = self._changed_counts()
        while self._buffer or stacks or counts:
            rows = self._buffer[:MAX_BATCH_ROWS]
            try:
                asked = self.client.report_signals(SignalBatch(identity=self.identity, node_rank=self.node_rank,
                                                               rows=rows, stacks=stacks, collectives=counts),
                                                   timeout_s=2.0)
            except TooManyRequests:
                if time.monotonic() + LATER_S > deadline:
                    return  # its pace: the rows go with the next post
                time.sleep(LATER_S)
                continue
            except CoordinatorError as e:
                if e.status not in (404, 409, 410):  # else: the coordinator will not judge this incarnation
                    log.warning("could not forward %d signal rows: %s", len(rows), e)
                    return
                self._buffer.clear()  # this incarnation is over for the coordinator: nobody judges it
                self._recovery_rows = False
                for w in self._workers.values():
                    w.counts_sent = w.counts
                return
            except Exception as e:  # training goes on; the detectors see the rows later
                log.warning("could not forward %d signal rows: %s", len(rows), e)
                return
            del self._buffer[: len(rows)]
            self._recovery_rows = self._recovery_rows and bool(self._buffer)
            stacks, counts = None, []
            for w in self._workers.values():
                w.counts_sent = w.counts
            self.interval_s = min(max(asked.next_post_s, FORWARD_INTERVAL_S), MAX_FORWARD_INTERVAL_S)
            found = asked.duplicate_data
            if found is not None and found.replicas != self._duplicate_logged:
                log.warning("duplicate data: %s", found.message)  # again when it names other replicas
                self._duplicate_logged = found.replicas

    def report_hang(self, hang: Hang, workers: Sequence[Worker]) -> str:
        """Have every worker write its stacks, log and forward them; returns them."""
        for w in workers:
            if w.poll() is None:
                try:
                    os.kill(w.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        files = [self.dir / f"stacks-{self._name(k)}.txt" for k in self._workers]
        deadline = time.monotonic() + STACKS_WAIT_S
        while time.monotonic() < deadline and not all(_size(f) > 0 for f in files):
            time.sleep(0.1)
        time.sleep(0.2)  # the last lines of a dump
        stacks = "\n".join(f"--- rank {k} ---\n{_read(f)}" for k, f in zip(self._workers, files))
        log.error("replica %d rank %d made no progress for %.0fs after step %d; every worker's stacks:\n%s",
                  self.identity.replica_id, hang.rank, hang.stalled_s, hang.step - 1, stacks)
        self._buffer.append(SignalRow(step=hang.step, rank=hang.rank, step_seconds=round(hang.stalled_s, 3)))
        self._read_counts()  # as they stand at the hang: they say whom it waits for (detect/hangs.py)
        for worker in self._workers.values():
            worker.counts_sent = None  # all of them, with the stacks
        self.flush(stacks=stacks[-MAX_STACKS_CHARS:], patience_s=LAST_FLUSH_PATIENCE_S)
        return stacks


def _size(path: Path) -> int:
    try:
        st = path.lstat()  # lstat: never waits, whatever the path is
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 1  # not a file: nothing to wait for


def _read(path: Path) -> str:
    data = worker_files.read(path, MAX_READ_BYTES)
    return "(no stacks: no regular file)" if data is None else data.decode(errors="replace")
