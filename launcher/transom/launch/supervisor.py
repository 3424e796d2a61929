"""The in-pod launcher (`transom launch -- python train.py ...`): supervises one node's workers.

It starts `nproc_per_node` workers with torchrun's environment for *its own replica* (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and treats the replica
as the unit of failure: when any worker exits non-zero, it tells the coordinator at once (so
the other replicas stop waiting for this one), stops the remaining workers and starts them
all again as a new attempt, up to `max_restarts`. It also watches the coordinator (a
long-poll, launch/state_watch.py): a replica the coordinator declared dead (missed
heartbeats, a hang, a detector's verdict) is killed and restarted the same way. It forwards
the workers' step signals to the coordinator's detectors and restarts a replica whose
workers stopped making progress, with their stacks in the log (launch/signal_forwarder.py).
SIGTERM/SIGINT (the pod is going) are reported to the coordinator as the replica's failure,
then forwarded to the workers. Each worker is the leader of a process group of its own, and
signals go to the whole group: whatever a worker started is stopped with it, and after every
attempt (however it ended) nothing of its groups is left running, nor anything that left
them (a `setsid` child: the launcher is the subreaper of its workers' descendants;
processes.py). Workers also die with the launcher itself.

A worker the kernel OOM-killed (the container's memory cgroup counted a kill while it died:
launch/oom.py) is reported as `OOMKilled: worker rank K was OOMKilled (memory limit X)` and
restarted in place like a crash; at the defaults.OOM_KILL_LIMIT-th such kill the launcher
stops instead, writes `OOMKilled: replica R was OOMKilled N times at memory limit X: raise
resources.limits.memory or lower the batch size` to TRANSOM_TERMINATION_LOG and exits 5:
the same script at the same limit would only run out of memory again. One that gives up on
its restarts after an OOM kill writes the same message and exits 1.

A worker that ends with a ScriptError (a bug in the script: every retry would fail the same
way; transom/script_errors.py) ends the replica without a restart: the launcher reports it
to the coordinator as `ScriptError: ...`, writes the message to TRANSOM_TERMINATION_LOG
(the container's termination message in a pod) and exits 4, and whoever started it ends
the job.

Workers that all exit 0 have finished only if the job is complete: the launcher asks the
coordinator, and workers that stopped before a replica completed the job (a script that
ends early, or never trains) are a failure like any other.

MASTER_ADDR is found without cluster DNS (launch/rendezvous.py): a single-node replica uses
loopback; node 0 of a multi-node replica publishes its address through the coordinator and
the others read it.

A hot spare's launcher (TRANSOM_SPARE_ID, single-node replicas) starts its workers at once;
they load the model and wait for the promotion (launch/spare.py). Until the labels file
names a replica, the launcher has no identity to report to the coordinator: it only
restarts workers that fail. From the promotion on it supervises as that replica.

With TRANSOM_PREFLIGHT (spec.preflight), the launcher runs the pre-flight checks on its
node before the first attempt, before an in-place restart after a hardware-class failure,
and every spareIntervalSeconds while a spare waits (launch/preflight.py); a failure ends it
with a `PreflightFailed: ...` termination message.

Exit codes (transom.contract): 0 all workers succeeded, 1 restarts exhausted, 2 usage,
3 superseded by a newer incarnation, 4 a script error, 5 OOMKilled too often, 6 a pre-flight
check failed, 128+N terminated by signal N.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

from transom import contract, script_errors
from transom.coordinator.client import CoordinatorClient, credential
from transom.coordinator.models import FailureReport, Identity
from transom.launch import oom, preflight, processes, rendezvous, spare
from transom.launch.config import LaunchConfig
from transom.launch.processes import describe_exit, to_blame
from transom.launch.rendezvous import free_port  # noqa: F401  (where tests and benchmarks take it from)
from transom.launch.signal_forwarder import LAST_FLUSH_PATIENCE_S, SignalForwarder
from transom.launch.state_watch import StateWatch
from transom.launch.workers import Worker, WorkerGroup
from transom.words import IncarnationState

log = logging.getLogger("transom.launch")
POLL_S = 0.05
PROGRESS_POLL_S = 0.2  # the workers' signal files (launch/signal_forwarder.py)
COMPLETION_CHECK_S = 30.0  # how long workers that exited 0 wait for the coordinator to confirm
REPORT_TIMEOUT_S = 2.0  # a failure report: the coordinator also notices by heartbeat, so never wait long


class Outcome(StrEnum):
    """How one attempt of the replica's workers ended (Supervisor._watch)."""

    OK = "ok"  # every worker succeeded
    FAILED = "failed"  # a worker failed, hung, or the coordinator declared the replica failed
    SCRIPT_ERROR = "script_error"  # a worker raised a ScriptError: every retry would fail alike
    SUPERSEDED = "superseded"  # a newer incarnation of the replica registered
    SIGNAL = "signal"  # the launcher was told to stop
    PREFLIGHT = "preflight"  # a waiting spare's periodic check failed


