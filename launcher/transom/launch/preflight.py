"""The launcher's pre-flight: `transom check` on this pod's node before its workers start.

The operator passes `spec.preflight` as TRANSOM_PREFLIGHT (the checks, their budget, a
waiting spare's interval). The launcher runs the checks (transom.check) in a child process,
`python -m transom check --json`, rather than in itself: the checks import torch and touch
the device, which the launcher never does (it stays small and owns nothing of the device's
state), and a child that overruns its budget is killed with whatever it started (its own
process group). The child's JSON answer is the launcher's own child's, in its own pod: it
speaks for this node only.

When: before the first attempt of a pod (a new replica pod, or a spare as it starts); before
an in-place restart after a hardware-class failure (a worker killed by SIGBUS, the kernel's
signal for memory it cannot read; a detector's verdict that blames the node: FailSlow,
SilentDataCorruption); and on a spare every `spareIntervalSeconds` while it waits, in the
background (`Periodic`), so that a promotion never waits for a check: a check still running
at the promotion is stopped. A failure ends the launcher with contract.EXIT_PREFLIGHT_FAILED
and a termination message `PreflightFailed: <check>: <value> (expected <range>)`; the
operator excludes the node and places the replica (or the spare) elsewhere.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from transom import contract, defaults, script_errors, words
from transom.coordinator.client import CoordinatorClient

log = logging.getLogger("transom.launch")
# Beyond the checks' own budget: the child's Python and torch imports, and its exit.
START_MARGIN_S = 20.0
POLL_S = 0.05
PEER_LOOKUP_TIMEOUT_S = 2.0  # the link check's peer from the coordinator: skipped rather than waited for
SIGBUS_EXIT = -signal.SIGBUS  # Popen's return code of a process the kernel killed with SIGBUS
# What a coordinator's verdict that blames the node begins with (the launcher's reason says
# "coordinator declared the replica failed: <reason>: ...").
NODE_VERDICTS = tuple(str(words.REASONS[k]) for k in words.NODE_KINDS)


@dataclass(frozen=True)
class PreflightSpec:
    """spec.preflight, as TRANSOM_PREFLIGHT carries it."""

    checks: tuple[str, ...]
    timeout_s: float = defaults.PREFLIGHT_TIMEOUT_S
    spare_interval_s: float = defaults.PREFLIGHT_SPARE_INTERVAL_S

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> PreflightSpec | None:
        """None when unset or when it names no checks; ValueError when it is malformed."""
        raw = environ.get(contract.ENV_PREFLIGHT)
        if not raw:
            return None
        try:
            spec = json.loads(raw)
            checks = tuple(str(c) for c in spec.get("checks", contract.PREFLIGHT_CHECKS))
            timeout_s = float(spec.get("timeoutSeconds", defaults.PREFLIGHT_TIMEOUT_S))
            interval_s = float(spec.get("spareIntervalSeconds", defaults.PREFLIGHT_SPARE_INTERVAL_S))
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{contract.ENV_PREFLIGHT} is not spec.preflight as JSON: {e}") from e
        unknown = sorted(set(checks) - set(contract.PREFLIGHT_CHECKS))
        if unknown:
            raise ValueError(f"{contract.ENV_PREFLIGHT}: unknown checks {unknown}; "
                             f"the checks are {', '.join(contract.PREFLIGHT_CHECKS)}")
        if not 0 < timeout_s <= 3600 or not 0 <= interval_s <= 86400:
            raise ValueError(f"{contract.ENV_PREFLIGHT}: timeoutSeconds must be in (0, 3600] and "
                             "spareIntervalSeconds in [0, 86400]")
        return cls(checks, timeout_s, interval_s) if checks else None


def hardware_class(reason: str, codes: list[int | None]) -> bool:
    """Whether an attempt that failed so may have failed for its node: then the checks run
    again before the in-place restart."""
    return SIGBUS_EXIT in codes or any(f"failed: {v}" in reason for v in NODE_VERDICTS)


def command(spec: PreflightSpec, env: contract.ReplicaEnv, run_index: int, peer_url: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "transom", "check", "--json", "--checks", ",".join(spec.checks),
           "--timeout", f"{spec.timeout_s:g}", "--nproc", str(env.nproc_per_node), "--run-index", str(run_index)]
    if env.checkpoint_uri:
        cmd += ["--checkpoint-uri", env.checkpoint_uri]
    if peer_url:
        cmd += ["--peer-url", peer_url]
    return cmd


def peer_url(spec: PreflightSpec, env: contract.ReplicaEnv, client: CoordinatorClient | None) -> str | None:
    """A healthy peer replica's state server for the link check, as the coordinator knows it
    (GET /v1/progress); None for a spare (no replica yet to ask as), the job's first pods, or
    a coordinator that does not answer at once (the check is then skipped, never failed: a
    coordinator away is no fault of this node)."""
    if "link" not in spec.checks or env.is_spare or client is None:
        return None
    try:
        return client.progress(timeout_s=PEER_LOOKUP_TIMEOUT_S).peer_endpoint
    except Exception as e:
        log.info("pre-flight: no peer for the link check (%s)", e)
        return None


class Check:
    """One run of the checks in a child process of its own group; `poll()` until it answers."""

    def __init__(self, spec: PreflightSpec, env: contract.ReplicaEnv, environ: Mapping[str, str], run_index: int,
                 peer: str | None = None):
        self.deadline = time.monotonic() + spec.timeout_s + START_MARGIN_S
        self.budget_s = spec.timeout_s
        # Its stderr is the launcher's (the pod's log): a check that crashes says why there.
        self.proc = subprocess.Popen(command(spec, env, run_index, peer), env=dict(environ), stdout=subprocess.PIPE,
                                     start_new_session=True)

    def poll(self) -> tuple[bool, str | None]:
        """(done, failure message or None)."""
        if self.proc.poll() is None:
            if time.monotonic() < self.deadline:
                return False, None
            self.stop()
            return True, (f"{contract.PREFLIGHT_FAILED}: the checks did not finish within their budget of "
                          f"{self.budget_s:g}s (and {START_MARGIN_S:g}s to start)")
        assert self.proc.stdout is not None
        out = self.proc.stdout.read().decode(errors="replace")
        self.proc.stdout.close()
        return True, _failure(self.proc.returncode, out)

    def stop(self) -> None:
        """Kill the child's whole group (what the checks started goes with it) and reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("pre-flight check process %d did not exit after SIGKILL", self.proc.pid)
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()


