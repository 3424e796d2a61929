"""TrainingJobs admitted through a real Kueue (v0.17, built from its Go module and run in the
test environment: docs/testenv.md) on real kubelets: a job within quota is admitted whole and
placed by its flavor; a second one waits Queued, with Kueue's reason, until the first ends;
a replica replaced after its pod was deleted keeps the job's admission (nothing goes back to
the queue); a deleted job leaves no Workload behind.

The operator is installed with the chart (`kueue.enabled=true`); the jobs are
examples/trainingjob-cpu.yaml with fewer steps and no checkpoint, with the test image.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from e2e_demo import CHART, EXAMPLE, OPERATOR_NAMESPACE, use_test_image
from kube_helpers import holds_for, wait_for
from testenv import realnodes
from transom import contract
from transom_operator import reasons
from transom_operator.reconcile import admission

pytestmark = [pytest.mark.slow, pytest.mark.real_nodes, pytest.mark.timeout(900)]
FLAVOR_LABELS = {"transom.io/testenv-node": "real"}  # the flavor's nodes: the real ones
# One job is 3 pods x (250m CPU, 1Gi): the queue holds one job, not two.
QUOTA = {"cpu": "1", "memory": "4Gi", "ephemeral-storage": "10Gi"}


def _queues(namespace: str) -> list[dict]:
    name = f"transom-e2e-{namespace[-8:]}"  # the namespace's own hash: a name no other run uses
    quota = [{"name": r, "nominalQuota": q} for r, q in sorted(QUOTA.items())]
    return [
        {"apiVersion": admission.API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": name},
         "spec": {"nodeLabels": FLAVOR_LABELS}},
        {"apiVersion": admission.API_VERSION, "kind": "ClusterQueue", "metadata": {"name": name},
         "spec": {"namespaceSelector": {}, "resourceGroups": [{
             "coveredResources": sorted(QUOTA),
             "flavors": [{"name": name, "resources": quota}],
         }]}},
        {"apiVersion": admission.API_VERSION, "kind": "LocalQueue",
         "metadata": {"name": "team", "namespace": namespace}, "spec": {"clusterQueue": name}},
    ]


def _job(example: dict, name: str, steps: int) -> dict:
    job = copy.deepcopy(example)
    job["metadata"] = {"name": name, "labels": {admission.QUEUE_LABEL: "team"}}
    job["spec"].pop("checkpoint")
    job["spec"]["template"]["spec"]["containers"][0]["command"][-1] = str(steps)
    return job


class Cluster:
    def __init__(self, kube, namespace: str):
        self.kube, self.ns = kube, namespace

    def get(self, *args: str) -> dict:
        return json.loads(self.kube.kubectl("get", *args, "-o", "json").stdout)

    def status(self, job: str) -> dict:
        return self.get("tj", job, "-n", self.ns).get("status") or {}

    def condition(self, job: str, type_: str) -> dict:
        return next((c for c in self.status(job).get("conditions") or [] if c["type"] == type_), {})

    def pods(self, job: str) -> list[dict]:
        return [p for p in self.get("pods", "-n", self.ns, "-l", f"{contract.LABEL_JOB}={job},{contract.LABEL_REPLICA}")
                ["items"] if not p["metadata"].get("deletionTimestamp")]

    def workload(self, job: str) -> dict:
        [wl] = self.get("workloads.kueue.x-k8s.io", "-n", self.ns, "-l", f"{contract.LABEL_JOB}={job}")["items"]
        return wl

    def events(self, job: str) -> list[str]:
        items = self.get("events", "-n", self.ns, "--field-selector", f"involvedObject.name={job}")["items"]
        return [e["reason"] for e in items]


def _wl_condition(wl: dict, type_: str) -> dict:
    return next((c for c in (wl.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def _wait_workload_finished(c: Cluster, job: str) -> None:
    """Kueue marks the Workload Finished on its own reconcile, after the job's status says so."""
    wait_for(lambda: _wl_condition(c.workload(job), "Finished").get("status") == "True", 60,
             f"{job}'s Workload Finished")


def _replace_a_replica(c: Cluster, job: str) -> None:
    """Delete replica 1's pod once the job trains; wait until its replacement runs."""
    wait_for(lambda: ((c.status(job).get("training") or {}).get("step") or 0) >= 10, 240, f"{job} at step 10")
    [victim] = [p for p in c.pods(job) if p["metadata"]["labels"][contract.LABEL_REPLICA] == "1"]
    c.kube.kubectl("delete", "pod", victim["metadata"]["name"], "-n", c.ns, "--wait=false")
    wait_for(lambda: [p for p in c.pods(job) if p["metadata"]["labels"][contract.LABEL_REPLICA] == "1"
                      and p["metadata"]["name"] != victim["metadata"]["name"]
                      and p["status"].get("phase") == "Running"], 120, "replica 1 replaced and Running")


