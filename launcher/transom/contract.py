"""The contract shared by the operator, the launcher, the coordinator and the workers.

Everything another component reads by name lives here once: the pod environment the
operator sets and the launcher reads, the environment the launcher gives its workers,
the Kubernetes labels and annotations, and the launcher's exit codes. Change a name here
only together with docs/ (architecture.md, "Environment") and the tests that pin it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

# --- pod environment (set by the operator, or by `transom run` locally) -------------
ENV_JOB = "TRANSOM_JOB"  # the job's name (Kubernetes: the TrainingJob's metadata.name)
# The job's uid (Kubernetes: the TrainingJob's metadata.uid; `transom run`: job_identity.LOCAL_UID).
# With the name, the identity a checkpoint location records as its owner (job_identity.py).
ENV_JOB_UID = "TRANSOM_JOB_UID"
ENV_NAMESPACE = "TRANSOM_NAMESPACE"
ENV_REPLICA_ID = "TRANSOM_REPLICA_ID"
ENV_NUM_REPLICAS = "TRANSOM_NUM_REPLICAS"
ENV_REPLICA_GENERATION = "TRANSOM_REPLICA_GENERATION"
ENV_NODE_RANK = "TRANSOM_NODE_RANK"
ENV_NNODES = "TRANSOM_NNODES"
ENV_NPROC_PER_NODE = "TRANSOM_NPROC_PER_NODE"
ENV_COORDINATOR_URL = "TRANSOM_COORDINATOR_URL"
# The job's own (admin) token: the coordinator reads it; it may act for any replica, so
# neither the operator nor `transom run` gives it to a replica's pod or launcher (a
# launcher uses it only where no identity file is set: tests, tools run by hand).
ENV_COORDINATOR_TOKEN = "TRANSOM_COORDINATOR_TOKEN"
# The file holding this pod's (launcher's) own credential towards the coordinator, which
# speaks for its replica only (coordinator/identity.py): in Kubernetes the pod's projected,
# audience-bound ServiceAccount token (IDENTITY_TOKEN_DIR); `transom run` writes a replica
# key per launcher. Read again whenever it changes (the kubelet rotates the token).
ENV_IDENTITY_TOKEN_FILE = "TRANSOM_IDENTITY_TOKEN_FILE"
IDENTITY_TOKEN_DIR = "/var/run/secrets/transom.io/identity"  # the projected volume in worker pods
IDENTITY_TOKEN_NAME = "token"
# The bearer token of the replicas' state servers (peer recovery), shared by the job's
# pods: every replica may read the state every replica holds. In Kubernetes from the
# Secret `<job>-peer-token`; without it, the job's token (tests, tools).
ENV_PEER_TOKEN = "TRANSOM_PEER_TOKEN"


def identity_audience(namespace: str, job: str) -> str:
    """The audience of a job's identity tokens: a token for one job's coordinator is nothing
    to another's, nor to the API server."""
    return f"transom.io/{namespace}/{job}"

ENV_CHECKPOINT_URI = "TRANSOM_CHECKPOINT_URI"
ENV_CHECKPOINT_INTERVAL = "TRANSOM_CHECKPOINT_INTERVAL_STEPS"  # spec.checkpoint.intervalSteps
ENV_CHECKPOINT_KEEP = "TRANSOM_CHECKPOINT_KEEP"  # spec.checkpoint.keep
# The address other replicas use to reach this pod (downward API status.podIP);
# 127.0.0.1 when unset, which is right for local mode.
ENV_ADVERTISE_ADDR = "TRANSOM_ADVERTISE_ADDR"
# The node a pod runs on (the downward API's spec.nodeName): pre-flight failures name it, and
# an injected fault with node=NAME fires only there (inject.py).
ENV_NODE_NAME = "TRANSOM_NODE_NAME"
# Set instead of TRANSOM_REPLICA_ID / TRANSOM_REPLICA_GENERATION on a hot-spare pod: its
# workers start at once, load the model and wait inside FaultTolerant until the operator
# relabels the pod with a replica identity (LABEL_REPLICA, LABEL_GENERATION), which the
# launcher and the workers read from the downward-API labels file in PODINFO_DIR.
ENV_SPARE_ID = "TRANSOM_SPARE_ID"
ENV_PODINFO_DIR = "TRANSOM_PODINFO_DIR"  # overrides PODINFO_DIR (tests, local runs)
PODINFO_DIR = "/etc/transom/podinfo"  # downward-API volume of spare pods; holds `labels`

