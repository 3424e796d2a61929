"""One node's worker processes, as the in-pod launcher starts and stops them (launch/supervisor.py).

Each worker gets torchrun's environment for its own replica (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and leads a session and process group of its
own: signals go to the whole group, so whatever a worker started is stopped with it, and
after every attempt nothing of the groups is left running, nor anything that left them
(processes.py). Each worker also gets a file to write the ScriptError that ends it
(script_errors.py), read back to tell a bug in the script from a crash. A Python script's
workers are forked by a warm interpreter that has torch imported already, when one can
serve (warm_start.py), and are otherwise started fresh.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Protocol

from transom import contract, script_errors
from transom.errors import WarmStartFailed
from transom.launch import processes, warm_start

log = logging.getLogger("transom.launch")


class Worker(Protocol):
    """What the launcher uses of a worker process: a Popen, or one a warm interpreter forked."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class WorkerGroup:
    """The workers of one node, one attempt at a time; `close()` removes their error files."""

    def __init__(self, command: list[str], nproc_per_node: int, who: str):
        """`who`: how the log names this node's replica (it changes on a spare's promotion)."""
        self.command = command
        self.nproc_per_node = nproc_per_node
        self.who = who
        self.procs: list[Worker] = []
        self._target = warm_start.target_of(command)
        self._warm: warm_start.WarmInterpreter | None = None
        # Where each worker writes a ScriptError that ends it (script_errors.py).
        self._errors_dir: Path | None = None
        try:
            self._errors_dir = Path(tempfile.mkdtemp(prefix="transom-errors-"))
        except OSError as e:
            log.warning("no directory for the workers' script errors (%s): a bug in the script is restarted "
                        "like a crash", e)

    def close(self) -> None:
        if self.procs:
            self.stop(signal.SIGKILL, grace_s=0.0)
        self._close_warm()
        if self._errors_dir is not None:
            shutil.rmtree(self._errors_dir, ignore_errors=True)

    def warm_up(self, environ: dict[str, str]) -> None:
        """Start the warm interpreter for the workers of `environ` now, if the command is a
        Python script and nothing says not to: its imports overlap the rendezvous."""
        if self._target is None or not warm_start.enabled(environ) or not processes.adopt_orphans():
            return  # no subreaper: a forked worker would not become this process's child
        if self._warm is not None and self._warm.serves(self._target, environ):
            return
        self._close_warm()
        try:
            self._warm = warm_start.WarmInterpreter(self._target, environ)
        except OSError as e:  # no such Python, or no pipes left: the workers start fresh
            log.warning("%s: no warm interpreter (%s): workers start as new processes", self.who, e)

    def _close_warm(self) -> None:
        if self._warm is not None:
            self._warm.close()
            self._warm = None

    def _start(self, env: dict[str, str]) -> Worker:
        """One worker: forked by the warm interpreter if there is one, else a new process in
        a session of its own (so a signal meant for the launcher's terminal is not delivered
        twice; the launcher forwards what the workers must see, to the group)."""
        if self._warm is not None:
            try:
                return self._warm.spawn(env)
            except WarmStartFailed as e:
                log.warning("%s: %s; workers start as new processes from now on", self.who, e)
                self._close_warm()
        return subprocess.Popen(self.command, env=env, start_new_session=True,
                                preexec_fn=processes.dies_with_parent())

    def spawn(self, environ: dict[str, str], node_rank: int, nnodes: int, attempt: int, addr: str, port: int) -> None:
        """Start this attempt's workers from the pod's environment `environ`."""
        self.warm_up(environ)
        n = self.nproc_per_node
        for local_rank in range(n):
            env = dict(environ)
            env.update(
                {
                    "RANK": str(node_rank * n + local_rank),
                    "LOCAL_RANK": str(local_rank),
                    "WORLD_SIZE": str(nnodes * n),
                    "LOCAL_WORLD_SIZE": str(n),
                    "GROUP_RANK": str(node_rank),
                    "MASTER_ADDR": addr,
                    "MASTER_PORT": str(port),
                    "TORCHELASTIC_RESTART_COUNT": str(attempt),
                    contract.ENV_ATTEMPT: str(attempt),
                    contract.ENV_NPROC_PER_NODE: str(n),
                }
            )
            if self._errors_dir is not None:
                env[contract.ENV_SCRIPT_ERROR_FILE] = str(self._error_file(attempt, local_rank))
            self.procs.append(self._start(env))
        log.info("%s node %d attempt %d: started %d workers (master %s:%d)", self.who, node_rank,
                 attempt, n, addr, port)

    def stop(self, signal_number: int, grace_s: float) -> None:
        """Send `signal_number` to every worker's process group, then SIGKILL whatever of the
        groups still runs after grace_s (at once for workers that already exited), and every
        other descendant of the launcher."""
        for w in self.procs:
            if w.poll() is None:
                processes.signal_group(w.pid, signal_number)
        deadline = time.monotonic() + grace_s
        for w in self.procs:
            try:
                w.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if not processes.kill_group(w.pid):  # its pgid is its pid: the leader of a new session
                log.error("%s: processes of worker %d's group survive SIGKILL", self.who, w.pid)
            w.wait(timeout=10)
        self.procs = []
        # What left the groups (setsid, a daemon's double fork) is still below this process.
        if not processes.kill_descendants(keep=() if self._warm is None else (self._warm.proc.pid,)):
            log.error("%s: processes the workers started survive SIGKILL", self.who)

    def codes(self) -> list[int | None]:
        return [w.poll() for w in self.procs]

    def script_failure(self, attempt: int) -> script_errors.ScriptFailure | None:
        """The ScriptError some worker of this attempt ended with, if any: any worker's, not
        only the one that exited first (the others may fail on the ranks it left behind)."""
        if self._errors_dir is None:
            return None
        found = (script_errors.read(self._error_file(attempt, k)) for k in range(self.nproc_per_node))
        return next((f for f in found if f is not None), None)

    def _error_file(self, attempt: int, local_rank: int) -> Path:
        assert self._errors_dir is not None
        return self._errors_dir / f"a{attempt}-r{local_rank}.json"