def restart_delay_s(attempt: int, backoff_s: float) -> float:
    """How long to wait before starting `attempt`: the first restart at once (it is on the
    recovery path, and nothing says yet that restarting fails), then `backoff_s` doubling
    per attempt up to 30 s, so that a script that crashes at once does not spin."""
    return 0.0 if attempt <= 1 else min(backoff_s * 2.0 ** min(attempt - 2, 64), 30.0)  # 2**1024: OverflowError


def backoff(seconds: float, going_on: Callable[[], bool]) -> bool:
    """Sleep before a restart; False if `going_on()` turned False meanwhile (a signal came:
    nothing is started then)."""
    deadline = time.monotonic() + seconds
    while going_on() and time.monotonic() < deadline:
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    return going_on()


class Launcher:
    """Owns the worker processes of one node; `run()` returns the launcher's exit code."""

    def __init__(self, config: LaunchConfig, env: contract.ReplicaEnv, environ: dict[str, str] | None = None):
        """`environ`: the pod environment `env` was read from (default os.environ)."""
        self.config = config
        self.env = env
        # What every worker starts with; a promotion sets its identity.
        self._environ = dict(os.environ if environ is None else environ)
        self._podinfo = spare.podinfo_dir(self._environ) if env.is_spare else None  # while a spare
        self.client = CoordinatorClient(env.coordinator_url, credential(env.identity_token_file, env.coordinator_token),
                                        timeout_s=10)
        self.group = WorkerGroup(config.command, config.nproc_per_node, self.who)
        self._signal: int | None = None
        self._signals_dir, self._own_signals_dir = _signals_dir(self._environ)
        self._forwarder: SignalForwarder | None = None
        # The container's OOM-kill counter (launch/oom.py): how an OOM kill is told from a SIGKILL.
        self._oom = oom.Counter(oom.find())
        self._oom_kills = 0  # of this launcher's workers, all attempts
        self._checks = preflight.NodeChecks(self._environ, self.client)  # ValueError: TRANSOM_PREFLIGHT is malformed

    @property
    def workers(self) -> list[Worker]:
        return self.group.procs

    def identity(self, attempt: int) -> Identity:
        return Identity(replica_id=self.env.replica_id, generation=self.env.generation, attempt=attempt)

    @property
    def who(self) -> str:
        return f"spare {self.env.spare_id}" if self.env.is_spare else f"replica {self.env.replica_id}"

    def _promote_if_assigned(self) -> None:
        """A spare whose labels file now names a replica supervises as that replica from now on
        (its workers read the same file and register as it)."""
        assert self._podinfo is not None
        if (found := spare.poll_assignment(self._podinfo)) is None:
            return
        log.info("%s promoted to replica %d generation %d", self.who, found.replica_id, found.generation)
        self.env = self.env.promoted(found.replica_id, found.generation)
        self._environ = spare.promoted_environ(self._environ, found)
        self._podinfo = None
        self.group.who = self.who
        self._checks.promoted()

    # --- one attempt -----------------------------------------------------------------------
    def _spawn(self, attempt: int) -> None:
        """Start this attempt's workers (none if a signal came first: `_watch` then returns)."""
        master = rendezvous.master_address(self.env, self.client, lambda: self.identity(attempt), self.who,
                                           self.config.rendezvous_timeout_s, stopped=lambda: self._signal is not None)
        if master is None:
            return
        self._oom.mark()
        self.group.spawn(self._environ, self.env.node_rank, self.env.nnodes, attempt, *master)

    def _report(self, attempt: int, reason: str, exit_code: int | None) -> None:
        if self.env.is_spare:
            return  # no replica to speak for: nobody waits for a spare
        try:
            self.client.report_failure(
                FailureReport(identity=self.identity(attempt), reason=reason, exit_code=exit_code),
                timeout_s=REPORT_TIMEOUT_S,
            )
        except Exception as e:  # the coordinator also notices by heartbeat; never block on it
            log.warning("could not report failure of %s: %s", self.who, e)

    def _watch_progress(self, attempt: int) -> str | None:
        """Forward the workers' signals; the reason to restart if they hang."""
        if self.env.is_spare or self._signals_dir is None:
            return None  # no identity yet (nothing to forward, nobody waits for it), or no signals
        if self._forwarder is None:
            n = self.config.nproc_per_node
            ranks = [self.env.node_rank * n + k for k in range(n)]
            self._forwarder = SignalForwarder(self._signals_dir, self.identity(attempt), self.env.node_rank, ranks,
                                              self.client, self.config.detection)
        hang = self._forwarder.poll(time.monotonic())
        if hang is None:
            return None
        self._forwarder.report_hang(hang, self.workers)
        reason = (f"hang: rank {hang.rank} made no progress for {hang.stalled_s:.0f}s after step {hang.step - 1} "
                  "(every worker's stacks are in the launcher log)")
        self._report(attempt, reason, None)
        return reason

    def _watch(self, attempt: int) -> tuple[Outcome, str]:
        """Wait for this attempt to end: (outcome, reason)."""
        watch: StateWatch | None = None  # the coordinator's view of this replica (launch/state_watch.py)
        next_progress_poll = 0.0
        try:
            while True:
                if self._signal is not None:
                    return Outcome.SIGNAL, f"received {signal.Signals(self._signal).name}"
                if self._podinfo is not None:
                    self._promote_if_assigned()
                if (failure := self._checks.poll_spare()) is not None:
                    return Outcome.PREFLIGHT, failure
                ended = self._workers_ended(attempt)
                if ended is not None:
                    return ended
                if time.monotonic() >= next_progress_poll:
                    next_progress_poll = time.monotonic() + PROGRESS_POLL_S
                    hung = self._watch_progress(attempt)
                    if hung is not None:
                        return Outcome.FAILED, hung
                if not self.env.is_spare:  # a spare has no identity until it is promoted
                    if watch is None:
                        watch = StateWatch(self.client.url, self.client.credential, self.identity(attempt))
                    state = watch.latest  # None: not answered yet, or the coordinator is unreachable
                    if state is not None and state.state == IncarnationState.FAILED:
                        return Outcome.FAILED, f"coordinator declared the replica failed: {state.reason}"
                    if state is not None and state.state == IncarnationState.SUPERSEDED:
                        return Outcome.SUPERSEDED, "a newer incarnation of this replica registered"
                time.sleep(POLL_S)
        finally:
            if watch is not None:
                watch.stop()

    def _workers_ended(self, attempt: int) -> tuple[Outcome, str] | None:
        codes = self.group.codes()
        rank = to_blame(codes)  # a worker killed by a signal, before another's echo of it
        if rank is not None:
            code = codes[rank]
            assert code is not None
            failure = self.group.script_failure(attempt)
            if failure is not None:  # reported as what it is, not as a crash
                reason = failure.describe(self.who)
                self._report(attempt, reason, code if code >= 0 else None)
                return Outcome.SCRIPT_ERROR, reason
            global_rank = self.env.node_rank * self.config.nproc_per_node + rank
            reason = self._oom.report(global_rank, code) or f"worker local rank {rank} {describe_exit(code)}"
            self._report(attempt, reason, code if code >= 0 else None)
            return Outcome.FAILED, reason
        if all(c == 0 for c in codes):
            if self.env.is_spare:
                return Outcome.FAILED, "the workers of a spare exited before it was promoted"
            return self._finished(attempt)
        return None

    def _finished(self, attempt: int) -> tuple[Outcome, str]:
        """Every worker exited 0: 'ok' if the coordinator says the job completed, else 'failed'."""
        try:
            state = self.client.replica_state(self.identity(attempt), timeout_s=COMPLETION_CHECK_S)
        except Exception as e:
            reason = f"workers exited 0, but the coordinator could not confirm that the job completed: {e}"
        else:
            if state.job_completed:
                return Outcome.OK, "all workers succeeded"
            reason = "workers exited 0 before the job completed (no replica reached the last step)"
        self._report(attempt, reason, 0)
        return Outcome.FAILED, reason

    # --- main loop ---------------------------------------------------------------------------
    def _oom_message(self) -> str:
        return f"{contract.OOM_KILLED}: {contract.oom_advice(self.who, self._oom_kills, self._oom.limit())}"

    def _ended(self, attempt: int, outcome: Outcome, reason: str) -> int | None:
        """The exit code once an attempt that did not succeed ends the launcher, else None
        (restart). Its workers are stopped already."""
        # A worker writes its ScriptError before it reports the replica failed, so the file is
        # there also when the coordinator's word came before the worker's exit.
        failure = self.group.script_failure(attempt) if outcome == Outcome.FAILED else None
        if failure is not None:
            outcome, reason = Outcome.SCRIPT_ERROR, failure.describe(self.who)
        if outcome == Outcome.SUPERSEDED:
            log.error("%s: %s; exiting", self.who, reason)
            return contract.EXIT_EVICTED
        if outcome == Outcome.SCRIPT_ERROR:
            log.error("%s: %s; not restarting: every attempt would fail the same way", self.who, reason)
            script_errors.write_termination_log(reason, self._environ)
            return contract.EXIT_SCRIPT_ERROR
        oom_killed = bool(self._oom.rose())  # also when the coordinator's word came first
        if oom_killed:
            self._oom_kills += 1
            if not reason.startswith(contract.OOM_KILLED):
                reason = (f"{contract.OOM_KILLED}: the kernel OOM-killed a process of the container "
                          f"({self._oom.limit_text()}); {reason}")
        log.warning("%s attempt %d failed: %s", self.who, attempt, reason)
        if self._oom_kills >= self.config.oom_kill_limit:  # restarting at the same limit: a crash loop
            log.error("%s: %s; not restarting", self.who, self._oom_message())
            script_errors.write_termination_log(self._oom_message(), self._environ)
            return contract.EXIT_OOM_KILLED
        if attempt >= self.config.max_restarts:
            log.error("%s: giving up after %d restarts", self.who, attempt)
            if oom_killed:  # whoever started it learns why from the termination message
                script_errors.write_termination_log(self._oom_message(), self._environ)
            return contract.EXIT_WORKERS_FAILED
        return None

    def _preflight_failed(self) -> int | None:
        """Run the pre-flight checks, if any; the exit code if they failed or a signal came."""
        failure = self._checks.run(self.env, self._environ, stopped=lambda: self._signal is not None)
        if self._signal is not None:
            return 128 + self._signal
        return None if failure is None else preflight.unfit(self.who, failure, self._environ)

    def run(self) -> int:
        def on_signal(signum, _frame):
            self._signal = signum

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        processes.adopt_orphans()  # so that stopping the workers finds what left their groups
        try:
            self.group.warm_up(self._environ)  # torch imported while the pre-flight checks and rendezvous run
            attempt = 0
            code = self._preflight_failed()
            if code is not None:
                return code
            while True:
                self._spawn(attempt)
                outcome, reason = self._watch(attempt)
                codes = self.group.codes()
                if self._forwarder is not None:  # the attempt's last rows
                    self._forwarder.poll(time.monotonic())
                    self._forwarder.flush(patience_s=LAST_FLUSH_PATIENCE_S)
                    self._forwarder = None
                if outcome == Outcome.OK:
                    self.group.stop(signal.SIGKILL, 0.0)  # they exited: this sweeps what they left
                    return contract.EXIT_OK
                if outcome == Outcome.SIGNAL:
                    assert self._signal is not None
                    # The pod is going (deleted, preempted, drained): say so at once, so that
                    # the other replicas' next round need not wait for this one to be missed.
                    if self.workers:
                        self._report(attempt, f"{reason}: the launcher is stopping", 128 + self._signal)
                    self.group.stop(self._signal, self.config.term_grace_s)
                    return 128 + self._signal
                # A failed replica's workers may be hung in a collective or stopped: no grace.
                self.group.stop(signal.SIGKILL, 0.0)
                if outcome == Outcome.PREFLIGHT:  # a waiting spare's periodic check
                    return preflight.unfit(self.who, reason, self._environ)
                code = self._ended(attempt, outcome, reason)
                if code is None and preflight.hardware_class(reason, codes):
                    code = self._preflight_failed()
                if code is not None:
                    return code
                attempt += 1
                if not backoff(restart_delay_s(attempt, self.config.restart_backoff_s), lambda: self._signal is None):
                    assert self._signal is not None
                    return 128 + self._signal
        finally:
            self._checks.close()
            self.group.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self._own_signals_dir and self._signals_dir is not None:
                shutil.rmtree(self._signals_dir, ignore_errors=True)


def _signals_dir(environ: dict[str, str]) -> tuple[Path | None, bool]:
    """Where the workers write their step signals (ft/guard.py): TRANSOM_SIGNALS_DIR, or a
    directory of the launcher's own (True: remove it at the end). Sets it in `environ`."""
    given = environ.get(contract.ENV_SIGNALS_DIR)
    try:
        directory = Path(given or tempfile.mkdtemp(prefix="transom-signals-"))
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only file system without a writable /tmp: train without them
        log.warning("no directory for the workers' step signals (%s): anomaly detection and the hang "
                    "watchdog are off for this pod", e)
        environ.pop(contract.ENV_SIGNALS_DIR, None)
        return None, False
    environ[contract.ENV_SIGNALS_DIR] = str(directory)
    return directory, not given