# --- set by the launcher for each worker --------------------------------------------
# A file of this worker's own: where a ScriptError that escapes the script is written
# (transom/script_errors.py), so that the launcher ends the job rather than restarting.
ENV_SCRIPT_ERROR_FILE = "TRANSOM_SCRIPT_ERROR_FILE"
# Besides torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
# (all of the worker's own replica), the launcher adds its restart count: a replica's
# identity towards the coordinator is (generation, attempt).
ENV_ATTEMPT = "TRANSOM_ATTEMPT"
# The cross-replica collective timeout (spec.faultTolerance.collectiveTimeoutSeconds); read by
# transom.ft.FTConfig.from_environ.
ENV_COLLECTIVE_TIMEOUT = "TRANSOM_COLLECTIVE_TIMEOUT_S"
# torch.distributed backend: auto, gloo or nccl (spec.faultTolerance.backend, transom run --backend)
ENV_BACKEND = "TRANSOM_BACKEND"
# FTConfig's other settings a worker's environment may give (FTConfig.from_environ): set by
# hand or by a pod template, never by the operator.
ENV_QUORUM_TIMEOUT = "TRANSOM_QUORUM_TIMEOUT_S"
ENV_LR_SCALING = "TRANSOM_LR_SCALING"
ENV_RECOVERY_BYTES_PER_S = "TRANSOM_RECOVERY_BYTES_PER_S"
ENV_RECOVERY_CHUNK_BYTES = "TRANSOM_RECOVERY_CHUNK_BYTES"
ENV_RECOVERY_YIELD = "TRANSOM_RECOVERY_YIELD"
ENV_DDP_EXCHANGE = "TRANSOM_DDP_EXCHANGE"
DDP_EXCHANGES = ("wide", "slices")  # what each means: FTConfig.ddp_exchange
BACKENDS = ("auto", "gloo", "nccl")  # what each means: transom/ft/backend.py
DEFAULT_BACKEND = "auto"
# Optional fault injection for tests and demos (see transom.inject).
ENV_FAULT = "TRANSOM_FAULT"
# Optional directory where workers write per-step statistics (local mode summary).
ENV_STATS_DIR = "TRANSOM_STATS_DIR"
# spec.detection as JSON (transom/detect/step_rows.py), for the coordinator, launchers and workers
ENV_DETECTION = "TRANSOM_DETECTION"
# where a launcher's workers write their step signals and, on request, their stacks
ENV_SIGNALS_DIR = "TRANSOM_SIGNALS_DIR"
# Set by `transom run` on the launchers it starts: a launcher stops when that process dies.
ENV_OWNER_PID = "TRANSOM_OWNER_PID"
# "0": the launcher starts every worker as a fresh process, never from a warm interpreter
# that has torch imported already (launch/warm_start.py; on by default).
ENV_WARM_START = "TRANSOM_WARM_START"
# Where a launcher writes why it exited with EXIT_SCRIPT_ERROR, for whoever started it: the
# container's terminationMessagePath (the operator sets it; the kubelet shows the file as the
# container's termination message), or a file of `transom run`'s. Unset: nowhere.
ENV_TERMINATION_LOG = "TRANSOM_TERMINATION_LOG"
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath

# --- bounds the CRD and `transom run` share -------------------------------------------
# The operator's models (transom_operator/api.py) and the command line's checks (cli.py) take
# these, so that a value `transom run` accepts is one a TrainingJob may hold.
MAX_WAIT_SECONDS = 3600  # faultTolerance.heartbeatTimeoutSeconds and collectiveTimeoutSeconds
MAX_INTERVAL_STEPS = 10_000_000  # checkpoint.intervalSteps
MAX_KEEP = 1000  # checkpoint.keep
MAX_REPLICA_RESTARTS = 10_000  # faultTolerance.maxReplicaRestarts (in-place restarts, locally)


