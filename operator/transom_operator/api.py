"""The `TrainingJob` custom resource (transom.io/v1alpha1) as pydantic models.

These models are the single source of the API: `crdgen` turns them into the CRD's
structural OpenAPI schema, the operator parses live objects with them, and tests validate
example manifests with them. Python fields are snake_case; the wire (and the CRD) is
camelCase through the alias generator, so `TrainingJob.model_validate(obj)` takes what the
API server returns and `model_dump(by_alias=True, exclude_none=True, mode="json")` gives
back what it accepts.

The building blocks (names, bounds, enums, `Rule`, base models) are in api_base.py, the pod
template in api_template.py and the status in api_status.py; everything is re-exported
here, so `api.X` is the one way in.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, cast

from pydantic import Field, WithJsonSchema, field_validator

from transom.contract import DEFAULT_BACKEND, MAX_INTERVAL_STEPS, MAX_KEEP, MAX_WAIT_SECONDS, PREFLIGHT_CHECKS
from transom.defaults import CLUSTER, PREFLIGHT_SPARE_INTERVAL_S, PREFLIGHT_TIMEOUT_S
from transom.detect.step_rows import SPEC_BOUNDS as _BOUNDS  # the ranges are the detectors' own too
from transom.detect.step_rows import DetectionSettings
from transom_operator.api_base import (  # noqa: F401  (api.X is the public name of each)
    API_VERSION,
    CAMEL_CASE,
    CONDITION_TYPES,
    CRD_NAME,
    DNS_LABEL_1035,
    DNS_SUBDOMAIN,
    GROUP,
    KIND,
    MAX_CONTAINERS,
    MAX_COUNT,
    MAX_GENERATION,
    MAX_INT,
    MAX_JOB_NAME,
    MAX_NODES_PER_REPLICA,
    MAX_PODS,
    MAX_PROCS_PER_NODE,
    MAX_RANKS_PER_REPLICA,
    MAX_REPLICAS,
    MAX_RESTARTS,
    MAX_STEP,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    ApiModel,
    Backend,
    ConditionType,
    JobState,
    NodeExclusionPolicy,
    NodeName,
    NodeNameItem,
    PreflightCheck,
    PreflightCheckItem,
    Reason,
    ReplicaPhase,
    Rule,
    SpareState,
    StatusModel,
    Timestamp,
    immutable,
)
from transom_operator.api_status import (  # noqa: F401  (api.X is the public name of each)
    MAX_RESTART_HISTORY,
    Blame,
    Condition,
    ExcludedNode,
    Failure,
    OomKills,
    ReplicaStatus,
    RestartRecord,
    SpareStatus,
    TrainingJobStatus,
    TrainingProgress,
    Verdict,
)
from transom_operator.api_template import (  # noqa: F401  (api.X is the public name of each)
    MAX_TEMPLATE_DEPTH,
    MAX_TEMPLATE_KEYS,
    NO_SERVICE_ACCOUNT_RULES,
    POD_TEMPLATE_SCHEMA,
    TEMPLATE_HAS_CONTAINER,
    TEMPLATE_NO_RESERVED_KEYS_MESSAGE,
    PodTemplate,
    check_template,
)

# --- spec -----------------------------------------------------------------------------

class SecretReference(ApiModel):
    """A Secret in the job's namespace."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="Name of the Secret.")


class Checkpoint(ApiModel):
    """Where and how often the job's state is checkpointed."""

    uri: str = Field(
        max_length=1024, pattern=r"^([a-z][a-z0-9+.-]*://|/)[^\s]+$",
        description=(
            "Where checkpoints go: an absolute path (a volume mounted in every pod) or a URL "
            "such as s3://bucket/prefix. Each checkpoint is the directory <uri>/step-<N>/, "
            "committed when its manifest.json is written."
        ),
    )
    interval_steps: int = Field(
        500, ge=1, le=MAX_INTERVAL_STEPS, description="Optimizer steps between two checkpoints.",
    )
    keep: int = Field(
        3, ge=1, le=MAX_KEEP, description="How many committed checkpoints to keep; older ones are deleted.",
    )
    credentials_secret: SecretReference | None = Field(
        None,
        description=(
            "Secret whose keys are given to the workers as environment variables (for "
            "example AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) to reach the uri."
        ),
    )


