"""A mistake in the training script ends the job at once: how each process hands it on.

A `transom.errors.ScriptError` (a call out of order, a checkpoint that cannot fit the job)
fails the same way in every incarnation on every node, so restarting the replica, or
replacing it, only spends time before the same traceback. The chain, one hop per process:

- worker: a ScriptError that escapes the script is written as a `ScriptFailure` to the
  worker's own file (`contract.ENV_SCRIPT_ERROR_FILE`, which its launcher sets), and the
  worker then exits 1 through the ordinary teardown: the trainer's `close()` or its hook has
  closed its sockets and threads. The trainer writes it before it reports the replica failed
  (`close()` before the target, its uncaught-exception hook), because its launcher may act
  on that report before the worker has exited; `install_hook()` (called by `ft.init()`)
  catches the rest, such as one raised before `FaultTolerant` exists. Only the exception
  itself counts, not one it was raised from: a script that turns a UsageError into another
  error decided otherwise.
- launcher: a worker that exits non-zero while a worker's file holds a failure ends the
  replica without a restart; the launcher reports `ScriptError: ...` to the coordinator,
  writes the message to `contract.ENV_TERMINATION_LOG` and exits `EXIT_SCRIPT_ERROR`.
- `transom run` reads that file and stops the whole job; in Kubernetes the file is the
  container's termination message, and the operator fails the job with it.

Standard library only: the launcher and `transom run` import this without torch.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from transom import contract, worker_files
from transom.errors import ScriptError

MAX_MESSAGE_CHARS = 2000  # a termination message is cut at 4096 bytes by the kubelet
MAX_RECORD_BYTES = 8 * MAX_MESSAGE_CHARS  # what `record` writes, whose JSON escapes a character in at most 6


@dataclass(frozen=True)
class ScriptFailure:
    """The ScriptError that ended a worker."""

    kind: str  # its class name (UsageError, IncompatibleCheckpoint)
    message: str
    rank: int | None = None  # RANK of the worker, within its replica

    def describe(self, who: str) -> str:
        """One line for a log and a report; `who`: the replica ("replica 1")."""
        rank = f", rank {self.rank}" if self.rank is not None else ""
        return f"ScriptError: {self.kind}: {self.message} ({who}{rank})"


def install_hook() -> None:
    """Record a ScriptError that escapes this process (idempotent). Nothing is recorded
    where no launcher asked for it (a script run by hand)."""
    previous = sys.excepthook
    if getattr(previous, "_transom_script_errors", False):
        return

    def hook(exc_type, exc, tb) -> None:
        try:
            record_escaping(exc)
        finally:
            previous(exc_type, exc, tb)

    hook._transom_script_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def record_escaping(exc: BaseException | None = None) -> None:
    """Record `exc` if it is a ScriptError and this worker's launcher asked for it. `exc`
    None: the exception on its way out, as a `finally:` or an `except:` block sees it."""
    exc = sys.exc_info()[1] if exc is None else exc
    path = os.environ.get(contract.ENV_SCRIPT_ERROR_FILE)
    if not path or not isinstance(exc, ScriptError):
        return
    rank = os.environ.get("RANK", "")
    number = int(rank) if rank.isascii() and rank.isdigit() else None
    try:
        record(Path(path), ScriptFailure(type(exc).__name__, str(exc), number))
    except OSError:  # the exit code and the traceback still tell; the job is restarted as for a crash
        pass


def record(path: Path, failure: ScriptFailure) -> None:
    """Write `failure` to `path` whole (renamed into place: a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"kind": failure.kind, "message": failure.message[:MAX_MESSAGE_CHARS],
                               "rank": failure.rank}))
    tmp.replace(path)


def read(path: Path) -> ScriptFailure | None:
    """The failure at `path`; None if there is none (or it does not parse: then the worker's
    exit is an ordinary crash, restarted like one)."""
    data = worker_files.read(path, MAX_RECORD_BYTES)  # the worker's to replace with anything
    if data is None:
        return None
    try:
        raw = json.loads(data)
        rank = raw.get("rank")
        return ScriptFailure(str(raw["kind"])[:100], str(raw["message"])[:MAX_MESSAGE_CHARS],
                             rank if isinstance(rank, int) else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_termination_log(message: str, environ: dict[str, str] | None = None) -> None:
    """`message` to the file named by ENV_TERMINATION_LOG, if any (best effort: the exit code
    alone already says what happened)."""
    path = (os.environ if environ is None else environ).get(contract.ENV_TERMINATION_LOG)
    if not path:
        return
    try:
        Path(path).write_text(message[:MAX_MESSAGE_CHARS])
    except OSError:
        pass


def read_termination_log(path: Path) -> str | None:
    """What a launcher wrote with `write_termination_log`; None if nothing."""
    data = worker_files.read(path, 4 * MAX_MESSAGE_CHARS)  # its workers could put a FIFO there
    text = data.decode(errors="replace")[:MAX_MESSAGE_CHARS].strip() if data is not None else ""
    return text or None
