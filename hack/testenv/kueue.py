"""A real Kueue in the test environment, so that Transom's queueing is tested against the
scheduler that admits its Workloads rather than against a fake.

Kueue (KUEUE_VERSION, built from its Go module by build.py; image from images.py) runs as
one pod on a real node, in namespace `kueue-system`, and reaches the API server as the
Prometheus pod does: in-cluster configuration through its ServiceAccount's token and the
`kubernetes` Service (addons.py). `up --real-nodes N` applies its CRDs server-side (the
Workload CRD is 1.4 MB, over client-side apply's 256 KiB annotation), then `manifests`,
and waits for the Deployment to be Available.

What differs from Kueue's own manifests (config/default), and why:
- No webhook configurations are registered with the API server: the API server never calls
  Kueue, and admission works without them (lost: Kueue's validation and defaulting of
  Workloads, ClusterQueues and ResourceFlavors, e.g. their `resource-in-use` finalizers, and
  the pod integration's gating, which Transom does not use). Kueue's webhook *server* starts
  whatever the configuration says, so it still needs a certificate.
- `internalCertManagement` off: its rotator writes a Secret and waits for a Service's
  certificate to appear in a volume. Instead `up` issues one certificate from the testenv's
  CA (`serving_certificate`) and mounts its Secret at the webhook's certDir and at the
  metrics path that cmd/kueue/main.go hard-codes when it manages no certificates
  (METRICS_CERT_DIR; it exits when the files are missing, metrics on or off).
- Feature gate VisibilityOnDemand off: it starts an aggregated API server whose
  certificates are hard-coded under /visibility.
- Leader election off (one replica): no Role for leases.
- `integrations.externalFrameworks` lists TrainingJob: Kueue then treats a TrainingJob as a
  known owner (its pods are never gated by a `pod` integration) and runs no controller for
  it: Transom's operator creates and follows the Workload itself.

Costs (this box, 2 cores, 2026-11-26): the kueue binary, 87 MB, builds in 2 min 58 s with
an empty Go build cache and its module already downloaded (1.7 GB peak RSS; 2 min 28 s with
the cache warm from the Kubernetes builds); its image in 1.0 s (29 MB). Kueue's part of
`up --real-nodes 3`: 3.3-3.7 s to apply the CRDs (and see them Established) and the
manifests, then the Deployment Available about 1 s after it is created, while Prometheus
starts beside it.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:  # certs needs `cryptography`, which `make test-compat`'s venv does not have
    from testenv import certs

NAMESPACE = "kueue-system"
NAME = "kueue-controller-manager"  # the Deployment, its ServiceAccount, ConfigMap and container
CLUSTER_ROLE = "transom-testenv-kueue-manager"  # Kueue's `manager-role`, renamed, plus EXTRA_RULES
CERT_SECRET = "kueue-certs"
# The Service name a Kueue installation's webhook certificate is issued for (no Service is made).
WEBHOOK_SERVICE = "kueue-webhook-service"
CONFIG_DIR = "/etc/kueue-config"
CONFIG_KEY = "controller_manager_config.yaml"
METRICS_CERT_DIR = "/etc/kueue/metrics/certs"  # hard-coded in cmd/kueue/main.go
WEBHOOK_CERT_DIR = "/etc/kueue/webhook/certs"
HEALTH_PORT, WEBHOOK_PORT, METRICS_PORT = 8081, 9443, 8443
FRAMEWORKS = ("batch/job",)
EXTERNAL_FRAMEWORKS = ("TrainingJob.v1alpha1.transom.io",)
FEATURE_GATES = {"VisibilityOnDemand": False}
EXTRA_RULES = [
    # Kueue reads a Workload's owner (as metadata) to tell whether a known framework owns it.
    {"apiGroups": ["transom.io"], "resources": ["trainingjobs"], "verbs": ["get", "list", "watch"]},
    # The metrics server authenticates and authorizes each scrape (metrics_auth_role.yaml).
    {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
    {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
]
READY_TIMEOUT_S = 120.0


def configuration() -> dict:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2), decoded strictly by Kueue."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f":{HEALTH_PORT}"},
        "metrics": {"bindAddress": f":{METRICS_PORT}"},
        "webhook": {"port": WEBHOOK_PORT, "certDir": WEBHOOK_CERT_DIR},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "featureGates": dict(FEATURE_GATES),
        "integrations": {"frameworks": list(FRAMEWORKS), "externalFrameworks": list(EXTERNAL_FRAMEWORKS)},
    }


def cluster_role(upstream: dict) -> dict:
    """Kueue's own manager ClusterRole (config/components/rbac/role.yaml) as CLUSTER_ROLE."""
    if upstream.get("kind") != "ClusterRole" or not upstream.get("rules"):
        raise ValueError(f"Kueue's role.yaml must be a ClusterRole with rules, not {upstream.get('kind')}")
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": CLUSTER_ROLE}, "rules": [*upstream["rules"], *EXTRA_RULES]}