def _failure(code: int, out: str) -> str | None:
    """The failure message of a finished `transom check --json`: None if every check of the
    node itself passed. A failed check of what lies beyond the node (contract.REMOTE_CHECKS:
    the checkpoint store, a peer) is logged and does not fail it: a store that is down or a
    peer that died is no fault of this node, and failing every new pod for it would exclude
    every node of the cluster. No answer at all (the checks crashed) is a failure."""
    try:
        answer = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    except ValueError:
        answer = {}
    if code == 0 and answer.get("passed") is True:
        return None
    failed = [c for c in answer.get("checks", []) if isinstance(c, dict) and not c.get("passed")]
    remote = [c for c in failed if c.get("name") in contract.REMOTE_CHECKS]
    if remote:
        log.warning("pre-flight: %s; training starts anyway: not this node's fault alone",
                    "; ".join(str(c.get("message", c.get("name")))[:300] for c in remote))
    own = [c for c in failed if c not in remote]
    if failed and not own:
        return None
    said = "; ".join(str(c.get("message", c.get("name", "?")))[:300] for c in own)
    if not said:
        said = f"`transom check` exited {code} without an answer"
    return f"{contract.PREFLIGHT_FAILED}: {said}"[:1024]


def run(spec: PreflightSpec, env: contract.ReplicaEnv, environ: Mapping[str, str], run_index: int,
        stopped: Callable[[], bool], peer: str | None = None) -> str | None:
    """Run the checks and wait for them; the failure message, or None if they passed (or a
    signal stopped the wait: the launcher is going anyway)."""
    started = time.monotonic()
    check = Check(spec, env, environ, run_index, peer)
    try:
        while not stopped():
            done, failure = check.poll()
            if done:
                log.info("pre-flight checks %s in %.1fs", "failed" if failure else "passed", time.monotonic() - started)
                return failure
            time.sleep(POLL_S)
        return None
    finally:
        check.stop()


class Periodic:
    """A waiting spare's checks every `spare_interval_s`, never in the way of its promotion."""

    def __init__(self, spec: PreflightSpec, env: contract.ReplicaEnv, environ: Mapping[str, str], runs: int,
                 clock: Callable[[], float] = time.monotonic):
        self.spec, self.env, self.environ, self.clock = spec, env, environ, clock
        self.runs = runs  # pre-flights run so far: the next one's index
        self.next_at = clock() + spec.spare_interval_s if spec.spare_interval_s > 0 else float("inf")
        self.current: Check | None = None

    def poll(self) -> str | None:
        """Call from the spare's watch loop: a failure message once a check failed."""
        if self.current is None:
            if self.clock() >= self.next_at:
                self.current = Check(self.spec, self.env, self.environ, self.runs)
                self.runs += 1
            return None
        done, failure = self.current.poll()
        if done:
            self.current.stop()
            self.current = None
            self.next_at = self.clock() + self.spec.spare_interval_s
        return failure

    def stop(self) -> None:
        """The spare was promoted or is going: a check still running is stopped."""
        if self.current is not None:
            self.current.stop()
            self.current = None
        self.next_at = float("inf")


class NodeChecks:
    """A launcher's pre-flights: `run` before an attempt, `poll_spare` while a spare waits."""

    def __init__(self, environ: Mapping[str, str], client: CoordinatorClient | None = None):
        self.spec = PreflightSpec.from_environ(environ)
        self.client = client  # asked for a peer for the link check
        self.runs = 0
        self.periodic: Periodic | None = None

    def run(self, env: contract.ReplicaEnv, environ: Mapping[str, str], stopped: Callable[[], bool]) -> str | None:
        """The checks now (none without a spec); the failure message, or None."""
        if self.spec is None:
            return None
        failure = run(self.spec, env, environ, self.runs, stopped, peer_url(self.spec, env, self.client))
        self.runs += 1
        if failure is None and env.is_spare and self.periodic is None:
            self.periodic = Periodic(self.spec, env, environ, self.runs)
        return failure

    def poll_spare(self) -> str | None:
        return self.periodic.poll() if self.periodic is not None else None

    def promoted(self) -> None:
        """The spare trains now: a check still running is stopped, and none starts again."""
        self.close()

    def close(self) -> None:
        if self.periodic is not None:
            self.periodic.stop()
            self.periodic = None


def unfit(who: str, failure: str, environ: Mapping[str, str]) -> int:
    """The end of a launcher whose node failed a check: the message where the pod's
    termination message is read, and the exit code."""
    log.error("%s: %s; this node is not fit to train", who, failure)
    script_errors.write_termination_log(failure, dict(environ))
    return contract.EXIT_PREFLIGHT_FAILED
