"""Building blocks of the TrainingJob API: names, bounds, enums, rules and base models.

Rules of the house, from the Kubernetes API conventions: every field has a description
(it is the `kubectl explain` text), every number, string and list is bounded, no floats
(ratios are integer percents or decimal strings), durations are integer `...Seconds`,
choices are CamelCase enums. A rule that spans fields is a `Rule`: one CEL expression for
the API server (`x-kubernetes-validations`) and the same check in Python, with one message
for both, so that a manifest the models accept is one the API server accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from transom.contract import MAX_REPLICA_RESTARTS

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
MAX_RESTARTS = MAX_REPLICA_RESTARTS  # bound of faultTolerance.maxReplicaRestarts (contract.py)
MAX_GENERATION = 2**31
MAX_COUNT = 2**31 - 1
# The API server keeps `maximum` as a float64: 2**63 - 1 would round up and overflow to a
# negative bound, 2**62 is exact.
MAX_INT = 2**62

DNS_LABEL_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CAMEL_CASE = r"^[A-Z][A-Za-z0-9]*$"



class JobState(StrEnum):
    """status.state: the job as a whole."""

    PENDING = "Pending"
    RUNNING = "Running"
    DEGRADED = "Degraded"
    RECOVERING = "Recovering"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"  # waiting for Kueue to admit it (reconcile/admission.py)


class ReplicaPhase(StrEnum):
    """status.replicas[].state (named apart from ft/state.py's ReplicaState, the training state)."""

    PENDING = "Pending"
    RUNNING = "Running"
    REPLACING = "Replacing"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class SpareState(StrEnum):
    """status.spares[].state."""

    PENDING = "Pending"
    READY = "Ready"


ConditionType = Literal["Ready", "Degraded", "Recovering", "Succeeded", "Failed"]
CONDITION_TYPES: tuple[str, ...] = get_args(ConditionType)
NodeExclusionPolicy = Literal["Exclude", "Taint", "Cordon", "None"]
Backend = Literal["auto", "gloo", "nccl"]  # contract.BACKENDS (a test checks they agree): transom.ft.backend
# contract.PREFLIGHT_CHECKS (a test checks they agree): transom.check
PreflightCheck = Literal["compute", "memory", "collective", "link", "storage", "node"]


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
PreflightCheckItem = Annotated[PreflightCheck, Field(json_schema_extra={"description": "Name of a pre-flight check."})]