def load_cluster_role(text: str) -> dict:
    """role.yaml's one ClusterRole (the file starts with a `---`)."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    if len(docs) != 1:
        raise ValueError(f"Kueue's role.yaml must hold one object, not {len(docs)}")
    return cluster_role(docs[0])


def serving_certificate(ca: certs.CA) -> certs.Pair:
    """The webhook's and the metrics server's certificate, for the names Kueue's would have."""
    service = f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc"
    return ca.issue("kueue", service, dns=(service, f"{service}.cluster.local"), server=True)


def manifests(image: str, role: dict, cert: bytes, key: bytes, ca: bytes) -> list[dict]:
    """Namespace, ServiceAccount, RBAC, configuration, certificates and the Deployment;
    `role` is `cluster_role`'s, `cert`/`key`/`ca` PEM."""
    meta = {"name": NAME, "namespace": NAMESPACE}
    secret_data = {"tls.crt": cert, "tls.key": key, "ca.crt": ca}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        role,
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": CLUSTER_ROLE},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]},
        # Its Secret cache is this namespace's (MultiKueue's kubeconfigs); read-only here,
        # since no certificate rotator writes one (manager_secrets_role.yaml also updates).
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "kueue-secrets", "namespace": NAMESPACE},
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "kueue-secrets", "namespace": NAMESPACE},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kueue-secrets"},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
         "data": {CONFIG_KEY: yaml.safe_dump(configuration(), sort_keys=False)}},
        {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
         "metadata": {"name": CERT_SECRET, "namespace": NAMESPACE},
         "data": {k: base64.b64encode(v).decode() for k, v in secret_data.items()}},
        _deployment(image, meta),
    ]


def _deployment(image: str, meta: dict) -> dict:
    labels = {"app.kubernetes.io/name": "kueue", "app.kubernetes.io/component": "controller"}
    container = {
        "name": "manager", "image": image, "imagePullPolicy": "Never",
        "args": [f"--config={CONFIG_DIR}/{CONFIG_KEY}", "--zap-log-level=2"],
        "ports": [{"name": "health", "containerPort": HEALTH_PORT},
                  {"name": "webhook", "containerPort": WEBHOOK_PORT},
                  {"name": "metrics", "containerPort": METRICS_PORT}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "health"}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "health"}, "periodSeconds": 10,
                          "initialDelaySeconds": 15},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "certs", "mountPath": METRICS_CERT_DIR, "readOnly": True},
                         {"name": "certs", "mountPath": WEBHOOK_CERT_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"serviceAccountName": NAME, "terminationGracePeriodSeconds": 10,
                         "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "fsGroup": 65532,
                                             "seccompProfile": {"type": "RuntimeDefault"}},
                         "containers": [container],
                         "volumes": [{"name": "config", "configMap": {"name": NAME}},
                                     {"name": "certs", "secret": {"secretName": CERT_SECRET}},
                                     {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]}}}}