# --- Kubernetes labels and annotations ----------------------------------------------
# Keys under this domain (or a subdomain of it) are the operator's: a pod template that sets
# one is refused by the CRD's schema, so nothing a job's user writes can pose as them.
RESERVED_DOMAIN = "transom.io"
LABEL_JOB = "transom.io/job"
LABEL_REPLICA = "transom.io/replica"
LABEL_NODE_RANK = "transom.io/node-rank"
LABEL_GENERATION = "transom.io/generation"
LABEL_SPARE = "transom.io/spare"  # on hot-spare pods instead of LABEL_REPLICA until promoted


def is_reserved_key(key: str) -> bool:
    """True for a label or annotation key whose prefix is transom.io or a subdomain of it."""
    prefix, slash, _ = key.partition("/")
    return bool(slash) and (prefix == RESERVED_DOMAIN or prefix.endswith("." + RESERVED_DOMAIN))

# --- launcher exit codes --------------------------------------------------------------
EXIT_OK = 0
EXIT_WORKERS_FAILED = 1  # workers kept failing past --max-restarts
EXIT_USAGE = 2  # bad command line or missing environment
EXIT_EVICTED = 3  # a newer incarnation of this replica registered (the operator replaced it)
# A worker raised a transom.errors.ScriptError: the script is wrong and every retry would fail
# the same way. Nothing restarts the replica; `transom run` and the operator end the job.
EXIT_SCRIPT_ERROR = 4
# The replica's workers were OOMKilled defaults.OOM_KILL_LIMIT times: the memory limit is too
# low for the script, and a replacement would get the same limit. Nothing restarts the
# replica; `transom run` and the operator end the job with the termination message.
EXIT_OOM_KILLED = 5
# A pre-flight check (transom.check) failed before the workers started: this pod's node is
# not fit to train (a device that computes wrong, memory that does not hold a pattern, a
# checkpoint location it cannot write...). The termination message begins with
# PREFLIGHT_FAILED and names the check, the measured value and the expected range; the
# operator excludes the node for the job and places the replica elsewhere.
EXIT_PREFLIGHT_FAILED = 6
# Terminated by a signal: 128 + signal number (SIGTERM -> 143), as shells do.

# --- pre-flight checks (transom.check) -------------------------------------------------
PREFLIGHT_FAILED = "PreflightFailed"  # the word that begins a failed pre-flight's message; the operator's reason
# The checks, in the order they run; spec.preflight.checks takes a subset (the CRD's enum).
PREFLIGHT_CHECKS = ("compute", "memory", "collective", "link", "storage", "node")
# The checks of what lies beyond the node (a peer's state server, the checkpoint store): their
# failure is logged but fails no pod, since an outage there would fail every node alike.
REMOTE_CHECKS = ("link", "storage")
# spec.preflight as the operator passes it to a pod, JSON: {"checks": [...],
# "timeoutSeconds": N, "spareIntervalSeconds": M}. Unset: the launcher runs no checks.
ENV_PREFLIGHT = "TRANSOM_PREFLIGHT"

# --- out-of-memory kills --------------------------------------------------------------
# The word Kubernetes gives a container the kernel's OOM killer ended, and the one every
# component uses for it: it begins a launcher's failure report about an OOM-killed worker
# ("OOMKilled: worker rank 0 was OOMKilled (memory limit 3Gi)") and its termination
# message, and it is the operator's reason (reasons.OOM_KILLED).
OOM_KILLED = "OOMKilled"


def oom_advice(who: str, times: int, memory_limit: str | None) -> str:
    """What a job that keeps running out of memory says, the same from the launcher and the
    operator: "replica 1 was OOMKilled 3 times at memory limit 3Gi: raise
    resources.limits.memory or lower the batch size"."""
    times_ = f"{times} time{'s' if times != 1 else ''}"
    if memory_limit is None:  # the machine ran out of memory, not the container
        return f"{who} was {OOM_KILLED} {times_} with no memory limit: lower the batch size or use larger nodes"
    return f"{who} was {OOM_KILLED} {times_} at memory limit {memory_limit}: " \
        "raise resources.limits.memory or lower the batch size"