class FaultTolerance(ApiModel):
    """How failures are handled: restart limits, backoff, timeouts and bad-node exclusion."""

    cel_rules = (
        Rule(
            "self.maxBackoffSeconds >= self.backoffSeconds",
            "maxBackoffSeconds must be greater than or equal to backoffSeconds",
            lambda ft: ft.max_backoff_seconds >= ft.backoff_seconds,
            ".maxBackoffSeconds",
        ),
    )

    max_replica_restarts: int = Field(
        10, ge=0, le=MAX_RESTARTS,
        description=(
            "Replica replacements allowed within restartWindowSeconds; one more fails the job. "
            "In-place restarts of a replica's processes by the launcher do not count."
        ),
    )
    restart_window_seconds: int = Field(
        3600, ge=60, le=30 * 86400, description="Sliding window over which maxReplicaRestarts is counted.",
    )
    backoff_seconds: int = Field(
        10, ge=0, le=3600,
        description=(
            "Delay before a replica is replaced for the second time in a row; doubles with "
            "each further replacement."
        ),
    )
    max_backoff_seconds: int = Field(
        300, ge=0, le=86400, description="Upper bound of the replacement delay.",
    )
    collective_timeout_seconds: int = Field(
        int(CLUSTER.collective_timeout_s), ge=1, le=MAX_WAIT_SECONDS,
        description="Longest a cross-replica collective may block before its replica is dropped from the step.",
    )
    backend: Backend = Field(
        cast(Backend, DEFAULT_BACKEND),
        description=(
            "torch.distributed backend of the workers (TRANSOM_BACKEND). auto: NCCL where each process has a GPU of "
            "its own and the tensors are on it, Gloo otherwise. gloo or nccl force one; a forced nccl that cannot "
            "work is refused when the worker starts, with what to change."
        ),
    )
    heartbeat_timeout_seconds: int = Field(
        int(CLUSTER.heartbeat_timeout_s), ge=1, le=MAX_WAIT_SECONDS,
        description=(
            "A replica whose leader has not sent a heartbeat to the job's coordinator for this long is "
            "declared failed: it leaves the quorum and its launcher restarts it in place."
        ),
    )
    node_not_ready_grace_seconds: int = Field(
        30, ge=0, le=3600,
        description="How long a node may be NotReady before the replicas on it are replaced.",
    )
    node_exclusion_policy: NodeExclusionPolicy = Field(
        "Exclude",
        description=(
            "What happens to a node after a hardware-class failure. Exclude: this job's new "
            "pods avoid it (node affinity). Taint: also taint it so that no new pod lands on it. "
            "Cordon: also mark it unschedulable. None: nothing."
        ),
    )


class Preflight(ApiModel):
    """Pre-flight checks (transom.check) a worker pod runs before its workers start."""

    checks: list[PreflightCheckItem] = Field(
        default_factory=lambda: list(cast(list[PreflightCheck], PREFLIGHT_CHECKS)), max_length=len(PREFLIGHT_CHECKS),
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description=(
            "The checks each new pod runs on its node before its workers start, in this order: compute (a fixed "
            "matmul against a reference computed another way), memory (a pattern written and read back), "
            "collective (an all-reduce among the pod's processes), link (a transfer from a peer replica), storage "
            "(the checkpoint location written and read), node (free disk, clock skew against the coordinator). A "
            "pod that fails one of its node's own exits with PreflightFailed: its node is excluded and the replica "
            "placed elsewhere (link and storage failures are only logged: an outage there is not the node's). "
            "Spares run them again every spareIntervalSeconds while they wait. []: none."
        ),
    )
    timeout_seconds: int = Field(
        int(PREFLIGHT_TIMEOUT_S), ge=1, le=600,
        description="Budget of all the checks of one pre-flight together; a check still running at its end fails.",
    )
    spare_interval_seconds: int = Field(
        int(PREFLIGHT_SPARE_INTERVAL_S), ge=0, le=86400,
        description="How often a waiting hot spare runs the checks again (a spare that fails is replaced, never "
                    "promoted). 0: only when it starts.",
    )

    @field_validator("checks")
    @classmethod
    def _each_check_once(cls, checks: list[str]) -> list[str]:
        # The API server refuses duplicates of a list-type set itself ("Duplicate value").
        if len(set(checks)) != len(checks):
            raise ValueError("spec.preflight.checks names each check at most once")
        return checks


_DETECT = DetectionSettings()  # the defaults are the detectors' own (transom/detect/step_rows.py)


