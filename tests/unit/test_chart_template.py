"""The chart as `helm template` renders it (no cluster): the operator's permissions cover every
object it creates for a job, and no more on disruption budgets; two operators by default, on
different nodes where there is room, with a budget that keeps one through a drain.

tests/e2e/test_chart.py installs the chart and runs the operator with its ServiceAccount.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reconcile_world import make_job
from transom_operator import disruption, kube, resources

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))
from testenv import build  # noqa: E402
from testenv.tools import render_chart  # noqa: E402


def render(*args: str) -> list[dict]:
    try:
        return render_chart(*args)
    except build.MissingTool as e:
        pytest.fail(str(e), pytrace=False)


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def granted(rules: list[dict], group: str, resource: str) -> set[str]:
    return {verb for r in rules if group in r["apiGroups"] and resource in r["resources"]
            and not r.get("resourceNames") for verb in r["verbs"]}


def namespaced_rules(docs: list[dict], scope: str) -> list[dict]:
    """The rules that cover a job's namespace: the ClusterRole's, or the watched namespace's Role."""
    if scope == "cluster":
        (role,) = [d for d in of_kind(docs, "ClusterRole") if d["metadata"]["name"] == "transom-operator"]
    else:
        (role,) = [d for d in of_kind(docs, "Role") if d["metadata"]["name"] == "transom-operator"]
    return role["rules"]


SCOPES = {"cluster": (), "namespace": ("--set", "watchNamespaces={ml}")}


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_the_operator_may_create_every_object_it_makes_for_a_job(scope):
    rules = namespaced_rules(render(*SCOPES[scope]), scope)
    job = make_job(spareReplicas=1)
    made = [*resources.coordinator_resources(job, "t", "transom:1"), resources.network_policy(job),
            disruption.worker_budget(job), resources.worker_pod(job, 0, 0, 0)]
    for manifest in made:
        version = manifest["apiVersion"]
        group = version.rpartition("/")[0] if "/" in version else ""
        assert "create" in granted(rules, group, kube._PLURALS[manifest["kind"]]), manifest["kind"]


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_disruption_budgets_are_read_created_and_resized_never_listed_or_deleted(scope):
    rules = namespaced_rules(render(*SCOPES[scope]), scope)
    assert granted(rules, "policy", "poddisruptionbudgets") == {"get", "create", "patch"}
    assert granted(rules, "policy", "pods/eviction") == set()  # the operator deletes; it never evicts


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_kueue_workloads_only_when_kueue_is_enabled(scope):
    off = render(*SCOPES[scope])
    on = render(*SCOPES[scope], "--set", "kueue.enabled=true")
    assert granted(namespaced_rules(off, scope), "kueue.x-k8s.io", "workloads") == set()
    assert granted(namespaced_rules(on, scope), "kueue.x-k8s.io", "workloads") == {
        "get", "create", "patch", "delete"}
    assert granted(namespaced_rules(on, scope), "kueue.x-k8s.io", "workloads/status") == {"patch"}
    (cluster_role,) = [d for d in of_kind(on, "ClusterRole") if d["metadata"]["name"] == "transom-operator"]
    assert granted(cluster_role["rules"], "kueue.x-k8s.io", "resourceflavors") == {"get"}


def test_two_operators_by_default_on_different_nodes_where_there_is_room_and_one_kept_through_a_drain():
    docs = render()
    (deployment,) = of_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (term,) = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == pod_labels
    (budget,) = of_kind(docs, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1 and budget["spec"]["selector"]["matchLabels"] == pod_labels
    assert budget["metadata"]["namespace"] == "transom-system"


def test_one_operator_gets_no_budget_that_would_block_its_nodes_drain_and_an_affinity_of_ones_own_wins():
    docs = render("--set", "replicaCount=1")
    assert of_kind(docs, "PodDisruptionBudget") == []
    assert "affinity" not in of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}}
    docs = render("--set-json", f"affinity={json.dumps(own)}")
    assert of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["affinity"] == own