UNASSIGNED = -1  # the replica id of a hot spare that no replica has taken yet


@dataclass(frozen=True)
class ReplicaEnv:
    """The pod environment as the launcher and workers see it."""

    job: str
    replica_id: int
    num_replicas: int
    generation: int
    attempt: int
    node_rank: int
    nnodes: int
    nproc_per_node: int
    coordinator_url: str
    coordinator_token: str
    checkpoint_uri: str
    advertise_addr: str
    spare_id: int | None = None  # a hot spare's pod: replica_id is UNASSIGNED until promoted
    identity_token_file: str = ""  # this pod's own credential towards the coordinator
    peer_token: str = ""  # the state servers' token (the job's token where unset)
    fault: str = ""  # TRANSOM_FAULT: the faults tests and demos inject into this replica (transom/inject.py)
    node_name: str = ""  # TRANSOM_NODE_NAME: the node the pod runs on (a fault may name it)
    job_uid: str = ""  # TRANSOM_JOB_UID: with `job`, the job's identity (job_identity.py); "" where unset

    @property
    def is_spare(self) -> bool:
        """A hot spare still waiting for a replica identity."""
        return self.replica_id == UNASSIGNED

    def promoted(self, replica_id: int, generation: int) -> ReplicaEnv:
        """This environment as the replica `replica_id`'s pod of `generation` would have it."""
        return replace(self, replica_id=replica_id, generation=generation, spare_id=None)

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> ReplicaEnv:
        env = os.environ if environ is None else environ

        def num(name: str, default: int | None = None) -> int:
            raw = env.get(name)
            if raw is None or raw == "":
                if default is None:
                    raise ValueError(f"environment variable {name} must be set")
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None

        spare_id = num(ENV_SPARE_ID) if env.get(ENV_SPARE_ID) and not env.get(ENV_REPLICA_ID) else None
        url = env.get(ENV_COORDINATOR_URL, "")
        if not url:
            raise ValueError(f"environment variable {ENV_COORDINATOR_URL} must be set")
        return cls(
            job=env.get(ENV_JOB, "local"),
            replica_id=UNASSIGNED if spare_id is not None else num(ENV_REPLICA_ID),
            num_replicas=num(ENV_NUM_REPLICAS),
            generation=num(ENV_REPLICA_GENERATION, 0),
            attempt=num(ENV_ATTEMPT, 0),
            node_rank=num(ENV_NODE_RANK, 0),
            nnodes=num(ENV_NNODES, 1),
            nproc_per_node=num(ENV_NPROC_PER_NODE, 1),
            coordinator_url=url.rstrip("/"),
            coordinator_token=env.get(ENV_COORDINATOR_TOKEN, ""),
            checkpoint_uri=env.get(ENV_CHECKPOINT_URI, ""),
            advertise_addr=env.get(ENV_ADVERTISE_ADDR, "127.0.0.1"),
            spare_id=spare_id,
            identity_token_file=env.get(ENV_IDENTITY_TOKEN_FILE, ""),
            peer_token=env.get(ENV_PEER_TOKEN, "") or env.get(ENV_COORDINATOR_TOKEN, ""),
            fault=env.get(ENV_FAULT, ""),
            node_name=env.get(ENV_NODE_NAME, ""),
            job_uid=env.get(ENV_JOB_UID, ""),
        )


ENV_LOG_LEVEL = "TRANSOM_LOG_LEVEL"  # the `transom` command's and the workers' log level (default WARNING)
ENV_COORDINATOR_IMAGE = "TRANSOM_COORDINATOR_IMAGE"  # the operator's default --coordinator-image

# Set by Kubernetes in every pod (not Transom's): where the coordinator finds the API server
# (coordinator/kube_api.py).
ENV_KUBERNETES_SERVICE_HOST = "KUBERNETES_SERVICE_HOST"
ENV_KUBERNETES_SERVICE_PORT = "KUBERNETES_SERVICE_PORT"
