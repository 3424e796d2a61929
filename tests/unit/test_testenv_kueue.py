"""The test environment's Kueue (hack/testenv/kueue.py): its Configuration has the keys Kueue
decodes strictly, its pod finds that configuration and its certificates where the
configuration and Kueue's main.go look for them, and no webhook configuration is registered."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

from testenv import kueue  # noqa: E402

UPSTREAM_ROLE = """---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: manager-role
rules:
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch]
"""


def objects() -> list[dict]:
    role = kueue.load_cluster_role(UPSTREAM_ROLE)
    return kueue.manifests("transom.local/kueue:test", role, b"CERT", b"KEY", b"CA")


def by_kind(kind: str) -> list[dict]:
    return [o for o in objects() if o["kind"] == kind]


def test_the_configuration_turns_off_what_needs_a_cluster_installation():
    config = kueue.configuration()
    assert (config["apiVersion"], config["kind"]) == ("config.kueue.x-k8s.io/v1beta2", "Configuration")
    assert set(config) == {"apiVersion", "kind", "namespace", "health", "metrics", "webhook", "leaderElection",
                           "internalCertManagement", "featureGates", "integrations"}
    assert config["namespace"] == kueue.NAMESPACE == "kueue-system"
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["internalCertManagement"] == {"enable": False}
    assert config["featureGates"] == {"VisibilityOnDemand": False}
    assert config["health"] == {"healthProbeBindAddress": ":8081"}
    assert config["webhook"] == {"port": 9443, "certDir": kueue.WEBHOOK_CERT_DIR}
    assert config["integrations"] == {"frameworks": ["batch/job"],
                                      "externalFrameworks": ["TrainingJob.v1alpha1.transom.io"]}


def test_every_object_is_well_formed_and_namespaced_ones_are_in_kueue_system():
    docs = objects()
    for o in docs:
        assert o["apiVersion"] and o["kind"] and o["metadata"]["name"]
        if o["kind"] not in {"Namespace", "ClusterRole", "ClusterRoleBinding"}:
            assert o["metadata"]["namespace"] == kueue.NAMESPACE, o["kind"]
    assert docs[0] == {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": kueue.NAMESPACE}}
    assert not [o for o in docs if "WebhookConfiguration" in o["kind"]]
    yaml.safe_load_all(yaml.safe_dump_all(docs))  # plain data, nothing only Python can hold


def test_the_cluster_role_is_kueues_own_renamed_and_bound_to_the_service_account():
    [role] = by_kind("ClusterRole")
    assert role["metadata"]["name"] == kueue.CLUSTER_ROLE
    assert role["rules"][0] == {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"],
                                "verbs": ["get", "list", "watch"]}
    assert {"apiGroups": ["transom.io"], "resources": ["trainingjobs"], "verbs": ["get", "list", "watch"]} \
        in role["rules"]
    for binding in by_kind("ClusterRoleBinding") + by_kind("RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": kueue.NAME, "namespace": kueue.NAMESPACE}]
    [binding] = by_kind("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == kueue.CLUSTER_ROLE


def test_a_role_file_that_is_not_one_cluster_role_is_refused():
    with pytest.raises(ValueError, match="one object"):
        kueue.load_cluster_role(UPSTREAM_ROLE + UPSTREAM_ROLE)
    with pytest.raises(ValueError, match="ClusterRole"):
        kueue.load_cluster_role(UPSTREAM_ROLE.replace("kind: ClusterRole", "kind: Role"))


def test_the_pod_reads_its_configuration_and_certificates_where_kueue_looks():
    [deployment] = by_kind("Deployment")
    [config_map] = by_kind("ConfigMap")
    [secret] = by_kind("Secret")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_arg = next(a for a in container["args"] if a.startswith("--config="))
    config_path = Path(config_arg.removeprefix("--config="))
    assert volumes[mounts[str(config_path.parent)]]["configMap"]["name"] == config_map["metadata"]["name"]
    assert yaml.safe_load(config_map["data"][config_path.name]) == kueue.configuration()
    # main.go's metrics path when Kueue manages no certificates, and the webhook's certDir.
    for cert_dir in ("/etc/kueue/metrics/certs", kueue.configuration()["webhook"]["certDir"]):
        assert volumes[mounts[cert_dir]]["secret"]["secretName"] == secret["metadata"]["name"]
    assert {k: base64.b64decode(v) for k, v in secret["data"].items()} == \
        {"tls.crt": b"CERT", "tls.key": b"KEY", "ca.crt": b"CA"}
    assert pod["serviceAccountName"] == kueue.NAME


def test_the_pod_runs_unprivileged_on_a_read_only_root_with_probes_on_the_health_port():
    [deployment] = by_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert deployment["spec"]["replicas"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["imagePullPolicy"] == "Never"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert ports["health"] == 8081
    assert deployment["spec"]["selector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
