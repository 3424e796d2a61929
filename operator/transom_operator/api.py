"""The `TrainingJob` custom resource (transom.io/v1alpha1) as pydantic models.

These models are the single source of the API: `crdgen` turns them into the CRD's
structural OpenAPI schema, the operator parses live objects with them, and tests validate
example manifests with them. Python fields are snake_case; the wire (and the CRD) is
camelCase through the alias generator, so `TrainingJob.model_validate(obj)` takes what the
API server returns and `model_dump(by_alias=True, exclude_none=True, mode="json")` gives
back what it accepts.

Rules of the house, from the Kubernetes API conventions: every field has a description
(it is the `kubectl explain` text), every number, string and list is bounded, no floats
(ratios are integer percents or decimal strings), durations are integer `...Seconds`,
choices are CamelCase enums. A rule that spans fields is a `Rule`: one CEL expression for
the API server (`x-kubernetes-validations`) and the same check in Python, with one message
for both, so that a manifest the models accept is one the API server accepts.
"""

from __future__ import annotations

from collections.abc import Callable
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic.alias_generators import to_camel

from transom.contract import BACKENDS, DEFAULT_BACKEND, RESERVED_DOMAIN, is_reserved_key

GROUP = "transom.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj",)
CRD_NAME = f"{PLURAL}.{GROUP}"

# Bounds. The largest published FT-HSDP run is 12 replicas x 1,024 nodes x 8 GPUs; these
# leave room above it while keeping CEL cost estimates and status objects small.
MAX_REPLICAS = 1024  # the coordinator takes up to 4,096
MAX_NODES_PER_REPLICA = 4096
MAX_PROCS_PER_NODE = 128
MAX_RANKS_PER_REPLICA = 32768  # nodesPerReplica x procsPerNode
MAX_PODS = 16384  # (replicas + spareReplicas) x nodesPerReplica
# The job's name prefixes its pods' and Services' names (DNS labels of at most 63
# characters); the rest is left for suffixes such as "-r1023-g12345-n4095".
MAX_JOB_NAME = 40
MAX_CONTAINERS = 32
MAX_STEP = 2**62  # as the coordinator's
MAX_RESTARTS = 10_000  # bound of faultTolerance.maxReplicaRestarts
MAX_GENERATION = 2**31
MAX_COUNT = 2**31 - 1
# The API server keeps `maximum` as a float64: 2**63 - 1 would round up and overflow to a
# negative bound, 2**62 is exact.
MAX_INT = 2**62

DNS_LABEL_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CAMEL_CASE = r"^[A-Z][A-Za-z0-9]*$"

JobState = Literal["Pending", "Running", "Degraded", "Recovering", "Succeeded", "Failed", "Suspended"]
ReplicaState = Literal["Pending", "Running", "Replacing", "Succeeded", "Failed"]
SpareState = Literal["Pending", "Ready"]
ConditionType = Literal["Ready", "Degraded", "Recovering", "Succeeded", "Failed"]
CONDITION_TYPES: tuple[str, ...] = get_args(ConditionType)
NodeExclusionPolicy = Literal["Exclude", "Taint", "Cordon", "None"]
Backend = Literal[BACKENDS]  # the values transom.ft.backend understands
DetectionAction = Literal["Replace", "Report"]


@dataclass(frozen=True)
class Rule:
    """A validation rule: CEL for the API server and the same check in Python, one message."""

    cel: str
    message: str
    check: Callable[[Any], bool]  # takes the validated model (or the raw value it is attached to)
    field_path: str = ""  # where the API server reports it, relative to the node (".minReplicas")

    def schema(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def immutable(field: str, why: str) -> dict[str, Any]:
    """Schema extra of a field that may be set at creation and never changed (a transition rule)."""
    return {"x-kubernetes-validations": [
        {"rule": "self == oldSelf", "message": f"{field} is immutable: {why}"},
    ]}


def _attach_rules(schema: dict[str, Any], cls: type) -> None:
    rules = getattr(cls, "cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.schema() for rule in rules]


class ApiModel(BaseModel):
    """Base of every object in the CRD: camelCase on the wire, unknown fields rejected."""

    # As the API server: unknown fields are an error (kubectl's strict field validation)
    # and no coercion ("3" or 3.0 is not an integer).
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True,
        json_schema_extra=_attach_rules,
    )
    cel_rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self):
        for rule in self.cel_rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self


