"""The local control plane does what the e2e tests of the operator rely on.

Each test checks one component doing its real job: the API server validating a CRD schema
and enforcing RBAC, the scheduler placing a pod, the garbage collector of
kube-controller-manager deleting a dependent, kwok reporting pod and node status, helm
installing a chart, and the S3 server round-tripping an object.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import boto3
import pytest
import yaml
from botocore.config import Config
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kube_helpers import (
    fail_pod,
    holds_for,
    make_node_not_ready,
    node_condition,
    read_or_none,
    restore_kwok_node,
    wait_for,
)
from testenv import build

CHART = Path(__file__).parent / "charts" / "hello"

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.transom.io"},
    "spec": {
        "group": "test.transom.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
        "versions": [{
            "name": "v1",
            "served": True,
            "storage": True,
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "required": ["spec"],
                "properties": {"spec": {
                    "type": "object",
                    "required": ["size"],
                    "properties": {"size": {"type": "integer", "minimum": 1, "maximum": 10}},
                }},
            }},
        }],
    },
}


def pod_manifest(name: str, **metadata) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **metadata},
        # kwok's fake GPU nodes are tainted as GPU nodes are: a pod must tolerate it to land there
        # (and only there: the real nodes would try to run busybox).
        "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox"}],
                 "nodeSelector": {"type": "kwok"},
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    }


def wait_running(core_v1: client.CoreV1Api, namespace: str, name: str, timeout_s: float = 60) -> client.V1Pod:
    def running():
        pod = core_v1.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase == "Running" else None

    return wait_for(running, timeout_s, f"pod {namespace}/{name} to be Running")


def test_kwok_nodes_are_ready(control_plane, kubectl):
    nodes = json.loads(kubectl("get", "nodes", "-l", "type=kwok", "-o", "json").stdout)["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(control_plane.nodes)
    assert control_plane.nodes, "the control plane has no nodes"
    for node in nodes:
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert [c["status"] for c in ready] == ["True"], (node["metadata"]["name"], node["status"]["conditions"])
        assert node["status"]["allocatable"].get("nvidia.com/gpu") == "8", node["status"]["allocatable"]
        assert node["metadata"]["annotations"].get("kwok.x-k8s.io/node") == "fake"
    # and as a person reads it
    table = kubectl("get", "nodes", "-l", "type=kwok", "--no-headers").stdout.splitlines()
    statuses = {line.split()[0]: line.split()[1] for line in table}
    assert statuses == {name: "Ready" for name in control_plane.nodes}, table


def test_kubectl_and_apiserver_versions(control_plane, kubectl):
    versions = json.loads(kubectl("version", "-o", "json").stdout)
    assert build.K8S_VERSION == "v1.35.4"
    assert control_plane.version == build.K8S_VERSION
    assert versions["clientVersion"]["gitVersion"] == build.K8S_VERSION, versions
    assert versions["serverVersion"]["gitVersion"] == build.K8S_VERSION, versions


@pytest.fixture(scope="module")
def widget_crd(kubectl):
    name = WIDGET_CRD["metadata"]["name"]
    kubectl("apply", "-f", "-", input=yaml.safe_dump(WIDGET_CRD))
    kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=30s")
    yield WIDGET_CRD
    kubectl("delete", "crd", name, "--timeout=30s")


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (0, "should be greater than or equal to 1"),
        (11, "should be less than or equal to 10"),
        ("big", "must be of type integer"),
        (None, "Required value"),
    ],
)
def test_crd_schema_is_enforced_by_the_apiserver(widget_crd, kube_api, kubectl, namespace, size, message):
    custom = client.CustomObjectsApi(kube_api)

    def widget(name, spec):
        return {"apiVersion": "test.transom.io/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}

    # a valid object is accepted, through kubectl as through the API
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(widget("good", {"size": 3})))
    got = custom.get_namespaced_custom_object("test.transom.io", "v1", namespace, "widgets", "good")
    assert got["spec"] == {"size": 3}

    spec = {} if size is None else {"size": size}
    with pytest.raises(ApiException) as raised:
        custom.create_namespaced_custom_object("test.transom.io", "v1", namespace, "widgets", widget("bad", spec))
    assert raised.value.status == 422, raised.value
    assert "spec.size" in raised.value.body and message in raised.value.body, raised.value.body
    rejected = kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(widget("bad", spec)), check=False)
    assert rejected.returncode != 0 and "spec.size" in rejected.stderr, rejected.stderr
    assert kubectl("get", "widgets", "-n", namespace, "-o", "name").stdout.split() == ["widget.test.transom.io/good"]


def test_scheduler_places_pod_and_kwok_runs_it(control_plane, core_v1, namespace):
    core_v1.create_namespaced_pod(namespace, pod_manifest("sleeper"))
    pod = wait_running(core_v1, namespace, "sleeper")
    assert pod.spec.node_name in control_plane.nodes, pod.spec.node_name
    scheduled = [c for c in pod.status.conditions if c.type == "PodScheduled"]
    assert [c.status for c in scheduled] == ["True"], pod.status.conditions
    assert pod.status.container_statuses[0].state.running is not None, pod.status.container_statuses


def test_garbage_collector_deletes_dependents(core_v1, namespace):
    owner = core_v1.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}, "data": {"k": "v"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid,
           "blockOwnerDeletion": True}
    core_v1.create_namespaced_pod(namespace, pod_manifest("dependent", ownerReferences=[ref]))
    wait_running(core_v1, namespace, "dependent")

    core_v1.delete_namespaced_config_map("owner", namespace)
    wait_for(lambda: read_or_none(core_v1.read_namespaced_pod, "dependent", namespace) is None, 60,
             "the garbage collector to delete the pod owned by the deleted ConfigMap")


def test_fail_pod_reads_back_failed(core_v1, namespace):
    core_v1.create_namespaced_pod(namespace, pod_manifest("victim"))
    wait_running(core_v1, namespace, "victim")

    fail_pod(core_v1, namespace, "victim", exit_code=3)

    def failed_with_3():
        pod = core_v1.read_namespaced_pod("victim", namespace)
        states = [cs.state.terminated for cs in pod.status.container_statuses]
        return pod.status.phase == "Failed" and [t and t.exit_code for t in states] == [3]

    assert failed_with_3()
    holds_for(failed_with_3, 5, "pod victim Failed with exit code 3 (kwok must not revert it)")


def test_helm_install_and_uninstall(helm, core_v1, namespace):
    helm("install", "greeter", str(CHART), "--namespace", namespace, "--set", "greeting=from-e2e",
         "--wait", "--timeout", "60s", timeout_s=90)
    cm = core_v1.read_namespaced_config_map("greeter-hello", namespace)
    assert cm.data == {"greeting": "from-e2e"}
    releases = json.loads(helm("list", "--namespace", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("greeter", "deployed")]

    helm("uninstall", "greeter", "--namespace", namespace, "--wait", "--timeout", "60s", timeout_s=90)
    wait_for(lambda: read_or_none(core_v1.read_namespaced_config_map, "greeter-hello", namespace) is None, 30,
             "helm uninstall to delete ConfigMap greeter-hello")
    assert json.loads(helm("list", "--namespace", namespace, "-o", "json").stdout) == []


def test_rbac_forbids_until_bound(kube_api, core_v1, kubectl, namespace):
    core_v1.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    user = f"--as=system:serviceaccount:{namespace}:reader"

    def can_list_pods() -> str:
        return kubectl("auth", "can-i", "list", "pods", "-n", namespace, user, check=False).stdout.strip()

    assert can_list_pods() == "no"
    denied = kubectl("get", "pods", "-n", namespace, user, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr

    rbac = client.RbacAuthorizationV1Api(kube_api)
    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    })
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "reader-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
    })
    # the authorizer reads roles from an informer cache: allow it a moment
    wait_for(lambda: can_list_pods() == "yes", 10, "the RoleBinding to let reader list pods")
    kubectl("get", "pods", "-n", namespace, user)
    assert kubectl("auth", "can-i", "delete", "pods", "-n", namespace, user, check=False).stdout.strip() == "no"


def test_s3_round_trip(control_plane):
    s3 = boto3.client(
        "s3",
        endpoint_url=control_plane.s3_endpoint,
        aws_access_key_id=control_plane.s3_access_key,
        aws_secret_access_key=control_plane.s3_secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=30,
                      retries={"max_attempts": 2}),
    )
    bucket = f"e2e-{secrets.token_hex(4)}"
    key = "ckpt/step-000100/shard-0.bin"
    payload = os.urandom(3 * 1024 * 1024 + 17)  # not a multiple of any chunk size
    s3.create_bucket(Bucket=bucket)
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=payload)
        assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == payload
        listed = s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/")
        assert [(o["Key"], o["Size"]) for o in listed.get("Contents", [])] == [(key, len(payload))]
    finally:
        for obj in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=obj["Key"])
        s3.delete_bucket(Bucket=bucket)


@pytest.fixture
def lost_node(control_plane, core_v1):
    """The last kwok node, handed back to kwok (and Ready) after the test."""
    node = control_plane.nodes[-1]
    original = core_v1.read_node(node).metadata.annotations["kwok.x-k8s.io/node"]
    yield node
    restore_kwok_node(core_v1, node, original)


def test_node_made_not_ready_reads_back_not_ready(core_v1, lost_node):
    make_node_not_ready(core_v1, lost_node)

    def ready_status():
        cond = node_condition(core_v1.read_node(lost_node), "Ready")
        return cond and (cond.status, cond.reason)

    assert ready_status() == ("False", "KubeletNotReady")
    node = core_v1.read_node(lost_node)
    assert "kwok.x-k8s.io/node" not in (node.metadata.annotations or {})
    # kube-controller-manager's node lifecycle controller acts on it like on a real lost node
    wait_for(lambda: any(t.key == "node.kubernetes.io/not-ready"
                         for t in core_v1.read_node(lost_node).spec.taints or []),
             60, f"the node lifecycle controller to taint {lost_node} not-ready")
    assert ready_status()[0] in ("False", "Unknown")  # Unknown once its lease expires


def test_a_second_session_waits_for_the_first_and_is_told_why(tmp_path, monkeypatch):
    """Two `make test` on one machine: the second does not start its own environment over
    the first's; it waits for the lock and, past its timeout, says what holds it."""
    from testenv import cluster

    monkeypatch.setenv("TRANSOM_TESTENV_STATE", str(tmp_path / "run"))
    with cluster.session_lock(5):
        with pytest.raises(RuntimeError, match="another test session"):
            with cluster.session_lock(1.5):
                pass
    with cluster.session_lock(1.5):  # released by the first: taken at once
        pass
