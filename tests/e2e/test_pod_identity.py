"""A worker pod's own token speaks for its replica only, checked by a real API server.

The objects are the operator's own (resources.py: the worker and coordinator ServiceAccounts,
the coordinator's Role and token review binding, worker and spare pods with their projected
identity volume) and the chart's token reviewer ClusterRole (`helm template`); tokens come from
the API server's TokenRequest, bound to each pod and to the job's audience, as the kubelet
would mount them. The real `transom coordinator --worker-service-account` then accepts a
replica's call only with that replica's pod token, follows a spare's relabel, and refuses
tokens of another audience or account (issue 28, finding 3, on Kubernetes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kube_helpers import wait_for
from transom import contract
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.models import HeartbeatRequest, Identity, RegisterRequest
from transom.errors import CoordinatorError, Forbidden
from transom.launch.supervisor import free_port
from transom_operator import api, resources

ROOT = Path(__file__).resolve().parents[2]
REVIEWER = "transom-operator-token-reviewer"
pytestmark = pytest.mark.timeout(240)


def _reviewer_role(helm, name: str) -> dict:
    """The chart's token reviewer ClusterRole, as `helm install` would create it, under `name`
    (a cluster-wide name of this test's own: other tests install the chart itself)."""
    out = helm("template", "transom", str(ROOT / "charts" / "transom"), "--show-only", "templates/rbac.yaml").stdout
    (role,) = [d for d in yaml.safe_load_all(out) if d and d["metadata"]["name"] == REVIEWER]
    role["metadata"]["name"] = name
    return role


def _register(client: CoordinatorClient, replica: int, generation: int = 0) -> None:
    client.register(RegisterRequest(identity=Identity(replica_id=replica, generation=generation, attempt=0),
                                    store_addr="10.0.0.1:1", state_endpoints=["http://10.0.0.1:2"]))


def _create_job(kubectl, helm, namespace: str) -> tuple[dict[str, dict], dict, str]:
    """The example job, its service accounts and RBAC as the operator makes them, and three of
    its pods (replicas 0 and 1, a spare), created by hand: the pods' manifests by name, the
    token-review binding and the reviewer role's name (to delete at the end)."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "trainingjobs.transom.io.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.transom.io", "--timeout=60s", timeout_s=90)
    manifest = yaml.safe_load((ROOT / "examples" / "trainingjob.yaml").read_text())
    manifest["metadata"]["namespace"] = namespace
    kubectl("create", "-f", "-", input=json.dumps(manifest))
    job = api.TrainingJob.model_validate(json.loads(kubectl("get", "tj", "tiny-gpt", "-n", namespace, "-o",
                                                            "json").stdout))
    reviewer = f"{REVIEWER}-{namespace}"
    kubectl("apply", "-f", "-", input=json.dumps(_reviewer_role(helm, reviewer)))
    binding = resources.token_review_binding(job, reviewer)
    kubectl("create", "-f", "-", input=json.dumps(binding))
    pods = {"r0": resources.worker_pod(job, 0, 0, 0), "r1": resources.worker_pod(job, 1, 0, 0),
            "spare": resources.spare_pod(job, 0, 0, 0)}
    for m in (resources.worker_service_account(job), resources.coordinator_service_account(job),
              resources.coordinator_role(job), resources.coordinator_role_binding(job), *pods.values()):
        kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(m))
    return pods, binding, reviewer


def _assert_only_the_coordinator_reviews_tokens(kubectl, namespace: str) -> None:
    coordinator_sa = f"system:serviceaccount:{namespace}:tiny-gpt-coordinator"

    def can(*a: str) -> str:
        return kubectl("auth", "can-i", *a, "--as", coordinator_sa, check=False).stdout.strip()

    assert can("create", "tokenreviews.authentication.k8s.io") == "yes"
    assert can("get", "pods", "-n", namespace) == "yes" and can("list", "pods", "-n", namespace) == "no"
    worker_sa = f"system:serviceaccount:{namespace}:tiny-gpt-worker"
    assert kubectl("auth", "can-i", "create", "tokenreviews.authentication.k8s.io", "--as", worker_sa,
                   check=False).stdout.strip() == "no"


def _start_coordinator(control_plane, namespace: str, token_file: Path, port: int) -> subprocess.Popen:
    """`transom coordinator` for the job, checking pods' tokens with the API server."""
    admin = yaml.safe_load(control_plane.kubeconfig.read_text())
    cluster = admin["clusters"][0]["cluster"]
    return subprocess.Popen(
        [sys.executable, "-m", "transom", "coordinator", "--host", "127.0.0.1", "--port", str(port),
         "--job", "tiny-gpt", "--replicas", "3", "--namespace", namespace, "--worker-service-account",
         "tiny-gpt-worker", "--kube-api", cluster["server"], "--kube-token-file", str(token_file),
         "--kube-ca-file", cluster["certificate-authority"]],
        env={**os.environ, contract.ENV_COORDINATOR_TOKEN: "job-token"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_pods_token_speaks_for_its_own_replica_and_follows_a_spares_promotion(kubectl, helm, namespace,
                                                                                 control_plane, tmp_path):
    pods, binding, reviewer = _create_job(kubectl, helm, namespace)
    _assert_only_the_coordinator_reviews_tokens(kubectl, namespace)

    audience = contract.identity_audience(namespace, "tiny-gpt")

    def token(pod: str, aud: str | None = audience, account: str = "tiny-gpt-worker") -> str:
        args = ["create", "token", account, "-n", namespace, "--duration=1h"]
        args += ["--bound-object-kind", "Pod", "--bound-object-name", pods[pod]["metadata"]["name"]] if pod else []
        return kubectl(*args, *(["--audience", aud] if aud else [])).stdout.strip()

    coordinator_token = tmp_path / "coordinator-token"
    coordinator_token.write_text(token("", None, "tiny-gpt-coordinator"))
    port = free_port()
    proc = _start_coordinator(control_plane, namespace, coordinator_token, port)
    url = f"http://127.0.0.1:{port}"

    def as_pod(t: str) -> CoordinatorClient:
        return CoordinatorClient(url, t, timeout_s=20)

    try:
        as_pod("job-token").progress()  # retried while the coordinator starts (the client's timeout)
        r0, r1 = as_pod(token("r0")), as_pod(token("r1"))
        _register(r0, 0)
        _register(r1, 1)
        with pytest.raises(Forbidden):
            _register(r1, 0)  # replica 1's pod cannot speak for replica 0 ...
        with pytest.raises(Forbidden):
            r1.heartbeat(HeartbeatRequest(identity=Identity(replica_id=0, generation=0, attempt=0), step=0))
        with pytest.raises(Forbidden):
            _register(r0, 0, generation=1)  # ... nor for a generation the operator did not give it
        with pytest.raises(Forbidden):
            r0.status()  # every replica's incarnation: the job token's only
        for wrong in (token("r0", aud=None),  # the API server's audience: not this coordinator's
                      token("r0", aud=contract.identity_audience(namespace, "another-job")),
                      token("", account="tiny-gpt-coordinator")):  # right audience, wrong account, no pod
            with pytest.raises(CoordinatorError) as e:
                _register(as_pod(wrong), 0)
            assert e.value.status == 401
        # A spare's token names no replica until the operator relabels its pod; then it does.
        spare = as_pod(token("spare"))
        with pytest.raises(Forbidden):
            _register(spare, 2, generation=1)
        name = pods["spare"]["metadata"]["name"]
        labels = resources.promotion_labels(2, 1)
        kubectl("label", "pod", name, "-n", namespace, "--overwrite",
                *(f"{k}={v}" for k, v in labels.items() if v is not None),
                *(f"{k}-" for k, v in labels.items() if v is None))
        wait_for(lambda: _ok(lambda: _register(spare, 2, generation=1)), 10, "the promoted spare to be replica 2")
        assert {r.replica_id for r in as_pod("job-token").status().replicas} == {0, 1, 2}
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
        kubectl("delete", "clusterrolebinding", binding["metadata"]["name"], "--ignore-not-found", check=False)
        kubectl("delete", "clusterrole", reviewer, "--ignore-not-found", check=False)
    assert "Traceback" not in out, out[-3000:]


def _ok(call) -> bool:
    try:
        call()
        return True
    except Forbidden:
        return False