class StatusModel(ApiModel):
    """Base of status objects: written by the operator and coordinator, read by possibly older ones."""

    model_config = ConfigDict(extra="ignore", strict=False)  # timestamps arrive as strings


def _str(max_length: int, pattern: str | None = None) -> Any:
    return Field(max_length=max_length, pattern=pattern)


# A point in time, RFC 3339 on the wire ("2025-01-31T12:00:00Z").
Timestamp = Annotated[datetime, Field(json_schema_extra={"maxLength": 64})]
Reason = Annotated[str, _str(128, CAMEL_CASE)]
NodeName = Annotated[str, _str(253, DNS_SUBDOMAIN)]
# A list item has no Field of its own to carry the description.
NodeNameItem = Annotated[NodeName, Field(json_schema_extra={"description": "Name of a node."})]


# --- spec -----------------------------------------------------------------------------

def _pod_template_has_container(template: dict[str, Any]) -> bool:
    pod_spec = template.get("spec")
    containers = pod_spec.get("containers") if isinstance(pod_spec, dict) else None
    return isinstance(containers, list) and len(containers) > 0


TEMPLATE_HAS_CONTAINER = Rule(
    cel="has(self.spec) && has(self.spec.containers) && size(self.spec.containers) > 0",
    message="template.spec.containers must list at least one container (the one that runs the training script)",
    check=_pod_template_has_container,
)

_PASSTHROUGH = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
MAX_TEMPLATE_KEYS = 256  # labels or annotations of the pod template (bounds the CEL cost)


def _reserved_keys(template: dict[str, Any]) -> list[str]:
    meta = template.get("metadata")
    if not isinstance(meta, dict):
        return []
    return [f"{kind}: {key}" for kind in ("labels", "annotations")
            if isinstance(meta.get(kind), dict) for key in meta[kind] if is_reserved_key(str(key))]


TEMPLATE_NO_RESERVED_KEYS_MESSAGE = (
    f"template.metadata labels and annotations must not use the {RESERVED_DOMAIN}/ prefix: the operator "
    "sets those keys, and a template must not pose as it"
)


def _string_map(what: str) -> dict[str, Any]:
    """A labels or annotations map of the template, whose keys must not be reserved."""
    return {
        "type": "object",
        "maxProperties": MAX_TEMPLATE_KEYS,
        "additionalProperties": {"type": "string"},
        "description": f"{what} of the worker pods. Keys under {RESERVED_DOMAIN}/ are reserved for the operator.",
        "x-kubernetes-validations": [{
            "rule": f"self.all(k, !k.startsWith('{RESERVED_DOMAIN}/') && !k.contains('.{RESERVED_DOMAIN}/'))",
            "message": TEMPLATE_NO_RESERVED_KEYS_MESSAGE,
        }],
    }


