"""The coordinator writes status.training with its per-job Role, and nothing else.

The job's ServiceAccount, Role and RoleBinding are the operator's own manifests
(resources.py); the real `transom coordinator` runs with a token of that ServiceAccount and
`--kube-api` pointing at the test API server, a replica reports step 42 and a checkpoint of
step 40 through the real HTTP API, and both (with a goodput) must appear in the job's
status; the step in `kubectl get tj`. The same token must not be able to
touch the rest of the job or other jobs.
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
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.models import CheckpointReport, Identity, QuorumRequest, RegisterRequest
from transom.launch.supervisor import free_port
from transom_operator import api, resources

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def test_coordinator_reports_the_committed_step_into_status_training(kubectl, namespace, control_plane, tmp_path):
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "trainingjobs.transom.io.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.transom.io", "--timeout=60s", timeout_s=90)
    manifest = yaml.safe_load((ROOT / "examples" / "trainingjob.yaml").read_text())
    manifest["metadata"]["namespace"] = namespace
    kubectl("create", "-f", "-", input=json.dumps(manifest))
    raw = json.loads(kubectl("get", "tj", "tiny-gpt", "-n", namespace, "-o", "json").stdout)
    job = api.TrainingJob.model_validate(raw)
    for m in (resources.coordinator_service_account(job), resources.coordinator_role(job),
              resources.coordinator_role_binding(job)):
        kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(m))

    sa = f"system:serviceaccount:{namespace}:tiny-gpt-coordinator"
    can = lambda *a: kubectl("auth", "can-i", *a, "-n", namespace, "--as", sa, check=False).stdout.strip()  # noqa: E731
    assert can("patch", "trainingjobs.transom.io/tiny-gpt", "--subresource=status") == "yes"
    assert can("patch", "trainingjobs.transom.io/other-job", "--subresource=status") == "no"
    assert can("patch", "trainingjobs.transom.io/tiny-gpt") == "no"  # spec is the user's
    assert can("get", "secrets") == "no"

    token_file = tmp_path / "sa-token"
    token_file.write_text(kubectl("create", "token", "tiny-gpt-coordinator", "-n", namespace).stdout.strip())
    admin = yaml.safe_load(control_plane.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]["server"]
    ca = admin["clusters"][0]["cluster"]["certificate-authority"]
    port, token = free_port(), "job-token"
    proc = subprocess.Popen(
        [sys.executable, "-m", "transom", "coordinator", "--host", "127.0.0.1", "--port", str(port),
         "--job", "tiny-gpt", "--replicas", "1", "--namespace", namespace, "--status-interval", "0.2",
         "--kube-api", server, "--kube-token-file", str(token_file), "--kube-ca-file", ca],
        env={**os.environ, "TRANSOM_COORDINATOR_TOKEN": token},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        client = CoordinatorClient(f"http://127.0.0.1:{port}", token, timeout_s=30)
        me = Identity(replica_id=0, generation=0, attempt=0)
        client.register(RegisterRequest(identity=me, store_addr="127.0.0.1:1", state_endpoints=["http://x"],
                                        step=41))  # restored from a checkpoint of step 41
        first = client.quorum(QuorumRequest(identity=me, step=41, commit_quorum_id=-1, last_round=-1), timeout_s=30)
        client.quorum(QuorumRequest(identity=me, step=42, commit_quorum_id=first.quorum_id, last_round=first.round),
                      timeout_s=30)
        assert client.report_checkpoint(CheckpointReport(identity=me, step=40, uri="s3://b/tiny-gpt/step-40"))

        def step():
            st = json.loads(kubectl("get", "tj", "tiny-gpt", "-n", namespace, "-o", "json").stdout).get("status", {})
            training = st.get("training", {})
            return training if training.get("step") == 42 and training.get("lastCheckpoint") == 40 else None

        training = wait_for(step, 30, "status.training with step 42 and lastCheckpoint 40")
        # One productive interval (step 41 -> 42) and nothing lost yet: a goodput above 0.
        assert 0 < float(training["goodput"]) <= 1 and training["lastCheckpointTime"].endswith("Z")
        row = kubectl("get", "tj", "tiny-gpt", "-n", namespace).stdout.splitlines()[1]
        assert "42" in row.split()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert "could not write status" not in out, out[-2000:]
