"""kube.py against an API server that accepts connections and never answers: every request
ends with its timeout instead of holding a pass's thread forever, and where the operator's
writes go (the paths it knows without discovery)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kubernetes import client

from transom_operator import kube as kube_module
from transom_operator.kube import Kube

TIMEOUT = (1.0, 0.3)  # (connect, read) seconds


@pytest.fixture
def silent_server():
    """A loopback listener that reads requests and never writes a byte back."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop, accepted = threading.Event(), []

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(conn)  # kept open, never answered

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    stop.set()
    thread.join(timeout=5)
    for conn in accepted:
        conn.close()
    listener.close()


@pytest.fixture
def kube(silent_server):
    host, _ = silent_server
    config = client.Configuration(host=host)
    config.retries = False  # one attempt per request: the figure below is the timeout itself
    api = client.ApiClient(config)
    yield Kube(api, timeout=TIMEOUT)
    api.close()


POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}
CALLS = {
    "get_job": lambda k: k.get_job("ml", "demo"),
    "list_pods": lambda k: k.list_pods("ml", "demo"),
    "list_nodes": lambda k: k.list_nodes(),
    "create": lambda k: k.create("ml", POD),
    "delete_pod": lambda k: k.delete_pod("ml", "p"),
    "patch_pod_labels": lambda k: k.patch_pod_labels("ml", "p", {"a": "b"}),
    "patch_job_status": lambda k: k.patch_job_status("ml", "demo", [{"op": "add", "path": "/status", "value": {}}]),
    "exclude_node": lambda k: k.exclude_node("n1", "Cordon", "test"),
    "get_disruption_budget": lambda k: k.get_disruption_budget("ml", "demo-workers"),
    "patch_disruption_budget": lambda k: k.patch_disruption_budget("ml", "demo-workers", {"spec": {"minAvailable": 1}}),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_request_the_server_never_answers_ends_with_its_timeout(kube, silent_server, call):
    t0 = time.monotonic()
    with pytest.raises(Exception, match="(?i)timed out|timeout"):
        CALLS[call](kube)
    elapsed = time.monotonic() - t0
    assert silent_server[1], "the request never reached the server"
    assert TIMEOUT[1] * 0.9 <= elapsed < 5.0, f"{call} took {elapsed:.2f}s with a {TIMEOUT[1]}s read timeout"


def test_the_default_timeout_is_the_modules_own():
    assert Kube.__init__.__defaults__ == (kube_module.REQUEST_TIMEOUT_S,)
    connect, read = kube_module.REQUEST_TIMEOUT_S
    assert 0 < connect <= read


@pytest.mark.parametrize("args, path", [
    (("v1", "Pod", "ml"), "/api/v1/namespaces/ml/pods"),
    (("v1", "Node", None, "n1"), "/api/v1/nodes/n1"),
    (("apps/v1", "Deployment", "ml", "c"), "/apis/apps/v1/namespaces/ml/deployments/c"),
    (("transom.io/v1alpha1", "TrainingJob", "ml", "demo", "status"),
     "/apis/transom.io/v1alpha1/namespaces/ml/trainingjobs/demo/status"),
    (("networking.k8s.io/v1", "NetworkPolicy", "ml"), "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies"),
    (("policy/v1", "PodDisruptionBudget", "ml", "demo-workers"),
     "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/demo-workers"),
])
def test_paths_of_the_kinds_the_operator_writes(args, path):
    assert kube_module._path(*args) == path


def test_a_kind_without_a_known_path_is_refused_by_name():
    with pytest.raises(ValueError, match="ConfigMap"):
        kube_module._path("v1", "ConfigMap", "ml")
