"""Local mode (`transom run`): a whole fault-tolerant job on one machine.

It starts a coordinator (in this process, on loopback) and one `transom launch` per
replica, each supervising `--nproc-per-replica` workers: exactly what each pod runs in
Kubernetes. The runner plays the operator's part where the launcher cannot: a launcher
that gives up (restarts exhausted) is started again as the replica's next generation.
It shows live progress (step, loss, healthy replicas, events; launch/display.py) and ends
with a table per replica and a summary. With `--log-dir` the launchers' and workers' own
output (library logs, backend banners, tracebacks) goes to one file per replica there,
and the coordinator's log to `coordinator.log`, so the terminal shows only the progress.

The run is one job, named by `--job-name` or else a fresh `local-<8 hex>` (job_identity.py),
which it prints first and puts in its summary: its checkpoint location records that name, and
a later run continues the job, and resumes from the location, only under the same name.

Faults are injected with `--inject ACTION:replica=I,step=S[,rank=R][,phase=P]`
(see transom.inject); the k-th fault aimed at a replica fires in its k-th incarnation.

The runner reads the job as an operator or a dashboard would, through the coordinator's
HTTP API with the job's token (GET /v1/status; launch/job_view.py), never through the
coordinator's objects, though the coordinator runs in its process. The launchers are
started as pods would be (launch/local_pods.py).

With `--spares N` the runner also keeps N hot spares, as the operator does with
`spec.spareReplicas` (launch/local_spares.py): when the coordinator declares a replica
failed, the runner stops that replica's launcher and promotes a spare in its place by
writing the spare's labels file (the kubelet's downward-API file in a pod), as the
replica's next generation. No process starts on that recovery path.

A launcher that exits 6 (`contract.EXIT_PREFLIGHT_FAILED`: a pre-flight check failed, with
`--preflight`) is replaced like any other, and the run says which check. A launcher that
exits 4 (`contract.EXIT_SCRIPT_ERROR`: a worker raised a ScriptError, a bug
in the script that every replica and every retry would hit again) ends the whole run at
once: the others are stopped, the message is printed once and is the summary's
`script_error`, and `transom run` exits 4 too (script_errors.py). So does one that exits 5
(`contract.EXIT_OOM_KILLED`: its workers were OOMKilled defaults.OOM_KILL_LIMIT times; a new
generation would get the same memory limit): its message is the summary's `oom_killed`.

Nothing the run started outlives it. Each launcher stops its workers and whatever they
started (launch/processes.py); the runner is the subreaper of every process below it, so
what a launcher that was SIGKILLed could not stop (a worker's `setsid` child) is
re-parented to the runner and stopped when the run ends.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from transom import contract
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.membership import Settings
from transom.coordinator.models import JobStatus
from transom.coordinator.thread import CoordinatorThread
from transom.defaults import heartbeat_interval_s
from transom.detect.step_rows import DetectionSettings
from transom.launch import processes
from transom.launch.config import LaunchConfig, RunConfig, default_of
from transom.launch.display import Display, closing_table
from transom.launch.end_on import EndOn
from transom.launch.job_view import EventFeed, caught_up, failed_incarnations, progress
from transom.launch.local_pods import LocalPods
from transom.launch.local_spares import SparePool
from transom.launch.summary import finite_json, merge_trace, replica_rows, summarize

POLL_S = 0.05  # how often the runner looks at its launchers (and, with spares, at the job's status)
SHOW_EVERY_S = 0.5  # how often the progress line is redrawn
STATUS_TIMEOUT_S = 5.0  # one GET /v1/status, retries included (the coordinator is on loopback)
# How long a SIGTERMed launcher gets before SIGKILL: its own grace for its workers, and then some.
LAUNCHER_GRACE_S = default_of(LaunchConfig, "term_grace_s") + 5.0


class LocalRun:
    def __init__(self, config: RunConfig):
        self.config = config
        self.token = secrets.token_urlsafe(24)
        self._own_stats_dir = not config.stats_dir
        if config.stats_dir:
            self.stats_dir = Path(config.stats_dir)
            self.stats_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.stats_dir = Path(tempfile.mkdtemp(prefix="transom-run-"))
        settings = Settings(
            job=config.job_name,
            num_replicas=config.replicas,
            min_replicas=config.min_replicas,
            heartbeat_interval_s=heartbeat_interval_s(config.heartbeat_timeout_s),
            heartbeat_timeout_s=config.heartbeat_timeout_s,
        )
        self.log_dir = Path(config.log_dir).absolute() if config.log_dir else None
        self.pods = LocalPods(config, self.stats_dir, self.log_dir)
        self.coordinator = CoordinatorThread(settings, self.token, replica_keys=self.pods.keys,
                                             detection=DetectionSettings.from_spec(config.detection))
        self.client: CoordinatorClient | None = None  # the coordinator's API, once it listens
        self.launchers: dict[int, subprocess.Popen] = {}
        self.generation: dict[int, int] = {}
        self.spares = SparePool(self.pods, config.max_generations, self.say)
        self._retired: list[subprocess.Popen] = []  # launchers of replaced replicas, being stopped
        self.done: set[int] = set()
        self.faults: dict[int, list[str]] = {}
        for replica, spec in config.injects:
            self.faults.setdefault(replica, []).append(spec)
        self._t0 = time.monotonic()
        self._feed = EventFeed()
        self._events: list[str] = []
        self.end_on = EndOn(config.end_on, config.end_margin)  # --end-on: the events that end the job
        self.display = Display(quiet=config.quiet)
        self.script_error: str | None = None  # why a launcher exited EXIT_SCRIPT_ERROR
        self.oom_killed: str | None = None  # why a launcher exited EXIT_OOM_KILLED
        self.diverged: str | None = None  # the coordinator found the replicas' states different, no majority

    def say(self, text: str) -> None:
        self.display.say(text)

    def _status(self) -> JobStatus:
        assert self.client is not None
        return self.client.status(timeout_s=STATUS_TIMEOUT_S)

    # --- replicas ----------------------------------------------------------------------------
    def _start(self, replica: int, generation: int) -> None:
        faults = self.faults.get(replica, []) if generation == 0 else []
        self.launchers[replica] = self.pods.start_replica(replica, generation, faults)
        self.generation[replica] = generation

    def _promote_for_failures(self) -> bool:
        """Each replica the coordinator declared failed (its current generation) is replaced by
        a spare at once, as the operator's relabel would do, not restarted in place. A spare
        whose launcher ended is started again. False: a replica used up its generations."""
        self.spares.restart_ended()
        if not self.spares:
            return True
        for rid, generation, reason in failed_incarnations(self._status()):
            if self.spares and rid not in self.done and generation == self.generation.get(rid):
                if not self._replace(rid, f"failed ({reason})"):
                    return False
        return True

    def _replace(self, replica: int, why: str) -> bool:
        """Replace a failed replica by its next generation: a spare if one is waiting (its old
        launcher is stopped, as a deleted pod's would be), else a new launcher. False once
        the replica has used up its generations."""
        gen = self.generation[replica] + 1
        if gen >= self.config.max_generations:
            self.say(f"replica {replica} failed {gen} generations; giving up")
            return False
        old = self.launchers[replica]
        if old.poll() is None:
            old.terminate()  # its launcher forwards SIGTERM to its workers, then SIGKILLs them
        self._retired.append(old)
        if not self.spares:
            self.say(f"replica {replica} {why}; starting generation {gen}")
            self._start(replica, gen)
            return True
        spare_id, self.launchers[replica] = self.spares.take(replica, gen)
        self.generation[replica] = gen
        self.say(f"replica {replica} {why}; spare {spare_id} takes over as generation {gen}")
        return True

    def _show_progress(self) -> None:
        status = self._status()
        fresh = self._feed.new(status.events)
        for ev in fresh:
            self.display.event(ev.kind, ev.message)
            self._events.append(f"{ev.kind}: {ev.message}")
        restarts = sum(1 for e in self._events if e.startswith("failed:"))
        self.display.progress(progress(status, restarts), (tuple(status.members), status.quorum_id, status.paused))
        assert self.client is not None
        if self.end_on.watch(fresh, status.max_step, self.client.finish) and self.end_on.end_step is not None:
            self.say(self.end_on.news())

    def _outcome(self) -> tuple[int | None, int | None, dict | None]:
        """(the step at which a replica completed the job, the newest committed checkpoint, the
        finding that replicas trained on identical inputs)."""
        try:
            status = self._status()
        except Exception:  # the coordinator is gone: the summary says "unknown"
            return None, None, None
        duplicate = status.duplicate_data
        self.diverged = status.diverged
        return status.completed_step, status.last_checkpoint, duplicate.model_dump() if duplicate else None

    # --- main ----------------------------------------------------------------------------------
    def _job_ended(self) -> int | None:
        """EXIT_SCRIPT_ERROR or EXIT_OOM_KILLED once a launcher exited with it, else None."""
        ended = self.pods.job_error()
        if ended is not None and ended[0] == contract.EXIT_SCRIPT_ERROR:  # every replica would hit it too
            self.script_error = ended[1]
            self.say(f"the training script is wrong, and retrying cannot help: {self.script_error}. "
                     "Fix the script and run again; stopping every replica")
            return contract.EXIT_SCRIPT_ERROR
        if ended is not None:  # a new generation would run out of memory the same way
            self.oom_killed = ended[1]
            self.say(f"{self.oom_killed}; stopping every replica")
            return contract.EXIT_OOM_KILLED
        return None

    def _tend_launchers(self) -> bool:
        """Mark the replicas whose launcher finished; replace those whose launcher failed.
        False once a replica used up its generations."""
        self._retired = [p for p in self._retired if p.poll() is None]
        for r, proc in list(self.launchers.items()):
            code = proc.poll()
            # EXIT_SCRIPT_ERROR, EXIT_OOM_KILLED: not replaced; the next pass ends the run.
            if code in (None, contract.EXIT_SCRIPT_ERROR, contract.EXIT_OOM_KILLED) or r in self.done:
                continue
            if code == 0:
                self.done.add(r)
            elif not self._replace(r, self._why_ended(proc, code)):
                return False
        return True

    def _why_ended(self, proc: subprocess.Popen, code: int) -> str:
        """What the run says about a launcher that exited non-zero; with a failed pre-flight, the
        checks that failed (its termination message), as the operator's ReplicaFailed Event would."""
        said = self.pods.termination_message(proc) if code == contract.EXIT_PREFLIGHT_FAILED else None
        return f"launcher exited with {code}" + (f" ({said})" if said else "")

    def _supervise(self, received: list[int]) -> int:
        """Run until every replica finished (0), one failed for good or time ran out (1), or a
        signal came (128 + its number)."""
        for r in range(self.config.replicas):
            self._start(r, 0)
        for k in range(self.config.spares):
            self.spares.start(k)
        deadline = self._t0 + self.config.timeout_s
        next_show = 0.0
        while len(self.done) < self.config.replicas:
            if received:
                self.say(f"received {signal.Signals(received[0]).name}; stopping every replica")
                return 128 + received[0]
            if time.monotonic() > deadline:
                self.say(f"timed out after {self.config.timeout_s:.0f}s")
                return 1
            ended = self._job_ended()
            if ended is not None:
                return ended
            if not self._promote_for_failures():
                return 1
            if self.spares.refills_due():
                self.spares.refill(caught_up(self._status()))
            if not self._tend_launchers():
                return 1
            if time.monotonic() >= next_show:
                self._show_progress()
                next_show = time.monotonic() + SHOW_EVERY_S
            time.sleep(POLL_S)
        self._show_progress()
        return 0

    def run(self) -> int:
        handler = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            handler = _log_to_file(self.log_dir / "coordinator.log")
        try:
            return self._run()
        finally:
            if handler is not None:
                logger = logging.getLogger("transom")
                logger.removeHandler(handler)
                logger.propagate = True
                handler.close()
            self.pods.close()

    def _run(self) -> int:
        processes.adopt_orphans()  # so that stop_launchers finds what a killed launcher left
        self.pods.coordinator_url = self.coordinator.start()
        self.client = CoordinatorClient(self.coordinator.url, self.token, timeout_s=STATUS_TIMEOUT_S)
        self.say(
            f"{_job_line(self.config)}; coordinator at {self.coordinator.url}; {self.config.replicas} replicas x "
            f"{self.config.nproc_per_replica} processes; injecting {sum(map(len, self.faults.values()))} fault(s)"
        )
        # SIGTERM or Ctrl-C stops the run like an error would: every launcher is stopped (they
        # stop their workers' process groups) before this process exits.
        received: list[int] = []
        previous = {s: signal.signal(s, lambda signum, _f: received.append(signum))
                    for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            exit_code = self._supervise(received)
        finally:
            every = [*self.launchers.values(), *self.spares.launchers(), *self._retired]
            processes.stop_launchers(every, self.say, LAUNCHER_GRACE_S)
            completed_step, last_checkpoint, duplicate_data = self._outcome()
            self.coordinator.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
        if exit_code == 0 and completed_step is None:
            self.say("every launcher exited 0, but no replica completed the job")
            exit_code = 1
        if self.diverged is not None:  # also found after the last step: the job's weights are not one state
            self.say(f"the replicas diverged: {self.diverged}")
            exit_code = exit_code or contract.EXIT_SCRIPT_ERROR
        outcome = {"job": self.config.job_name, "exit_code": exit_code, "completed_step": completed_step,
                   "last_checkpoint": last_checkpoint, "script_error": self.script_error,
                   "oom_killed": self.oom_killed, "duplicate_data": duplicate_data, "diverged": self.diverged}
        if self.config.end_on:
            outcome["end_on"] = self.end_on.summary()
        self._conclude(outcome)
        return exit_code

    def _conclude(self, outcome: dict) -> None:
        """The closing table, the summary line, the trace and the summary file."""
        summary = summarize(
            self.stats_dir, self.config.replicas, {r: len(f) for r, f in self.faults.items()},
            time.monotonic() - self._t0,
        )
        summary.update(outcome)
        rows = replica_rows(self.stats_dir, self.config.replicas, self.pods.logs)
        if self.config.trace_out:
            n = merge_trace(self.stats_dir / "signals", Path(self.config.trace_out))
            self.say(f"trace of {n} rank-steps written to {self.config.trace_out}")
        if self._own_stats_dir:
            shutil.rmtree(self.stats_dir, ignore_errors=True)
        summary["events"] = self._events
        if self.pods.logs:
            summary["logs"] = {str(r): path for r, path in sorted(self.pods.logs.items())}
        self.display.end_live()
        for line in closing_table(rows):
            self.display.write(line)
        self.say("summary " + finite_json({k: v for k, v in summary.items() if k not in ("events", "logs")}))
        if self.config.summary_json:
            Path(self.config.summary_json).write_text(finite_json(summary, indent=2) + "\n")


def _job_line(config: RunConfig) -> str:
    """The run's job, as the user continues it later: "job local-3f2a9c1e, checkpoints in /ckpt
    (a later `transom run --job-name local-3f2a9c1e` continues it)"."""
    name, uri = config.job_name, config.checkpoint_uri
    return f"job {name}" + (f", checkpoints in {uri} (a later `transom run --job-name {name}` continues it)"
                            if uri else "")


def _log_to_file(path: Path) -> logging.Handler:
    """The coordinator's log (it runs in this process) to `path` instead of the terminal."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("transom")
    logger.addHandler(handler)
    logger.propagate = False
    return handler
