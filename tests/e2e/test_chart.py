"""The helm chart: lint-clean, installs, and its RBAC is enough for the operator.

`helm install` puts the CRD, ServiceAccount, ClusterRole and the rest in place; then the
operator runs from source with a token of the chart's ServiceAccount (not the admin
certificate), so any permission the chart forgot makes this test fail.
"""

from __future__ import annotations

import json

import pytest
import yaml

from pathlib import Path
from kube_helpers import wait_for
from test_operator import EXAMPLE, Operator, _wait_running, delete_jobs

_ROOT = Path(__file__).resolve().parents[2]
CHART = _ROOT / "charts" / "transom"
pytestmark = pytest.mark.timeout(240)


def test_chart_lints_clean(helm):
    out = helm("lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in out.stdout


def test_operator_with_the_charts_service_account_runs_a_job(helm, kubectl, namespace, control_plane, tmp_path):
    helm("install", "transom", str(CHART), "-n", namespace, timeout_s=120)
    try:
        deployment = json.loads(kubectl("get", "deployment", "transom-operator", "-n", namespace, "-o", "json").stdout)
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
        # Least privilege: the operator may create Secrets but never read them.
        can_read = kubectl("auth", "can-i", "get", "secrets", "-A",
                           f"--as=system:serviceaccount:{namespace}:transom-operator", check=False)
        assert can_read.stdout.strip() == "no"

        token = kubectl("create", "token", "transom-operator", "-n", namespace, "--duration=1h").stdout.strip()
        admin = yaml.safe_load(control_plane.kubeconfig.read_text())
        cluster = admin["clusters"][0]["cluster"]
        kubeconfig = tmp_path / "operator.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": cluster}],
            "users": [{"name": "transom-operator", "user": {"token": token}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "transom-operator"}}],
            "current-context": "c",
        }))
        op = Operator(kubeconfig, namespace, tmp_path / "operator.log")
        try:
            kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
            _wait_running(kubectl, namespace)
            wait_for(lambda: kubectl("get", "deployment", "tiny-gpt-coordinator", "-n", namespace, check=False)
                     .returncode == 0, 30, "coordinator deployment")
        finally:
            delete_jobs(kubectl, namespace)
            op.stop()
        log = (tmp_path / "operator.log").read_text()
        assert "Forbidden" not in log and "forbidden" not in log, log[-3000:]
    finally:
        helm("uninstall", "transom", "-n", namespace, check=False, timeout_s=120)