class Detection(ApiModel):
    """Anomaly detection (transom/detect) and what its verdicts do."""

    enabled: bool = Field(
        _DETECT.enabled,
        description="Run the detectors and the step guard. false: only crashes and lost heartbeats are failures.",
    )
    warmup_steps: int = Field(
        _DETECT.warmup_steps, ge=_BOUNDS["warmupSteps"][0], le=_BOUNDS["warmupSteps"][1],
        description="Steps each rank is observed (its step-time predictor fitted) before it can be called slow.",
    )
    slow_factor_percent: int = Field(
        round(_DETECT.slow_factor * 100), ge=_BOUNDS["slowFactorPercent"][0], le=_BOUNDS["slowFactorPercent"][1],
        description=(
            "A rank's step is slow when its busy time exceeds what its workload predicts by this factor, in "
            "percent (115: 1.15x), relative to the median of the replicas in the same step (with three or more "
            "replicas; with fewer, relative to the rank's own history)."
        ),
    )
    slow_steps: int = Field(
        _DETECT.slow_steps, ge=_BOUNDS["slowSteps"][0], le=_BOUNDS["slowSteps"][1],
        description="Slow steps in a row before a FailSlow verdict.",
    )
    loss_spike_z: int = Field(
        round(_DETECT.loss_spike_z), ge=_BOUNDS["lossSpikeZ"][0], le=_BOUNDS["lossSpikeZ"][1],
        description=(
            "A loss this many robust standard deviations above the median of the replica's recent losses "
            "(and at least twice it) is a spike: that step is applied on no replica."
        ),
    )
    loss_window: int = Field(
        _DETECT.loss_window, ge=_BOUNDS["lossWindow"][0], le=_BOUNDS["lossWindow"][1],
        description="Recent losses the median is taken over; also the window in which badSteps are counted.",
    )
    bad_steps: int = Field(
        _DETECT.bad_steps, ge=_BOUNDS["badSteps"][0], le=_BOUNDS["badSteps"][1],
        description="Non-finite or spiking steps of one replica within lossWindow steps before a verdict.",
    )
    fingerprint_interval: int = Field(
        _DETECT.fingerprint_interval, ge=_BOUNDS["fingerprintInterval"][0], le=_BOUNDS["fingerprintInterval"][1],
        description=(
            "Every this many steps each rank fingerprints its parameters; a replica whose fingerprint differs "
            "from the majority's is corrupt (SilentDataCorruption). 0: never."
        ),
    )
    hang_timeout_seconds: int = Field(
        int(_DETECT.hang_timeout_s), ge=_BOUNDS["hangTimeoutSeconds"][0], le=_BOUNDS["hangTimeoutSeconds"][1],
        description=(
            "A worker that makes no step progress for this long (not counting waits for other replicas) is hung: "
            "every worker's stacks go to the launcher's log and the verdict, and the replica restarts."
        ),
    )
    action: Literal["Replace", "Report"] = Field(
        cast(Any, _DETECT.action),  # a DetectAction: equal to its string
        description=(
            "What a verdict does. Replace: the replica leaves the quorum and is replaced; for FailSlow and "
            "SilentDataCorruption its node counts as faulty (nodeExclusionPolicy). Report: an event and a metric only."
        ),
    )
    slow_action: Literal["Replace", "Report", "Rebalance"] = Field(
        cast(Any, _DETECT.slow_action),
        description=(
            "What a FailSlow verdict does. Report (default): an event and a metric. Replace: as for action; "
            "choose it where each replica has its devices to itself. Rebalance: the slow replica keeps training "
            "with a smaller share of each global batch (the others take more, the update stays the mean over "
            "all samples) until it is at normal speed again; needs a script that takes its batches from "
            "trainer.batches()."
        ),
    )


def _defaulted(model: type[ApiModel]) -> Any:
    # The whole default object, not `{}`: the API server checks a default against the
    # CEL rules as written, before nested defaults would fill it in.
    default = model().model_dump(by_alias=True, exclude_none=True, mode="json")
    return Field(default_factory=model, json_schema_extra={"default": default})


_SHARDING_IS_FIXED = "it fixes how the model is sharded; create a new TrainingJob to change it"


