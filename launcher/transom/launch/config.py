"""The settings of `transom launch` (`LaunchConfig`, one pod's launcher: launch/supervisor.py)
and of `transom run` (`RunConfig`, a local job: launch/local.py), with the checks that refuse
bad values at once. The CLI's flags take their defaults from these fields (cli.py), whose
waits take theirs from transom/defaults.py (test_one_source keeps it so).

Light on purpose: the `transom` CLI reads it for every command, the launcher in every pod.

What a job's two settings share (timeouts that differ between LOCAL and CLUSTER, the OOM-kill
limit) lives in transom/defaults.py. The launcher's own polling intervals and short waits
(supervisor.py, local.py, local_spares.py, oom.py) stay beside the code they pace: nothing
else reads them, and no flag or spec field sets them.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from transom import contract, defaults
from transom.defaults import LOCAL
from transom.detect.step_rows import DetectionSettings
from transom.inject import Fault
from transom.job_identity import JobIdentity
from transom.launch import gpus
from transom.launch.end_on import MAX_MARGIN, Awaited
from transom.launch.preflight import PreflightSpec


def check_command(command: list[str]) -> None:
    """ValueError now for a command that could only fail later: an empty one, a program that is
    not there, or `python SCRIPT` with no such script (rather than restarts that cannot help)."""
    if not command:
        raise ValueError("a command to run is required after --")
    program = command[0]
    if shutil.which(program) is None:
        raise ValueError(f"{program}: command not found (not executable or not on PATH)")
    if Path(program).name.startswith("python"):
        script = _python_script(command[1:])
        if script is not None and not Path(script).is_file():
            raise ValueError(f"{program}: no such script: {script}")


def _python_script(args: list[str]) -> str | None:
    """The script a `python ARGS` command runs, or None (-c, -m, stdin)."""
    options_with_value = {"-W", "-X", "--check-hash-based-pycs"}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-c", "-m", "-"):
            return None
        if arg in options_with_value:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg
    return None


@dataclass(frozen=True)
class LaunchConfig:
    command: list[str]  # what each worker runs (`transom launch -- CMD`)
    nproc_per_node: int  # workers of this node
    max_restarts: int = 3  # in-place restarts of the workers before the launcher gives up (exit 1)
    restart_backoff_s: float = defaults.RESTART_BACKOFF_S  # before the second restart, doubling (restart_delay_s)
    term_grace_s: float = defaults.TERM_GRACE_S  # how long workers sent SIGTERM get before SIGKILL
    rendezvous_timeout_s: float = defaults.RENDEZVOUS_TIMEOUT_S  # node k > 0 waits this for node 0's address
    detection: DetectionSettings = field(default_factory=DetectionSettings)  # spec.detection (hang watchdog)
    oom_kill_limit: int = defaults.OOM_KILL_LIMIT  # OOM kills before the launcher exits EXIT_OOM_KILLED

    def __post_init__(self) -> None:
        check_command(self.command)
        if not 1 <= self.nproc_per_node <= 1024:
            raise ValueError("nproc_per_node must be between 1 and 1024")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must not be negative")
        if self.oom_kill_limit < 1:
            raise ValueError("oom_kill_limit must be at least 1")


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
    max_restarts: int = LaunchConfig.max_restarts  # each launcher's (`transom launch --max-restarts`)
    max_generations: int = 3  # incarnations of a replica before the run gives up
    timeout_s: float = defaults.RUN_TIMEOUT_S
    quiet: bool = False
    checkpoint_uri: str = ""  # TRANSOM_CHECKPOINT_URI of the workers: a directory or s3://...
    # --job-name: the job this run is (job_identity.py), recorded in the checkpoint location;
    # the same name continues the same job. "" here: a fresh name for this run, in __post_init__.
    job_name: str = ""
    checkpoint_interval: int | None = None
    checkpoint_keep: int | None = None
    backend: str = contract.DEFAULT_BACKEND  # TRANSOM_BACKEND of the workers
    log_dir: str | None = None  # the launchers' and workers' output, one file per replica; None: this terminal
    spares: int = 0  # hot spares (launch/spare.py)
    detection: str | None = None  # spec.detection as JSON (TRANSOM_DETECTION); None: the defaults
    preflight: str | None = None  # spec.preflight as JSON (TRANSOM_PREFLIGHT); None: no pre-flight checks
    trace_out: str | None = None  # write every rank's step signals here as one CSV trace
    end_on: list[Awaited] = field(default_factory=list)  # end the job once these events happened (end_on.py)
    end_margin: int = 3  # ... this many steps after them
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
        self.job_name = JobIdentity.for_local_run(self.job_name or None).name  # ValueError for a bad one
        if self.backend not in contract.BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(contract.BACKENDS)}, got {self.backend!r}")
        DetectionSettings.from_spec(self.detection)  # ValueError now, not in every process later
        if self.preflight is not None:
            PreflightSpec.from_environ({contract.ENV_PREFLIGHT: self.preflight})
        if not 0 <= self.spares <= 8:
            raise ValueError("--spares must be between 0 and 8 in local mode")
        self.devices = gpus.assign(gpus.visible(), self.replicas + self.spares, self.nproc_per_replica, self.backend)
        if not 0 <= self.end_margin <= MAX_MARGIN:
            raise ValueError(f"--end-margin must be between 0 and {MAX_MARGIN} steps")
        for awaited in self.end_on:
            if awaited.replica is not None and awaited.replica >= self.replicas:
                raise ValueError(f"--end-on {awaited} names replica {awaited.replica}, but there are only "
                                 f"{self.replicas}")
        for replica, spec in self.injects:
            if replica >= self.replicas:
                raise ValueError(f"--inject names replica {replica}, but there are only {self.replicas}")
            if Fault.parse(spec).rank >= self.nproc_per_replica:
                raise ValueError(f"--inject names rank {Fault.parse(spec).rank}, but a replica has only "
                                 f"{self.nproc_per_replica} process(es) (--nproc-per-replica)")


def default_of(config: type, name: str) -> Any:
    """The default of field `name` of the dataclass `config` (one with a default value)."""
    found = next(f for f in fields(config) if f.name == name)
    assert found.default is not MISSING, f"{config.__name__}.{name} has no default value"
    return found.default
