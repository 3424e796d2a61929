"""The settings of `transom launch` (`LaunchConfig`, one pod's launcher: launch/supervisor.py)
and of `transom run` (`RunConfig`, a local job: launch/local.py), with the checks that refuse
bad values at once. They are pydantic models: each setting's type, bounds, default and help
are written once, on its field, and the CLI's flags are derived from them (flags.py); the
waits take their defaults from transom/defaults.py (test_one_source keeps it so).

Light on purpose: the `transom` CLI reads it for every command, the launcher in every pod.

What a job's two settings share (timeouts that differ between LOCAL and CLUSTER, the OOM-kill
limit) lives in transom/defaults.py. The launcher's own polling intervals and short waits
(supervisor.py, local.py, local_spares.py, oom.py) stay beside the code they pace: nothing
else reads them, and no flag or spec field sets them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from transom import contract, defaults
from transom.arguments import MAX_SECONDS
from transom.defaults import LOCAL
from transom.detect.step_rows import DetectionSettings
from transom.flags import seconds
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


# Bounds a local run adds to the CRD's own (contract.py): one machine's worth.
MAX_LOCAL_REPLICAS = 64
MAX_LOCAL_SPARES = 8
MAX_PROCS = 1024
_CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


# What a worker runs (`transom launch -- CMD`), refused at once if it could only fail later.
Command = Annotated[list[str], AfterValidator(lambda command: check_command(command) or command)]


class LaunchConfig(BaseModel):
    """`transom launch`'s settings; its flags are these fields' (flags.py)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True)

    command: Command
    nproc_per_node: int = Field(ge=1, le=MAX_PROCS, description="workers of this node")
    max_restarts: int = Field(3, ge=0, le=contract.MAX_REPLICA_RESTARTS,
                              description="in-place restarts of the workers before the launcher gives up (exit 1)")
    restart_backoff_s: float = defaults.RESTART_BACKOFF_S  # before the second restart, doubling (restart_delay_s)
    term_grace_s: float = defaults.TERM_GRACE_S  # how long workers sent SIGTERM get before SIGKILL
    rendezvous_timeout_s: float = defaults.RENDEZVOUS_TIMEOUT_S  # node k > 0 waits this for node 0's address
    detection: DetectionSettings = Field(default_factory=DetectionSettings)  # spec.detection (hang watchdog)
    oom_kill_limit: int = Field(defaults.OOM_KILL_LIMIT, ge=1)  # OOM kills before the launcher exits EXIT_OOM_KILLED


