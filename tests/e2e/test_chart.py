"""The helm chart: lint-clean, installs, and its RBAC is enough for the operator.

`helm install` puts the CRD, ServiceAccount, ClusterRole and the rest in place; then the
operator runs from source with a token of the chart's ServiceAccount (not the admin
certificate), so any permission the chart forgot makes this test fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kube_helpers import wait_for
from test_operator import EXAMPLE, Operator, _wait_running, delete_jobs

_ROOT = Path(__file__).resolve().parents[2]
CHART = _ROOT / "charts" / "transom"
pytestmark = pytest.mark.timeout(240)


def test_chart_lints_clean(helm):
    out = helm("lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_operator_with_the_charts_service_account_runs_a_job(helm, kubectl, namespace, control_plane, tmp_path,
                                                             scope):
    watch = ["--set", f"watchNamespaces={{{namespace}}}"] if scope == "namespace" else []
    # The test runs the operator itself (from source, as the chart's ServiceAccount): the
    # chart's own Deployment would start a second one on a real node.
    helm("install", "transom", str(CHART), "-n", namespace, *watch, "--set", "replicaCount=0", timeout_s=120)
    sa = f"system:serviceaccount:{namespace}:transom-operator"
    can = lambda *a: kubectl("auth", "can-i", *a, f"--as={sa}", check=False).stdout.strip()  # noqa: E731
    try:
        deployment = json.loads(kubectl("get", "deployment", "transom-operator", "-n", namespace, "-o", "json").stdout)
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
        # Least privilege: the operator may create Secrets but never read them, and it may not
        # change nodes unless the admin allowed Taint or Cordon.
        assert can("get", "secrets", "-A") == "no"
        assert can("patch", "nodes") == "no" and can("list", "nodes") == "yes"
        assert can("create", "pods", "-n", namespace) == "yes"
        assert can("create", "pods", "-n", "default") == ("yes" if scope == "cluster" else "no")

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
        # As the chart runs it: --namespace for each watched namespace.
        args = ("--namespace", namespace) if scope == "namespace" else ()
        op = Operator(kubeconfig, namespace, tmp_path / "operator.log", args)
        try:
            kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
            _wait_running(kubectl, namespace)
            wait_for(lambda: kubectl("get", "deployment", "tiny-gpt-coordinator", "-n", namespace, check=False)
                     .returncode == 0, 30, "coordinator deployment")
            assert kubectl("get", "networkpolicy", "tiny-gpt-isolation", "-n", namespace).returncode == 0
        finally:
            delete_jobs(kubectl, namespace)
            op.stop()
        log = (tmp_path / "operator.log").read_text()
        assert "Forbidden" not in log and "forbidden" not in log, log[-3000:]
    finally:
        helm("uninstall", "transom", "-n", namespace, check=False, timeout_s=120)


def test_a_user_with_the_edit_role_manages_jobs_but_not_their_status(helm, kubectl, namespace):
    # Status holds the operator's records (restart history, excluded nodes) and the
    # coordinator's verdicts: a job's user must not be able to forge them.
    helm("install", "transom", str(CHART), "-n", namespace, "--set", "replicaCount=0", timeout_s=120)
    try:
        kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice", "-n", namespace)
        can = lambda *a: kubectl("auth", "can-i", *a, "-n", namespace, "--as=alice", check=False).stdout.strip()  # noqa: E731
        wait_for(lambda: can("create", "trainingjobs.transom.io") == "yes", 30, "edit aggregates transom-edit")
        assert can("patch", "trainingjobs.transom.io") == "yes"
        assert can("patch", "trainingjobs.transom.io", "--subresource=status") == "no"
        assert can("update", "trainingjobs.transom.io", "--subresource=status") == "no"
    finally:
        helm("uninstall", "transom", "-n", namespace, check=False, timeout_s=120)