def test_kueue_admits_whole_jobs_within_quota_and_a_replacement_keeps_the_admission(control_plane, kube, namespace):
    if len(control_plane.real_nodes) < 2:
        pytest.fail("this test needs the test environment's real nodes (`hack/testenv.sh up --real-nodes 3`)",
                    pytrace=False)
    c = Cluster(kube, namespace)
    queues = _queues(namespace)
    # Staged once: staging again replaces the files the running job's pods import from.
    example = use_test_image(yaml.safe_load(EXAMPLE.read_text()))
    realnodes.load_images(control_plane.state_dir, len(control_plane.real_nodes))
    kube.helm("upgrade", "--install", "transom", str(CHART), "-n", OPERATOR_NAMESPACE, "--create-namespace",
              "--set", "replicaCount=1", "--set", "kueue.enabled=true", timeout_s=120)
    try:
        kube.kubectl("rollout", "status", "deployment/transom-operator", "-n", OPERATOR_NAMESPACE,
                     "--timeout=120s", timeout_s=130)
        kube.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": queues}))
        kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_job(example, "first", 150)))
        wait_for(lambda: c.condition("first", "Admitted").get("status") == "True"
                 and c.status("first").get("healthyReplicas") == 3, 240, "the first job admitted and running")
        wl = c.workload("first")
        assert [(s["name"], s["count"]) for s in wl["spec"]["podSets"]] == [("worker", 3)]
        for pod in c.pods("first"):  # placed by the admission's flavor
            assert pod["spec"]["nodeSelector"].items() >= FLAVOR_LABELS.items(), pod["spec"]
            assert pod["metadata"]["labels"][admission.PODSET_LABEL] == "worker"

        kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_job(example, "second", 20)))
        wait_for(lambda: c.status("second").get("state") == "Queued", 60, "the second job Queued")
        # Queued from the moment its Workload exists ("Kueue has not considered the Workload
        # yet"); Kueue's own reason follows once it has tried to admit it (CI saw the first).
        wait_for(lambda: "insufficient unused quota" in c.condition("second", "Admitted").get("message", ""),
                 60, "the second job waiting for quota, in Kueue's words")
        waiting = c.condition("second", "Admitted")
        assert waiting["status"] == "False", waiting
        assert c.condition("second", "Ready")["reason"] == reasons.QUEUED and not c.pods("second")

        reserved = _wl_condition(wl, "QuotaReserved")
        _replace_a_replica(c, "first")
        after = c.workload("first")
        assert after["metadata"]["uid"] == wl["metadata"]["uid"]
        assert _wl_condition(after, "QuotaReserved") == reserved  # held throughout, never given back
        assert _wl_condition(after, "Evicted").get("status") != "True"
        assert after["status"]["admission"] == wl["status"]["admission"]
        replicas = c.status("first")["replicas"]
        assert [r["generation"] for r in replicas] == [0, 1, 0], (replicas, c.events("first"))
        holds_for(lambda: not c.pods("second") and c.status("second")["state"] == "Queued", 3,
                  "the second job still queued while the first recovers")

        wait_for(lambda: c.status("first").get("state") == "Succeeded", 420, "the first job Succeeded")
        _wait_workload_finished(c, "first")
        wait_for(lambda: c.status("second").get("state") == "Succeeded", 420, "the second job admitted and Succeeded")
        assert {reasons.EVENT_JOB_QUEUED, reasons.EVENT_JOB_ADMITTED} <= set(c.events("second"))
    finally:
        kube.kubectl("delete", "tj", "--all", "-n", namespace, "--timeout=60s", check=False, timeout_s=70)
        kube.helm("uninstall", "transom", "-n", OPERATOR_NAMESPACE, "--wait", "--timeout=90s", check=False,
                  timeout_s=100)
        # The jobs' Workloads go with them (garbage collection), and the queues with the test.
        try:
            wait_for(lambda: not c.get("workloads.kueue.x-k8s.io", "-n", namespace)["items"], 60, "no Workload left")
        finally:
            kube.kubectl("delete", "-f", "-", "--wait=true", "--timeout=60s", check=False, timeout_s=70,
                         input=json.dumps({"apiVersion": "v1", "kind": "List", "items": queues[::-1]}))
