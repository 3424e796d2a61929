"""Local mode (`transom run`): a whole fault-tolerant job on one machine.

It starts a coordinator (in this process, on loopback) and one `transom launch` per
replica, each supervising `--nproc-per-replica` workers: exactly what each pod runs in
Kubernetes. The runner plays the operator's part where the launcher cannot: a launcher
that gives up (restarts exhausted) is started again as the replica's next generation.
It shows live progress (step, loss, healthy replicas, events; launch/display.py) and ends
with a table per replica and a summary. With `--log-dir` the launchers' and workers' own
output (library logs, backend banners, tracebacks) goes to one file per replica there,
and the coordinator's log to `coordinator.log`, so the terminal shows only the progress.

Faults are injected with `--inject ACTION:replica=I,step=S[,rank=R][,phase=P]`
(see transom.inject); the k-th fault aimed at a replica fires in its k-th incarnation.

With `--spares N` the runner also keeps N hot spares, as the operator does with
`spec.spareReplicas`: launchers whose workers load the script's model and wait
(launch/spare.py). When the coordinator declares a replica failed, the runner stops that
replica's launcher and promotes a spare in its place by writing the spare's labels file
(the kubelet's downward-API file in a pod), as the replica's next generation. No process
starts on that recovery path. The new spare is started once the replica it replaced has
caught up (or after REFILL_WAIT_S): on one machine its start-up (imports, the model's build)
would take the cores the catch-up and the healthy replicas need; on Kubernetes the
operator refills at once, on other nodes.

A launcher that exits 4 (`contract.EXIT_SCRIPT_ERROR`: a worker raised a ScriptError, a bug
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

import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from transom import contract, script_errors
from transom.coordinator.identity import ReplicaKeys
from transom.coordinator.membership import Settings
from transom.defaults import LOCAL, heartbeat_interval_s
from transom.detect.step_rows import DetectionSettings, read_trace, write_trace
from transom.inject import Fault
from transom.launch import gpus, processes
from transom.launch.supervisor import check_command
from transom.coordinator.thread import CoordinatorThread
from transom.launch.display import Display, closing_table, progress_line
from transom.launch.summary import finite_json, replica_rows, summarize

REFILL_WAIT_S = 60.0  # the longest a used spare waits to be replaced while a replica catches up


@dataclass
class RunConfig:
    command: list[str]
    replicas: int
    nproc_per_replica: int = 1
    min_replicas: int = 1
    injects: list[tuple[int, str]] = field(default_factory=list)  # (replica, worker fault spec)
    summary_json: str | None = None
    stats_dir: str | None = None
    collective_timeout_s: float = LOCAL.collective_timeout_s
    heartbeat_timeout_s: float = LOCAL.heartbeat_timeout_s
    max_restarts: int = 3
    max_generations: int = 3
    timeout_s: float = 3600.0
    quiet: bool = False
    checkpoint_uri: str = ""  # TRANSOM_CHECKPOINT_URI of the workers: a directory or s3://...
    checkpoint_interval: int | None = None
    checkpoint_keep: int | None = None
    backend: str = contract.DEFAULT_BACKEND  # TRANSOM_BACKEND of the workers
    log_dir: str | None = None  # the launchers' and workers' output, one file per replica; None: this terminal
    spares: int = 0  # hot spares (launch/spare.py)
    detection: str | None = None  # spec.detection as JSON (TRANSOM_DETECTION); None: the defaults
    trace_out: str | None = None  # write every rank's step signals here as one CSV trace
    devices: list[str | None] = field(init=False, default_factory=list)  # per replica, then per spare

    def __post_init__(self) -> None:
        """Everything a run could only find out by failing later is refused here, at once."""
        check_command(self.command)
        if not 1 <= self.replicas <= 64:
            raise ValueError("--replicas must be between 1 and 64 in local mode")
        if not 1 <= self.nproc_per_replica <= 1024:
            raise ValueError("--nproc-per-replica must be between 1 and 1024")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError("--min-replicas must be between 1 and --replicas")
        if self.max_restarts < 0:
            raise ValueError("--max-restarts must not be negative")
        for name, value in (("--collective-timeout", self.collective_timeout_s),
                            ("--heartbeat-timeout", self.heartbeat_timeout_s), ("--timeout", self.timeout_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.checkpoint_interval is not None and self.checkpoint_interval < 0:
            raise ValueError("--checkpoint-interval must not be negative")
        if self.checkpoint_keep is not None and self.checkpoint_keep < 1:
            raise ValueError("--checkpoint-keep must be at least 1")
        if self.backend not in contract.BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(contract.BACKENDS)}, got {self.backend!r}")
        DetectionSettings.from_spec(self.detection)  # ValueError now, not in every process later
        if not 0 <= self.spares <= 8:
            raise ValueError("--spares must be between 0 and 8 in local mode")
        self.devices = gpus.assign(gpus.visible(), self.replicas + self.spares, self.nproc_per_replica, self.backend)
        for replica, spec in self.injects:
            if replica >= self.replicas:
                raise ValueError(f"--inject names replica {replica}, but there are only {self.replicas}")
            if Fault.parse(spec).rank >= self.nproc_per_replica:
                raise ValueError(f"--inject names rank {Fault.parse(spec).rank}, but a replica has only "
                                 f"{self.nproc_per_replica} process(es) (--nproc-per-replica)")


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
            job="local",
            num_replicas=config.replicas,
            min_replicas=config.min_replicas,
            heartbeat_interval_s=heartbeat_interval_s(config.heartbeat_timeout_s),
            heartbeat_timeout_s=config.heartbeat_timeout_s,
        )
        # Each launcher gets a key that speaks for its own replica only (coordinator/identity.py);
        # the job's token stays in this process. The keys live in a directory of their own.
        self.keys = ReplicaKeys("local")
        self.peer_token = secrets.token_urlsafe(24)
        self._identity_dir = Path(tempfile.mkdtemp(prefix="transom-identity-"))
        self.coordinator = CoordinatorThread(settings, self.token, replica_keys=self.keys,
                                             detection=DetectionSettings.from_spec(config.detection))
        self.launchers: dict[int, subprocess.Popen] = {}
        self.generation: dict[int, int] = {}
        self.spares: dict[int, tuple[subprocess.Popen, Path]] = {}  # spare id -> its launcher, its podinfo dir
        self._spare_generation: dict[int, int] = {}
        self._retired: list[subprocess.Popen] = []  # launchers of replaced replicas, being stopped
        self._refills: dict[int, tuple[float, int]] = {}  # spare id -> (when, replica) it took over
        self.done: set[int] = set()
        self.faults: dict[int, list[str]] = {}
        for replica, spec in config.injects:
            self.faults.setdefault(replica, []).append(spec)
        self._t0 = time.monotonic()
        self._events_shown = 0
        self._events: list[str] = []
        self.display = Display(quiet=config.quiet)
        self.log_dir = Path(config.log_dir).absolute() if config.log_dir else None
        self.logs: dict[int, str] = {}  # replica -> its log file
        self._termination_logs: dict[subprocess.Popen, Path] = {}  # launcher -> its TRANSOM_TERMINATION_LOG
        self.script_error: str | None = None  # why a launcher exited EXIT_SCRIPT_ERROR
        self.oom_killed: str | None = None  # why a launcher exited EXIT_OOM_KILLED
        self._log_files: list = []

    # --- output ------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.display.say(text)

    def _output_of(self, who: int | str):
        """Where a replica's launcher and workers write: its log file (appended to by every
        incarnation), or None for this terminal. A spare (`who` its name) has a file of its
        own, which stays the log of the replica it takes over."""
        if self.log_dir is None:
            return None
        path = self.log_dir / (f"replica-{who}.log" if isinstance(who, int) else f"{who}.log")
        if isinstance(who, int):
            self.logs[who] = str(path)
        f = open(path, "ab")
        self._log_files.append(f)
        return f

    # --- replicas ----------------------------------------------------------------------------
    def _pod_env(self, slot: int) -> dict[str, str]:
        """What every launcher's pod environment holds; `slot` picks its GPUs (replica, then spare)."""
        env = dict(os.environ)
        env.update(
            {
                contract.ENV_JOB: "local",
                contract.ENV_NAMESPACE: "local",
                contract.ENV_NUM_REPLICAS: str(self.config.replicas),
                contract.ENV_NODE_RANK: "0",
                contract.ENV_NNODES: "1",
                contract.ENV_NPROC_PER_NODE: str(self.config.nproc_per_replica),
                contract.ENV_COORDINATOR_URL: self.coordinator.url,
                contract.ENV_PEER_TOKEN: self.peer_token,
                contract.ENV_STATS_DIR: str(self.stats_dir),
                contract.ENV_SIGNALS_DIR: str(self.stats_dir / "signals"),
                contract.ENV_COLLECTIVE_TIMEOUT: str(self.config.collective_timeout_s),
                contract.ENV_BACKEND: self.config.backend,
                # One thread per worker: replicas share this machine's cores.
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                contract.ENV_OWNER_PID: str(os.getpid()),  # the launcher stops if this process dies
            }
        )
        for var in (contract.ENV_REPLICA_ID, contract.ENV_REPLICA_GENERATION, contract.ENV_SPARE_ID,
                    contract.ENV_PODINFO_DIR, contract.ENV_FAULT, contract.ENV_COORDINATOR_TOKEN):
            env.pop(var, None)
        if self.config.devices[slot] is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.config.devices[slot]
        if self.config.detection:
            env[contract.ENV_DETECTION] = self.config.detection
        if self.config.checkpoint_uri:
            env[contract.ENV_CHECKPOINT_URI] = self.config.checkpoint_uri
        for var, value in ((contract.ENV_CHECKPOINT_INTERVAL, self.config.checkpoint_interval),
                           (contract.ENV_CHECKPOINT_KEEP, self.config.checkpoint_keep)):
            if value is not None:
                env[var] = str(value)
        return env

    def _launch(self, env: dict[str, str], output_of: int | str) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "transom", "launch",
            "--nproc-per-node", str(self.config.nproc_per_replica),
            "--max-restarts", str(self.config.max_restarts),
            "--", *self.config.command,
        ]
        out = self._output_of(output_of)
        termination_log = self._identity_dir / f"termination-{len(self._termination_logs)}"
        env[contract.ENV_TERMINATION_LOG] = str(termination_log)
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
        self._termination_logs[proc] = termination_log
        return proc

    def _job_error(self) -> tuple[int, str] | None:
        """(exit code, message) of a launcher, current or already replaced, that exited with
        EXIT_SCRIPT_ERROR or EXIT_OOM_KILLED: it ends the run (a replaced one too: its failure
        report may have made a spare take over before it exited)."""
        for proc, path in self._termination_logs.items():
            code = proc.poll()
            if code in (contract.EXIT_SCRIPT_ERROR, contract.EXIT_OOM_KILLED):
                return code, script_errors.read_termination_log(path) or f"launcher pid {proc.pid} gave no message"
        return None

    def _start(self, replica: int, generation: int) -> None:
        env = self._pod_env(replica)
        env[contract.ENV_REPLICA_ID] = str(replica)
        env[contract.ENV_REPLICA_GENERATION] = str(generation)
        key_file = self._identity_dir / f"replica-{replica}-g{generation}"
        self._write_key(key_file, replica, generation)
        env[contract.ENV_IDENTITY_TOKEN_FILE] = str(key_file)
        faults = self.faults.get(replica, []) if generation == 0 else []
        env[contract.ENV_FAULT] = ";".join(faults)
        self.launchers[replica] = self._launch(env, replica)
        self.generation[replica] = generation

    # --- hot spares --------------------------------------------------------------------------
    def _start_spare(self, spare_id: int) -> None:
        """A spare's launcher, waiting for the labels file that names its replica."""
        generation = self._spare_generation.get(spare_id, -1) + 1
        self._spare_generation[spare_id] = generation
        podinfo = self.stats_dir / "podinfo" / f"spare-{spare_id}-g{generation}"
        podinfo.mkdir(parents=True)
        _write_labels(podinfo, {contract.LABEL_JOB: "local", contract.LABEL_SPARE: str(spare_id)})
        env = self._pod_env(self.config.replicas + spare_id)
        env[contract.ENV_SPARE_ID] = str(spare_id)
        env[contract.ENV_PODINFO_DIR] = str(podinfo)
        # Empty until promotion, as a spare pod's token names no replica until its relabel.
        env[contract.ENV_IDENTITY_TOKEN_FILE] = str(self._identity_dir / f"spare-{spare_id}-g{generation}")
        self.spares[spare_id] = (self._launch(env, f"spare-{spare_id}-g{generation}"), podinfo)

    def _promote_for_failures(self) -> bool:
        """Each replica the coordinator declared failed (its current generation) is replaced by
        a spare at once, as the operator's relabel would do, not restarted in place. A spare
        whose launcher ended is started again. False: a replica used up its generations."""
        for spare_id, (proc, _) in list(self.spares.items()):
            if proc.poll() is None:
                continue
            del self.spares[spare_id]
            if self._spare_generation[spare_id] + 1 < self.config.max_generations:
                self.say(f"spare {spare_id} launcher exited with {proc.returncode}; starting it again")
                self._start_spare(spare_id)
            else:
                self.say(f"spare {spare_id} launcher exited with {proc.returncode}; no more spare {spare_id}")
        if not self.spares:
            return True
        membership = self.coordinator.server.membership
        failed = self.coordinator.call(lambda: [
            (rid, rep.identity.generation, rep.last_failure) for rid, rep in membership.replicas.items()
            if rep.state == "failed"])
        for rid, generation, reason in failed:
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
        spare_id = min(self.spares)
        proc, podinfo = self.spares.pop(spare_id)
        # Its key first: the labels are what make it act as the replica.
        self._write_key(self._identity_dir / f"spare-{spare_id}-g{self._spare_generation[spare_id]}", replica, gen)
        _write_labels(podinfo, {contract.LABEL_JOB: "local", contract.LABEL_REPLICA: str(replica),
                                contract.LABEL_GENERATION: str(gen)})
        self.launchers[replica], self.generation[replica] = proc, gen
        if self.log_dir is not None:
            self.logs[replica] = str(self.log_dir / f"spare-{spare_id}-g{self._spare_generation[spare_id]}.log")
        self.say(f"replica {replica} {why}; spare {spare_id} takes over as generation {gen}")
        self._refills[spare_id] = (time.monotonic(), replica)
        return True

    def _write_key(self, path: Path, replica: int, generation: int) -> None:
        """The replica key of (`replica`, `generation`) at `path`, readable by its owner only,
        replaced at once (a launcher reads it again when it changes)."""
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.keys.mint(replica, generation))
        tmp.rename(path)

    def _refill_spares(self) -> None:
        """Start the spares used up, once the replica each took over has caught up (a member
        of the current round, not recovering), or REFILL_WAIT_S after it took over."""
        if not self._refills:
            return
        membership = self.coordinator.server.membership

        def caught_up() -> set[int]:
            d = membership.current
            return set(d.member_ids()) - set(d.recovering) if d is not None else set()

        done = self.coordinator.call(caught_up)
        for spare_id, (used, replica) in list(self._refills.items()):
            if replica in done or time.monotonic() - used > REFILL_WAIT_S:
                del self._refills[spare_id]
                self._start_spare(spare_id)

    def _show_progress(self) -> None:
        membership = self.coordinator.server.membership
        status, events, total = self.coordinator.call(
            lambda: (membership.status(time.monotonic()), list(membership.events), membership.events_total)
        )
        first = total - len(events)  # events is a bounded deque: global index of its head
        for i, ev in enumerate(events):
            if first + i >= self._events_shown:
                self.display.event(ev.kind, ev.message)
                self._events.append(f"{ev.kind}: {ev.message}")
        self._events_shown = total
        losses = [r.last_loss for r in status.replicas if r.last_loss is not None and r.state == "healthy"]
        restarts = sum(1 for e in self._events if e.startswith("failed:"))
        line = progress_line(status.max_step, sum(losses) / len(losses) if losses else None, status.healthy_replicas,
                             status.num_replicas, status.quorum_id, list(status.members), status.paused, restarts)
        self.display.progress(line, (tuple(status.members), status.quorum_id, status.paused))

    def _outcome(self) -> tuple[int | None, int | None, dict | None]:
        """(the step at which a replica completed the job, the newest committed checkpoint, the
        finding that replicas trained on identical inputs)."""
        server = self.coordinator.server
        try:
            completed, checkpoint, duplicate = self.coordinator.call(lambda: (
                server.membership.completed_step, server.membership.last_checkpoint, server.detection.duplicate_data()))
        except Exception:  # the coordinator is gone: the summary says "unknown"
            return None, None, None
        return completed, checkpoint[0] if checkpoint else None, duplicate.model_dump() if duplicate else None

    # --- main ----------------------------------------------------------------------------------
    def _supervise(self, received: list[int]) -> int:
        """Run until every replica finished (0), one failed for good or time ran out (1), or a
        signal came (128 + its number)."""
        for r in range(self.config.replicas):
            self._start(r, 0)
        for k in range(self.config.spares):
            self._start_spare(k)
        deadline = self._t0 + self.config.timeout_s
        next_show = 0.0
        while len(self.done) < self.config.replicas:
            if received:
                self.say(f"received {signal.Signals(received[0]).name}; stopping every replica")
                return 128 + received[0]
            if time.monotonic() > deadline:
                self.say(f"timed out after {self.config.timeout_s:.0f}s")
                return 1
            ended = self._job_error()
            if ended is not None and ended[0] == contract.EXIT_SCRIPT_ERROR:  # every replica would hit it too
                self.script_error = ended[1]
                self.say(f"the training script is wrong, and retrying cannot help: {self.script_error}. "
                         "Fix the script and run again; stopping every replica")
                return contract.EXIT_SCRIPT_ERROR
            if ended is not None:  # a new generation would run out of memory the same way
                self.oom_killed = ended[1]
                self.say(f"{self.oom_killed}; stopping every replica")
                return contract.EXIT_OOM_KILLED
            if not self._promote_for_failures():
                return 1
            self._refill_spares()
            self._retired = [p for p in self._retired if p.poll() is None]
            for r, proc in list(self.launchers.items()):
                code = proc.poll()
                # EXIT_SCRIPT_ERROR, EXIT_OOM_KILLED: not replaced; the next pass ends the run.
                if code in (None, contract.EXIT_SCRIPT_ERROR, contract.EXIT_OOM_KILLED) or r in self.done:
                    continue
                if code == 0:
                    self.done.add(r)
                    continue
                if not self._replace(r, f"launcher exited with {code}"):
                    return 1
            if time.monotonic() >= next_show:
                self._show_progress()
                next_show = time.monotonic() + 0.5
            time.sleep(0.05)
        self._show_progress()
        return 0

    def _stop_launchers(self) -> None:
        """SIGTERM the launchers still running (they stop their workers), SIGKILL after 15 s."""
        every = [*self.launchers.values(), *(proc for proc, _ in self.spares.values()), *self._retired]
        for proc in every:
            if proc.poll() is None:
                proc.terminate()
        for proc in every:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:  # stuck in the kernel: the others still get stopped
                    self.say(f"launcher pid {proc.pid} did not end after SIGKILL")
        # A launcher SIGKILLed (here or by anyone) could not stop what its workers started outside
        # their process groups: this process adopted it (a subreaper) and stops it now.
        if not processes.kill_descendants():
            self.say("processes the replicas started survive SIGKILL")

    def run(self) -> int:
        handler = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            handler = self._log_to_file(self.log_dir / "coordinator.log")
        try:
            return self._run()
        finally:
            if handler is not None:
                logger = logging.getLogger("transom")
                logger.removeHandler(handler)
                logger.propagate = True
                handler.close()
            for f in self._log_files:
                f.close()
            shutil.rmtree(self._identity_dir, ignore_errors=True)

    @staticmethod
    def _log_to_file(path: Path) -> logging.Handler:
        """The coordinator's log (it runs in this process) to `path` instead of the terminal."""
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger = logging.getLogger("transom")
        logger.addHandler(handler)
        logger.propagate = False
        return handler

    def _run(self) -> int:
        processes.adopt_orphans()  # so that _stop_launchers finds what a killed launcher left
        self.coordinator.start()
        self.say(
            f"coordinator at {self.coordinator.url}; {self.config.replicas} replicas x "
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
            self._stop_launchers()
            completed_step, last_checkpoint, duplicate_data = self._outcome()
            self.coordinator.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
        if exit_code == 0 and completed_step is None:
            self.say("every launcher exited 0, but no replica completed the job")
            exit_code = 1
        summary = summarize(
            self.stats_dir, self.config.replicas, {r: len(f) for r, f in self.faults.items()},
            time.monotonic() - self._t0,
        )
        summary["exit_code"] = exit_code
        summary["completed_step"] = completed_step
        summary["last_checkpoint"] = last_checkpoint
        summary["script_error"] = self.script_error
        summary["oom_killed"] = self.oom_killed
        summary["duplicate_data"] = duplicate_data
        rows = replica_rows(self.stats_dir, self.config.replicas, self.logs)
        if self.config.trace_out:
            n = merge_trace(self.stats_dir / "signals", Path(self.config.trace_out))
            self.say(f"trace of {n} rank-steps written to {self.config.trace_out}")
        if self._own_stats_dir:
            shutil.rmtree(self.stats_dir, ignore_errors=True)
        summary["events"] = self._events
        if self.logs:
            summary["logs"] = {str(r): path for r, path in sorted(self.logs.items())}
        self.display.end_live()
        for line in closing_table(rows):
            self.display.write(line)
        self.say("summary " + finite_json({k: v for k, v in summary.items() if k not in ("events", "logs")}))
        if self.config.summary_json:
            Path(self.config.summary_json).write_text(finite_json(summary, indent=2) + "\n")
        return exit_code


def merge_trace(directory: Path, out: Path) -> int:
    """Every worker's signal rows (all incarnations) as one CSV trace in step order."""
    rows = []
    for path in sorted(directory.glob("signals-*.csv")):
        try:
            for row in read_trace(path):
                rows.append(row)
        except ValueError as e:  # a worker killed mid-row: keep what it wrote before
            logging.getLogger("transom.launch").info("trace: %s", e)
    rows.sort(key=lambda r: (r.step, r.replica, r.rank))
    with open(out, "w", newline="") as f:
        write_trace(rows, f)
    return len(rows)


def _write_labels(directory: Path, labels: dict[str, str]) -> None:
    """A downward-API labels file, replaced at once (the kubelet swaps the volume's contents)."""
    tmp = directory / "labels.tmp"
    tmp.write_text("".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(labels.items())))
    tmp.rename(directory / "labels")