class RunConfig(BaseModel):
    """`transom run`'s settings: each field's type, bounds, default and help are its flag's
    (flags.py); what only the whole run can tell (a fault naming a replica the run lacks) is
    `_whole`'s. Everything a run could only find out by failing later is refused here."""

    model_config = _CONFIG

    command: Command
    replicas: int = Field(ge=1, le=MAX_LOCAL_REPLICAS, description="replicas of the job")
    nproc_per_replica: int = Field(1, ge=1, le=MAX_PROCS, description="processes (ranks) of each replica")
    min_replicas: int = Field(1, ge=1, le=MAX_LOCAL_REPLICAS,
                              description="replicas that must be ready for a step (at most --replicas)")
    spares: int = Field(0, ge=0, le=MAX_LOCAL_SPARES,
                        description="hot spares: launchers whose workers load the model and wait; a failed replica "
                                    "is replaced by one at once (as spec.spareReplicas on Kubernetes)")
    injects: list[tuple[int, str]] = Field(default_factory=list)  # (replica, worker fault spec): --inject
    summary_json: str | None = Field(None, description="write the end summary here")
    stats_dir: str | None = Field(None, description="keep the workers' per-step statistics here (default: a temp "
                                                    "dir)")
    collective_timeout_s: float = seconds(LOCAL.collective_timeout_s, contract.MAX_WAIT_SECONDS,
                                          "how long a collective waits for a peer")
    heartbeat_timeout_s: float = seconds(LOCAL.heartbeat_timeout_s, contract.MAX_WAIT_SECONDS,
                                         "a replica not heard from this long is failed")
    max_restarts: int = Field(LaunchConfig.model_fields["max_restarts"].default, ge=0,
                              le=contract.MAX_REPLICA_RESTARTS, description="in-place restarts per launcher")
    max_generations: int = 3  # incarnations of a replica before the run gives up
    timeout_s: float = seconds(defaults.RUN_TIMEOUT_S, MAX_SECONDS, "give up after this many seconds")
    quiet: bool = Field(False, description="print only the summary")
    checkpoint_uri: str = Field("", description="checkpoint here (a directory or s3://bucket/prefix); a run resumes "
                                                "from it")
    # The job this run is (job_identity.py), recorded in the checkpoint location; the same
    # name continues the same job. "": a fresh name for this run, chosen in `_whole`.
    job_name: str = Field("", description="the job this run is: a checkpoint location belongs to one job, and a run "
                                          "of another name is refused there; the same name continues the job "
                                          "(default: a fresh local-<hex> per run, which the run prints)")
    checkpoint_interval: int | None = Field(None, ge=0, le=contract.MAX_INTERVAL_STEPS,
                                            description="committed steps between checkpoints (the script may "
                                                        "override)")
    checkpoint_keep: int | None = Field(None, ge=1, le=contract.MAX_KEEP, description="committed checkpoints to keep")
    backend: str = Field(contract.DEFAULT_BACKEND,
                         description="torch.distributed backend (TRANSOM_BACKEND), one of "
                                     f"{', '.join(contract.BACKENDS)}: auto picks NCCL only where each worker has "
                                     "a GPU of its own and the tensors are on it, Gloo otherwise")
    log_dir: str | None = Field(None, description="write each replica's launcher and worker output to "
                                                  "DIR/replica-<i>.log and the coordinator's log to "
                                                  "DIR/coordinator.log; the terminal shows only the progress")
    detection: str | None = Field(None, description='anomaly detection settings, as spec.detection (e.g. '
                                                    '\'{"hangTimeoutSeconds": 60}\')')
    preflight: str | None = Field(None, description="pre-flight checks each launcher runs before its workers start, "
                                                    "as spec.preflight (e.g. '{\"checks\": [\"compute\", "
                                                    "\"memory\"]}'); default: none")
    trace_out: str | None = Field(None, description="write every rank's step signals as one CSV trace (transom "
                                                    "detect replay FILE)")
    end_on: list[Awaited] = Field(default_factory=list)  # end the job once these events happened: --end-on
    end_margin: int = Field(3, ge=0, le=MAX_MARGIN, description="steps the job trains after the --end-on events")
    devices: list[str | None] = Field(default_factory=list)  # per replica, then per spare: made by `_whole`

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, backend: str) -> str:
        if backend not in contract.BACKENDS:
            raise ValueError(f"must be one of {', '.join(contract.BACKENDS)}")
        return backend

    @field_validator("detection")
    @classmethod
    def _detection(cls, spec: str | None) -> str | None:
        DetectionSettings.from_spec(spec)  # ValueError now, not in every process later
        return spec

    @field_validator("preflight")
    @classmethod
    def _preflight(cls, spec: str | None) -> str | None:
        if spec is not None:
            PreflightSpec.from_environ({contract.ENV_PREFLIGHT: spec})
        return spec

    @model_validator(mode="after")
    def _whole(self) -> RunConfig:
        """What no one flag can tell: the flags against each other, and the machine."""
        if self.min_replicas > self.replicas:
            raise ValueError("--min-replicas must be between 1 and --replicas")
        self.job_name = JobIdentity.for_local_run(self.job_name or None).name  # ValueError for a bad one
        self.devices = gpus.assign(gpus.visible(), self.replicas + self.spares, self.nproc_per_replica, self.backend)
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
        return self


def default_of(config: type[BaseModel], name: str) -> Any:
    """The default of field `name` of the settings model `config` (one with a default value)."""
    info = config.model_fields[name]
    assert not info.is_required(), f"{config.__name__}.{name} has no default value"
    return info.get_default(call_default_factory=True)