class TrainingJobSpec(ApiModel):
    """Desired state of a TrainingJob."""

    cel_rules = (
        Rule(
            "self.minReplicas <= self.replicas",
            "minReplicas must be less than or equal to replicas",
            lambda s: s.min_replicas <= s.replicas,
            ".minReplicas",
        ),
        Rule(
            "self.spareReplicas <= self.replicas",
            "spareReplicas must be less than or equal to replicas",
            lambda s: s.spare_replicas <= s.replicas,
            ".spareReplicas",
        ),
        Rule(
            f"self.nodesPerReplica * self.procsPerNode <= {MAX_RANKS_PER_REPLICA}",
            f"nodesPerReplica x procsPerNode (processes per replica) must be at most {MAX_RANKS_PER_REPLICA}",
            lambda s: s.nodes_per_replica * s.procs_per_node <= MAX_RANKS_PER_REPLICA,
            ".procsPerNode",
        ),
        Rule(
            f"(self.replicas + self.spareReplicas) * self.nodesPerReplica <= {MAX_PODS}",
            f"(replicas + spareReplicas) x nodesPerReplica (worker pods) must be at most {MAX_PODS}",
            lambda s: (s.replicas + s.spare_replicas) * s.nodes_per_replica <= MAX_PODS,
            ".nodesPerReplica",
        ),
    )

    replicas: int = Field(
        ge=1, le=MAX_REPLICAS,
        description=(
            "Data-parallel replicas, each a group of nodes holding one full (sharded) copy of "
            "the model. A replica is the unit of failure: when one fails only it is replaced. "
            "May be changed while the job runs."
        ),
    )
    min_replicas: int = Field(
        1, ge=1, le=MAX_REPLICAS,
        description=(
            "Fewest healthy replicas with which training goes on; below it the job is Degraded "
            "and training pauses."
        ),
    )
    spare_replicas: int = Field(
        0, ge=0, le=MAX_REPLICAS,
        description="Hot spare replicas kept running that take over a failed replica's identity at once.",
    )
    nodes_per_replica: int = Field(
        1, ge=1, le=MAX_NODES_PER_REPLICA,
        description="Pods (one per node) in each replica.",
        json_schema_extra=immutable("nodesPerReplica", _SHARDING_IS_FIXED),
    )
    procs_per_node: int = Field(
        1, ge=1, le=MAX_PROCS_PER_NODE,
        description="Worker processes per pod, usually one per GPU.",
        json_schema_extra=immutable("procsPerNode", _SHARDING_IS_FIXED),
    )
    suspend: bool = Field(
        False,
        description=(
            "Delete the job's pods and keep its state; setting it back to false resumes from "
            "the last checkpoint."
        ),
    )
    template: PodTemplate = Field(description=POD_TEMPLATE_SCHEMA["description"])
    checkpoint: Checkpoint | None = Field(
        None, description="Checkpointing; without it a job that loses every replica starts over.",
    )
    fault_tolerance: FaultTolerance = _defaulted(FaultTolerance)
    detection: Detection = _defaulted(Detection)
    preflight: Preflight = _defaulted(Preflight)

    @field_validator("template")
    @classmethod
    def _template_is_buildable(cls, template: dict[str, Any]) -> dict[str, Any]:
        check_template(template)
        return template


# --- the resource ---------------------------------------------------------------------

def _name(job: TrainingJob) -> str | None:
    name = job.metadata.get("name")
    return name if isinstance(name, str) else None


class TrainingJob(ApiModel):
    """A fault-tolerant PyTorch training job whose failed replicas are replaced alone."""

    cel_rules = (
        Rule(
            f"size(self.metadata.name) <= {MAX_JOB_NAME}",
            f"metadata.name must be at most {MAX_JOB_NAME} characters: it prefixes the names of "
            "the job's pods and Services",
            lambda j: (name := _name(j)) is None or len(name) <= MAX_JOB_NAME,
        ),
        Rule(
            f"self.metadata.name.matches('{DNS_LABEL_1035}')",
            "metadata.name must start with a lowercase letter and contain only lowercase "
            "letters, digits and '-': it names the job's Services",
            lambda j: (name := _name(j)) is None or re.fullmatch(DNS_LABEL_1035, name) is not None,
        ),
    )

    api_version: Annotated[Literal["transom.io/v1alpha1"], WithJsonSchema({
        "type": "string", "maxLength": 64,
        "description": "APIVersion defines the versioned schema of this representation of an object.",
    })]
    kind: Annotated[Literal["TrainingJob"], WithJsonSchema({
        "type": "string", "maxLength": 64,
        "description": "Kind is a string value representing the REST resource this object represents.",
    })]
    # The API server allows nothing but the type here (it knows ObjectMeta).
    metadata: Annotated[dict[str, Any], WithJsonSchema({"type": "object"})] = Field(default_factory=dict)
    spec: TrainingJobSpec = Field(description="Desired state of the job.")
    status: TrainingJobStatus | None = Field(None, description="Observed state of the job.")
