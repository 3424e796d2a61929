"""TrainingJob manifests the API server must reject, with the text its error must contain.

Pure data (no Kubernetes client), shared by two tests: the e2e test creates each manifest
against the real API server and expects a 422 whose message contains `error`; the unit
test `tests/unit/test_crd_generation.py` checks that the pydantic models reject them too.
`VALID_MANIFEST` is the accepted baseline that each case changes in one place.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

VALID_MANIFEST: dict[str, Any] = {
    "apiVersion": "transom.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "tiny-gpt"},
    "spec": {
        "replicas": 3,
        "minReplicas": 2,
        "spareReplicas": 1,
        "nodesPerReplica": 2,
        "procsPerNode": 8,
        "template": {
            "metadata": {"labels": {"team": "ml"}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{
                    "name": "trainer",
                    "image": "ghcr.io/example/trainer:1.0",
                    "command": ["transom", "launch", "--", "python", "train.py"],
                }],
            },
        },
        "checkpoint": {
            "uri": "s3://bucket/tiny-gpt",
            "intervalSteps": 200,
            "keep": 2,
            "credentialsSecret": {"name": "s3-credentials"},
        },
        "faultTolerance": {"maxReplicaRestarts": 5, "backoffSeconds": 5, "nodeExclusionPolicy": "Taint"},
    },
}

_DELETE = object()


def with_changes(**changes: Any) -> dict[str, Any]:
    """A copy of VALID_MANIFEST with `a__b__c=value` set (or deleted with _DELETE)."""
    manifest = copy.deepcopy(VALID_MANIFEST)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = manifest
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return manifest


class InvalidSpec(NamedTuple):
    name: str
    manifest: dict[str, Any]
    error: str  # a substring of the API server's error message


INVALID_SPECS: list[InvalidSpec] = [
    InvalidSpec("replicas-zero", with_changes(spec__replicas=0),
                "should be greater than or equal to 1"),
    InvalidSpec("replicas-not-integer", with_changes(spec__replicas="3"),
                "must be of type integer"),
    InvalidSpec("min-replicas-above-replicas", with_changes(spec__minReplicas=4),
                "minReplicas must be less than or equal to replicas"),
    InvalidSpec("spare-replicas-above-replicas", with_changes(spec__spareReplicas=4),
                "spareReplicas must be less than or equal to replicas"),
    InvalidSpec("too-many-processes-per-replica", with_changes(spec__nodesPerReplica=1024, spec__procsPerNode=64),
                "nodesPerReplica x procsPerNode (processes per replica) must be at most 32768"),
    InvalidSpec("too-many-pods", with_changes(spec__replicas=1000, spec__minReplicas=1, spec__nodesPerReplica=32),
                "(replicas + spareReplicas) x nodesPerReplica (worker pods) must be at most 16384"),
    InvalidSpec("backend-unknown", with_changes(spec__faultTolerance={"backend": "mpi"}),
                'supported values: "auto", "gloo", "nccl"'),
    InvalidSpec("preflight-check-unknown", with_changes(spec__preflight={"checks": ["compute", "gpu-burn"]}),
                'supported values: "compute", "memory", "collective", "link", "storage", "node"'),
    InvalidSpec("preflight-check-twice", with_changes(spec__preflight={"checks": ["compute", "compute"]}),
                "Duplicate value"),
    InvalidSpec("preflight-timeout-zero", with_changes(spec__preflight={"timeoutSeconds": 0}),
                "spec.preflight.timeoutSeconds"),
    InvalidSpec("template-missing", with_changes(spec__template=_DELETE),
                "spec.template: Required value"),
    InvalidSpec("template-without-containers", with_changes(spec__template__spec__containers=[]),
                "template.spec.containers must list at least one container"),
    InvalidSpec("template-without-pod-spec", with_changes(spec__template={"metadata": {"labels": {"a": "b"}}}),
                "template.spec.containers must list at least one container"),
    InvalidSpec("template-label-reserved",
                with_changes(spec__template__metadata={"labels": {"team": "ml", "transom.io/replica": "0"}}),
                "must not use the transom.io/ prefix"),
    InvalidSpec("template-annotation-reserved",
                with_changes(spec__template__metadata={"annotations": {"transom.io/evict-reason": "hardware: xid"}}),
                "must not use the transom.io/ prefix"),
    InvalidSpec("template-annotation-reserved-subdomain",
                with_changes(spec__template__metadata={"annotations": {"x.transom.io/verdict": "Node"}}),
                "must not use the transom.io/ prefix"),
    InvalidSpec("template-label-not-a-string",
                with_changes(spec__template__metadata={"labels": {"team": 7}}),
                "must be of type string"),
    InvalidSpec("template-metadata-not-an-object", with_changes(spec__template__metadata="x"),
                "must be of type object"),
    InvalidSpec("template-container-not-an-object", with_changes(spec__template__spec__containers=["trainer"]),
                "spec.template.spec.containers[0] in body must be of type object"),
    InvalidSpec("template-container-without-name",
                with_changes(spec__template__spec__containers=[{"image": "ghcr.io/example/trainer:1.0"}]),
                "spec.template.spec.containers[0].name: Required value"),
    InvalidSpec("template-env-not-a-list",
                with_changes(spec__template__spec__containers=[{"name": "trainer", "env": "A=1"}]),
                "spec.template.spec.containers[0].env in body must be of type array"),
    InvalidSpec("template-service-account-name",
                with_changes(spec__template__spec__serviceAccountName="tiny-gpt-coordinator"),
                "template.spec.serviceAccountName must not be set: worker pods run as the job's own "
                "<job>-worker ServiceAccount"),
    InvalidSpec("template-service-account-deprecated-alias",
                with_changes(spec__template__spec__serviceAccount="tiny-gpt-coordinator"),
                "template.spec.serviceAccount (the deprecated serviceAccountName) must not be set"),
    InvalidSpec("template-automount-service-account-token",
                with_changes(spec__template__spec__automountServiceAccountToken=True),
                "template.spec.automountServiceAccountToken must not be true"),
    InvalidSpec("checkpoint-keep-zero", with_changes(spec__checkpoint__keep=0),
                "should be greater than or equal to 1"),
    InvalidSpec("checkpoint-relative-uri", with_changes(spec__checkpoint__uri="checkpoints/run1"),
                "spec.checkpoint.uri in body should match"),
    InvalidSpec("checkpoint-secret-bad-name", with_changes(spec__checkpoint__credentialsSecret={"name": "S3_Creds"}),
                "spec.checkpoint.credentialsSecret.name in body should match"),
    InvalidSpec("max-backoff-below-backoff",
                with_changes(spec__faultTolerance={"backoffSeconds": 600, "maxBackoffSeconds": 60}),
                "maxBackoffSeconds must be greater than or equal to backoffSeconds"),
    InvalidSpec("max-backoff-below-default-backoff", with_changes(spec__faultTolerance={"maxBackoffSeconds": 5}),
                "maxBackoffSeconds must be greater than or equal to backoffSeconds"),
    InvalidSpec("unknown-exclusion-policy", with_changes(spec__faultTolerance__nodeExclusionPolicy="Drain"),
                'Unsupported value: "Drain"'),
    InvalidSpec("restarts-as-float", with_changes(spec__faultTolerance__maxReplicaRestarts=1.5),
                "must be of type integer"),
    InvalidSpec("detection-slow-factor-not-above-one", with_changes(spec__detection={"slowFactorPercent": 100}),
                "spec.detection.slowFactorPercent in body should be greater than or equal to 101"),
    InvalidSpec("detection-unknown-slow-action", with_changes(spec__detection={"slowAction": "Restart"}),
                'Unsupported value: "Restart"'),
    InvalidSpec("name-too-long", with_changes(metadata__name="a" * 41),
                "metadata.name must be at most 40 characters"),
    InvalidSpec("name-starts-with-digit", with_changes(metadata__name="7b-pretrain"),
                "metadata.name must start with a lowercase letter"),
]


class InvalidUpdate(NamedTuple):
    name: str
    changes: dict[str, Any]  # applied to VALID_MANIFEST after it was created, as a merge patch
    error: str


# Transition rules: only an update can break them (the models cannot see the old object).
INVALID_UPDATES: list[InvalidUpdate] = [
    InvalidUpdate("nodes-per-replica-changed", {"spec": {"nodesPerReplica": 4}},
                  "nodesPerReplica is immutable"),
    InvalidUpdate("procs-per-node-changed", {"spec": {"procsPerNode": 4}},
                  "procsPerNode is immutable"),
]