# The pod template is passed through unchecked (the API server validates it when the
# operator creates the pods); only what CEL must see is declared: spec.containers, and the
# labels and annotations, whose reserved keys are refused.
_POD_TEMPLATE_SCHEMA = {
    **_PASSTHROUGH,
    "x-kubernetes-embedded-resource": False,
    "description": (
        "Pod template (a core/v1 PodTemplateSpec) of every worker pod. It is kept as an "
        "object passthrough: its fields are not listed here and are validated when the "
        "operator creates the pods. The operator adds the transom.io labels, the TRANSOM_* "
        "environment of the launcher, a node anti-affinity for excluded nodes and, where the "
        "template leaves them unset, a restricted security context."
    ),
    "properties": {
        "metadata": {
            **_PASSTHROUGH,
            "description": "Labels and annotations for the worker pods.",
            "properties": {"labels": _string_map("Labels"), "annotations": _string_map("Annotations")},
        },
        "spec": {
            **_PASSTHROUGH,
            "description": "The worker pod's spec (core/v1 PodSpec).",
            "properties": {
                "containers": {
                    "type": "array",
                    "maxItems": MAX_CONTAINERS,
                    "description": "The pod's containers; the first one runs the Transom launcher.",
                    "items": {**_PASSTHROUGH, "description": "A core/v1 Container."},
                },
            },
        },
    },
    "x-kubernetes-validations": [TEMPLATE_HAS_CONTAINER.schema()],
}
PodTemplate = Annotated[dict[str, Any], WithJsonSchema(_POD_TEMPLATE_SCHEMA)]


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
        500, ge=1, le=10_000_000, description="Optimizer steps between two checkpoints.",
    )
    keep: int = Field(
        3, ge=1, le=1000, description="How many committed checkpoints to keep; older ones are deleted.",
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
        60, ge=1, le=3600,
        description="Longest a cross-replica collective may block before its replica is dropped from the step.",
    )
    backend: Backend = Field(
        DEFAULT_BACKEND,
        description=(
            "torch.distributed backend of the workers (TRANSOM_BACKEND). auto: NCCL where each process has a GPU of "
            "its own and the tensors are on it, Gloo otherwise. gloo or nccl force one; a forced nccl that cannot "
            "work is refused when the worker starts, with what to change."
        ),
    )
    heartbeat_timeout_seconds: int = Field(
        30, ge=1, le=3600,
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


class Detection(ApiModel):
    """Thresholds of the anomaly detectors that flag slow (fail-slow) or corrupt replicas."""

    enabled: bool = Field(True, description="Run the detectors.")
    warmup_steps: int = Field(
        50, ge=0, le=1_000_000,
        description="Steps to observe before any verdict (the step-time model is fitted on them).",
    )
    step_time_slowdown_factor_percent: int = Field(
        150, ge=101, le=10_000,
        description=(
            "A replica's step is slow when it takes longer than this percent of the time "
            "predicted for its workload (150 means 1.5 times), so long sequences are not taken for bad hardware."
        ),
    )
    consecutive_slow_steps: int = Field(
        5, ge=1, le=10_000, description="Slow steps in a row after which the replica is flagged.",
    )
    loss_spike_factor_percent: int = Field(
        300, ge=101, le=100_000,
        description="A replica's loss above this percent of the running mean (300 means 3 times) flags it.",
    )
    action: DetectionAction = Field(
        "Replace",
        description=(
            "What a verdict does. Replace: the replica is replaced and its nodes handled as "
            "after a hardware failure. Report: an Event and a metric only."
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
    template: PodTemplate = Field(description=_POD_TEMPLATE_SCHEMA["description"])
    checkpoint: Checkpoint | None = Field(
        None, description="Checkpointing; without it a job that loses every replica starts over.",
    )
    fault_tolerance: FaultTolerance = _defaulted(FaultTolerance)
    detection: Detection = _defaulted(Detection)

    @field_validator("template")
    @classmethod
    def _template_has_container(cls, template: dict[str, Any]) -> dict[str, Any]:
        if not TEMPLATE_HAS_CONTAINER.check(template):
            raise ValueError(TEMPLATE_HAS_CONTAINER.message)
        meta = template.get("metadata")
        for kind in ("labels", "annotations"):
            value = meta.get(kind) if isinstance(meta, dict) else None
            if value is not None and (not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KEYS
                                      or not all(isinstance(v, str) for v in value.values())):
                raise ValueError(f"template.metadata.{kind} must map at most {MAX_TEMPLATE_KEYS} keys to strings")
        if _reserved_keys(template):
            raise ValueError(f"{TEMPLATE_NO_RESERVED_KEYS_MESSAGE} (found {', '.join(_reserved_keys(template))})")
        return template


# --- status ---------------------------------------------------------------------------

class Condition(StatusModel):
    """An observation of one aspect of the job (Kubernetes condition conventions)."""

    type: str = Field(
        max_length=64, pattern=CAMEL_CASE,
        description="Kind of condition: Ready, Degraded, Recovering, Succeeded or Failed.",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: Reason | None = Field(None, description="Why, as one CamelCase word (for example NodeNotReady).")
    message: str | None = Field(None, max_length=4096, description="Why, for humans.")
    last_transition_time: Timestamp | None = Field(None, description="When status last changed.")
    observed_generation: int | None = Field(
        None, ge=0, le=MAX_INT, description="metadata.generation of the spec this condition was computed from.",
    )


class Failure(StatusModel):
    """A failure of a replica."""

    reason: Reason = Field(description="Kind of failure as one CamelCase word (for example PodFailed, NodeNotReady).")
    message: str | None = Field(None, max_length=4096, description="What happened, for humans.")
    time: Timestamp | None = Field(None, description="When the failure was detected.")


class ReplicaStatus(StatusModel):
    """Observed state of one data-parallel replica."""

    id: int = Field(ge=0, le=MAX_REPLICAS - 1, description="Replica index, 0 to replicas - 1.")
    generation: int = Field(
        0, ge=0, le=MAX_GENERATION, description="Incarnation of the replica; each replacement increments it.",
    )
    state: ReplicaState = Field("Pending", description="Pending, Running, Replacing, Succeeded or Failed.")
    nodes: list[NodeNameItem] = Field(
        default_factory=list, max_length=MAX_NODES_PER_REPLICA,
        description="Nodes of the replica's pods, by node rank.",
    )
    restarts: int = Field(0, ge=0, le=MAX_COUNT, description="Times this replica was replaced.")
    last_failure: Failure | None = Field(None, description="The replica's most recent failure.")


class SpareStatus(StatusModel):
    """Observed state of one hot spare replica (pods kept running to take over a failed replica)."""

    id: int = Field(ge=0, le=MAX_REPLICAS - 1, description="Spare index, 0 to spareReplicas - 1.")
    generation: int = Field(
        0, ge=0, le=MAX_GENERATION,
        description="Incarnation of the spare; it increments when the spare is promoted or its pods are replaced.",
    )
    state: SpareState = Field("Pending", description="Ready (every pod running, can take over) or Pending.")
    nodes: list[NodeNameItem] = Field(
        default_factory=list, max_length=MAX_NODES_PER_REPLICA,
        description="Nodes of the spare's pods, by node rank.",
    )
    last_failure: Failure | None = Field(None, description="Why the spare's pods were last replaced, if they were.")


class ExcludedNode(StatusModel):
    """A node that this job's pods avoid after a hardware-class failure on it."""

    name: NodeName = Field(description="Name of the node.")
    reason: Reason = Field(description="The failure that excluded it, as one CamelCase word.")
    time: Timestamp | None = Field(None, description="When the node was excluded.")


Blame = Literal["Replica", "Node"]


class Verdict(StatusModel):
    """The coordinator's request that one incarnation of a replica be replaced."""

    cel_rules = (
        Rule(
            "self.blame != 'Node' || has(self.nodeRank)",
            "nodeRank must be set when blame is Node: it names the node to exclude",
            lambda v: v.blame != "Node" or v.node_rank is not None,
            ".nodeRank",
        ),
    )

    replica: int = Field(ge=0, le=MAX_REPLICAS - 1, description="The replica to replace.")
    generation: int = Field(
        ge=0, le=MAX_GENERATION,
        description="The incarnation the verdict is about; a newer one (already replaced) is left alone.",
    )
    reason: Reason = Field(description="What was found, as one CamelCase word (for example Hang, FailSlow).")
    message: str | None = Field(None, max_length=1024, description="What was found, for humans.")
    blame: Blame = Field(
        "Replica",
        description=(
            "Replica: replace the replica. Node: also treat the node of pod nodeRank as faulty "
            "(spec.faultTolerance.nodeExclusionPolicy)."
        ),
    )
    node_rank: int | None = Field(
        None, ge=0, le=MAX_NODES_PER_REPLICA - 1, description="The pod (node rank) whose node is blamed.",
    )
    time: Timestamp | None = Field(None, description="When the verdict was reached.")


class TrainingProgress(StatusModel):
    """Training progress, written by the job's coordinator (a job's user cannot write status)."""

    step: int | None = Field(None, ge=0, le=MAX_STEP, description="Last optimizer step committed by the replicas.")
    completed_step: int | None = Field(
        None, ge=0, le=MAX_STEP,
        description=(
            "Set once a replica committed the job's last step (or its script ended the job): "
            "training is complete. Worker pods that exit before it are failures."
        ),
    )
    verdicts: list[Verdict] = Field(
        default_factory=list, max_length=MAX_REPLICAS,
        description="Replica incarnations the coordinator wants replaced; the operator acts on them.",
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    last_checkpoint: int | None = Field(
        None, ge=0, le=MAX_STEP,
        description="Step of the last committed checkpoint (the directory step-<N>/ under spec.checkpoint.uri).",
    )
    last_checkpoint_time: Timestamp | None = Field(None, description="When the last checkpoint was committed.")
    goodput: str | None = Field(
        None, max_length=5, pattern=r"^(0(\.[0-9]{1,3})?|1(\.0{1,3})?)$",
        description=(
            "Fraction of the job's time spent on steps that were kept, as a decimal string "
            "from \"0\" to \"1.000\" with at most three decimals (for example \"0.930\")."
        ),
    )
    update_time: Timestamp | None = Field(None, description="When the coordinator last wrote this.")


class RestartRecord(StatusModel):
    """One replacement of a replica within spec.faultTolerance.restartWindowSeconds."""

    replica: int = Field(ge=0, le=MAX_REPLICAS - 1, description="The replica that was replaced.")
    generation: int = Field(ge=0, le=MAX_GENERATION, description="The incarnation that failed.")
    time: int = Field(ge=0, le=MAX_INT, description="When its failure was seen, in unix seconds.")
    node: NodeName | None = Field(None, description="The node of its pod that failed first, if any.")


MAX_RESTART_HISTORY = MAX_RESTARTS + MAX_REPLICAS  # the limit, plus the failures of the pass that exceeds it


class TrainingJobStatus(StatusModel):
    """Observed state of a TrainingJob, written by the operator (training: by the coordinator)."""

    observed_generation: int | None = Field(
        None, ge=0, le=MAX_INT, description="metadata.generation of the last spec the operator acted on.",
    )
    state: JobState | None = Field(
        None,
        description=(
            "Summary: Pending, Running, Degraded, Recovering, Succeeded, Failed or Suspended. "
            "Conditions carry the details."
        ),
    )
    healthy: str | None = Field(
        None, max_length=11, pattern=r"^[0-9]{1,5}/[0-9]{1,5}$",
        description="Healthy replicas out of spec.replicas, as \"3/4\" (for kubectl get).",
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16,
        description="Ready, Degraded, Recovering, Succeeded and Failed, at most one of each type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    healthy_replicas: int | None = Field(None, ge=0, le=MAX_REPLICAS, description="Replicas with every pod running.")
    ready_spare_replicas: int | None = Field(
        None, ge=0, le=MAX_REPLICAS, description="Spare replicas ready to take over.",
    )
    total_restarts: int | None = Field(
        None, ge=0, le=MAX_COUNT, description="Replica replacements since the job started.",
    )
    replicas: list[ReplicaStatus] = Field(
        default_factory=list, max_length=MAX_REPLICAS, description="Per-replica state, by replica id.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )
    spares: list[SpareStatus] = Field(
        default_factory=list, max_length=MAX_REPLICAS, description="Per-spare state, by spare id.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )
    restart_history: list[RestartRecord] = Field(
        default_factory=list, max_length=MAX_RESTART_HISTORY,
        description=(
            "Replacements within restartWindowSeconds, oldest first: what maxReplicaRestarts, the "
            "backoff and the repeated-failures rule count. Kept in status so only the operator writes it."
        ),
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    excluded_nodes: list[ExcludedNode] = Field(
        default_factory=list, max_length=1024,
        description="Nodes that this job's new pods avoid (see spec.faultTolerance.nodeExclusionPolicy).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    training: TrainingProgress | None = Field(None, description="Training progress, written by the coordinator.")


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
            lambda j: _name(j) is None or len(_name(j)) <= MAX_JOB_NAME,
        ),
        Rule(
            f"self.metadata.name.matches('{DNS_LABEL_1035}')",
            "metadata.name must start with a lowercase letter and contain only lowercase "
            "letters, digits and '-': it names the job's Services",
            lambda j: _name(j) is None or re.fullmatch(DNS_LABEL_1035, _name(j)) is not None,
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
