"""One reconcile pass against an in-memory API (controller.py): a spec the operator cannot
use is reported on the job (Ready False, InvalidSpec, a Warning Event, once) instead of
raising on every pass, the workers' ServiceAccount exists before any worker pod, and a
promoted spare's relabel is in the cache before the next pass (not only once the watch says so),
and OOM kills (one restarted in place, the job they end) reach the operator's metrics."""

from __future__ import annotations

import copy
import json
from typing import Any, cast

import pytest

from test_resources import nested
from transom import contract
from transom_operator import api, controller, reasons, resources
from transom_operator.kube import Kube

TEMPLATE = {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}}


def raw_job(**spec_changes) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION, "kind": api.KIND,
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1", "generation": 1, "resourceVersion": "1"},
        "spec": {"replicas": 2, "template": copy.deepcopy(TEMPLATE), **spec_changes},
    }


def _copy(obj: Any) -> Any:
    """As the job comes from the API server: parsed JSON (deeper than copy.deepcopy goes)."""
    return json.loads(json.dumps(obj))


class MemoryKube:
    """The part of kube.Kube a pass uses, on dicts in memory; records every write."""

    def __init__(self, job: dict[str, Any], deployment: dict[str, Any] | None = None):
        self.job = job
        self.deployment = deployment
        self.created: list[tuple[str, str]] = []  # (kind, name) in order
        self.events: list[tuple[str, str, str]] = []
        self.status_writes = 0
        self.budgets: dict[str, dict[str, Any]] = {}  # PodDisruptionBudgets by name

    def get_job(self, namespace: str, name: str) -> dict | None:
        return _copy(self.job)

    def list_pods(self, namespace: str, job: str) -> tuple[list[dict], int]:
        return [], 1

    def list_nodes(self) -> tuple[list[dict], int]:
        return [], 1

    def get_deployment(self, namespace: str, name: str) -> dict | None:
        return self.deployment

    def create(self, namespace: str, manifest: dict) -> bool:
        self.created.append((manifest["kind"], manifest["metadata"]["name"]))
        if manifest["kind"] == "PodDisruptionBudget":
            self.budgets[manifest["metadata"]["name"]] = _copy(manifest)
        return True

    def set_tolerations(self, namespace: str, deployment: str, tolerations: list[dict]) -> None:
        self.created.append(("patched Deployment tolerations", deployment))
        assert self.deployment is not None
        self.deployment["spec"]["template"]["spec"]["tolerations"] = _copy(tolerations)

    def get_disruption_budget(self, namespace: str, name: str) -> dict | None:
        return _copy(self.budgets.get(name))

    def patch_disruption_budget(self, namespace: str, name: str, patch: dict) -> None:
        self.created.append(("patched PodDisruptionBudget", name))
        spec = self.budgets[name]["spec"]
        for key, value in patch["spec"].items():
            if value is None:
                spec.pop(key, None)
            else:
                spec[key] = value

    def patch_job_status(self, namespace: str, name: str, ops: list[dict]) -> dict:
        for op in ops:
            assert op["op"] in ("add", "replace", "test"), op
            if op["op"] == "test":
                continue
            path = op["path"].split("/")[1:]
            target = self.job
            for key in path[:-1]:
                target = target[int(key)] if isinstance(target, list) else target[key]
            last, value = path[-1], _copy(op["value"])
            if not isinstance(target, list):
                target[last] = value
            elif op["op"] == "add":
                target.insert(len(target) if last == "-" else int(last), value)
            else:
                target[int(last)] = value
        self.status_writes += 1
        meta = self.job["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        return _copy(self.job)

    def event(self, job: dict, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def list_cluster_role_bindings(self, selector: str) -> list[dict]:
        return []

    def delete_cluster_role_binding(self, name: str) -> None:
        self.created.append(("deleted ClusterRoleBinding", name))


@pytest.fixture
def make_controller():
    made = []

    def make(kube: MemoryKube) -> controller.Controller:
        made.append(controller.Controller(kube=cast(Kube, kube), coordinator_image="transom:1"))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("template, says", [
    # The API server stores it (it cannot bound the depth of a passthrough); copying it would
    # raise RecursionError in every pass.
    ({"spec": {"containers": [{"name": "t", "image": "t", "args": [nested(600)]}]}},
     "spec.template: template must not nest objects and lists more than 32 levels deep"),
    # Stored before the schema refused it (a CEL rule is not applied to objects already stored).
    ({"spec": {"containers": [{"name": "t", "image": "t"}], "serviceAccountName": "demo-coordinator"}},
     "template.spec.serviceAccountName must not be set"),
], ids=["nested-600-deep", "service-account-name"])
def test_a_spec_the_operator_cannot_use_is_reported_once_and_nothing_is_built(make_controller, template, says):
    kube = MemoryKube(raw_job(template=template))
    ctl = make_controller(kube)
    assert ctl.reconcile("ml", "demo") == controller.DEFAULT_REQUEUE_S  # no exception, no retry loop
    assert kube.created == []  # no coordinator, no ServiceAccount, no pod
    ((type_, reason, message),) = kube.events
    assert (type_, reason) == (reasons.WARNING, reasons.INVALID_SPEC) and says in message
    assert message.startswith("the operator cannot use this spec: ")
    status = kube.job["status"]
    (ready,) = status["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", reasons.INVALID_SPEC)
    assert says in ready["message"] and ready["observedGeneration"] == 1 == status["observedGeneration"]

    # The next passes have nothing new to say: no write, no Event.
    ctl.cache.drop_job("ml", "demo")  # read it afresh, as a resync would
    ctl.reconcile("ml", "demo")
    assert kube.status_writes == 1 and len(kube.events) == 1

    # A new spec that is still wrong is reported again, for its generation.
    kube.job["metadata"].update(generation=2, resourceVersion="9")
    ctl.cache.drop_job("ml", "demo")
    ctl.reconcile("ml", "demo")
    assert len(kube.events) == 2 and kube.job["status"]["conditions"][0]["observedGeneration"] == 2
    assert kube.job["status"]["conditions"][0]["lastTransitionTime"] == ready["lastTransitionTime"]


def test_a_fixed_spec_is_acted_on_again(make_controller):
    bad = raw_job(template={"metadata": {"labels": {"x": "y"}}, "spec": {
        "containers": [{"name": "t", "image": "t", "args": [nested(40)]}]}})
    kube = MemoryKube(bad)
    ctl = make_controller(kube)
    ctl.reconcile("ml", "demo")
    assert kube.created == [] and kube.job["status"]["conditions"][0]["reason"] == reasons.INVALID_SPEC
    kube.job["spec"] = raw_job()["spec"]
    kube.job["metadata"].update(generation=2, resourceVersion="9")
    ctl.cache.drop_job("ml", "demo")
    ctl.reconcile("ml", "demo")
    assert ("Deployment", "demo-coordinator") in kube.created and ("Pod", "demo-r0-n0-g0") in kube.created
    ready = next(c for c in kube.job["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] != reasons.INVALID_SPEC


def test_the_worker_service_account_is_created_before_any_worker_pod(make_controller):
    kube = MemoryKube(raw_job())
    make_controller(kube).reconcile("ml", "demo")
    first_pod = next(i for i, (kind, _) in enumerate(kube.created) if kind == "Pod")
    assert kube.created.index(("ServiceAccount", "demo-worker")) < first_pod


def test_a_job_from_before_the_worker_service_account_gets_one_once(make_controller):
    job = api.TrainingJob.model_validate(raw_job())
    deployment = resources.coordinator_deployment(job, "transom:1")  # its coordinator is there
    kube = MemoryKube(raw_job(), deployment=deployment)
    ctl = make_controller(kube)
    ctl.reconcile("ml", "demo")
    assert kube.created[:3] == [("ServiceAccount", "demo-worker"), ("Secret", "demo-peer-token"),
                                ("ClusterRoleBinding", "transom-ml-demo-token-review")]
    assert ("Deployment", "demo-coordinator") not in kube.created
    ctl.provisioner.checked.clear()  # the next check of the coordinator (30 s later)
    ctl.reconcile("ml", "demo")
    assert kube.created.count(("ServiceAccount", "demo-worker")) == 1


class SweptKube(MemoryKube):
    """Three token review bindings: of this job, of a job that is gone, of a namespace this
    operator may not read."""

    def list_cluster_role_bindings(self, selector: str) -> list[dict]:
        assert selector == "app.kubernetes.io/component=token-review"
        return [{"metadata": {"name": f"transom-{ns}-{job}-token-review",
                              "labels": {"transom.io/namespace": ns, "transom.io/job": job}}}
                for ns, job in (("ml", "demo"), ("ml", "gone"), ("other", "x"))]

    def get_job(self, namespace: str, name: str) -> dict | None:
        if namespace == "other":
            raise PermissionError("403")
        return super().get_job(namespace, name) if name == "demo" else None


def test_bindings_of_jobs_that_are_gone_are_swept_and_no_others(make_controller):
    kube = SweptKube(raw_job())
    ctl = make_controller(kube)
    ctl.reconcile("ml", "demo")
    assert [c for c in kube.created if c[0].startswith("deleted")] == [
        ("deleted ClusterRoleBinding", "transom-ml-gone-token-review")]
    ctl.reconcile("ml", "demo")  # not again before SWEEP_EVERY_S
    assert len([c for c in kube.created if c[0].startswith("deleted")]) == 1


class PodKube(MemoryKube):
    """MemoryKube with pods and nodes that a pass reads once (the watch never reports)."""

    def __init__(self, job: dict[str, Any], pods: list[dict], nodes: list[dict]):
        super().__init__(job, deployment={"spec": {"template": {"spec": {"containers": []}}}})
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.nodes = nodes
        self.deleted: list[str] = []

    def list_pods(self, namespace: str, job: str) -> tuple[list[dict], int]:
        return [_copy(p) for p in self.pods.values()], 10

    def list_nodes(self) -> tuple[list[dict], int]:
        return _copy(self.nodes), 10

    def create(self, namespace: str, manifest: dict) -> bool:
        super().create(namespace, manifest)
        if manifest["kind"] == "Pod":
            self.pods[manifest["metadata"]["name"]] = _copy(manifest)
        return True

    def delete_pod(self, namespace: str, name: str, force: bool = False) -> None:
        self.deleted.append(name)

    def patch_pod_labels(self, namespace: str, name: str, labels: dict[str, str | None]) -> dict | None:
        pod = self.pods[name]
        for key, value in labels.items():
            if value is None:
                pod["metadata"]["labels"].pop(key, None)
            else:
                pod["metadata"]["labels"][key] = value
        pod["metadata"]["resourceVersion"] = str(int(pod["metadata"]["resourceVersion"]) + 1)
        return _copy(pod)


def _running(manifest: dict, node: str, phase: str = "Running") -> dict:
    pod = _copy(manifest)
    pod["metadata"]["resourceVersion"] = "5"
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": phase}
    return pod


def test_a_promoted_spare_is_kept_by_the_next_pass_before_the_watch_reports_its_labels(make_controller):
    raw = raw_job(spareReplicas=1)
    job = api.TrainingJob.model_validate(raw)
    pods = [_running(resources.worker_pod(job, 0, 0, 0), "n0"),
            _running(resources.worker_pod(job, 1, 0, 0), "n1", phase="Failed"),
            _running(resources.spare_pod(job, 0, 0, 0), "n2")]
    nodes = [{"metadata": {"name": n, "resourceVersion": "1"},
              "status": {"conditions": [{"type": "Ready", "status": "True"}]}} for n in ("n0", "n1", "n2")]
    kube = PodKube(raw, pods, nodes)
    ctl = make_controller(kube)
    ctl.reconcile("ml", "demo")  # replica 1 failed: spare 0 takes over by its labels
    promoted = kube.pods["demo-s0-n0-g0"]["metadata"]["labels"]
    assert promoted[contract.LABEL_REPLICA] == "1" and promoted[contract.LABEL_GENERATION] == "1"
    ctl.reconcile("ml", "demo")  # at once: no watch event has told the cache about the relabel
    assert "demo-s0-n0-g0" not in kube.deleted
    assert not [name for kind, name in kube.created if name.startswith("demo-r1-")]
    replica = next(r for r in kube.job["status"]["replicas"] if r["id"] == 1)
    assert replica["generation"] == 1


def test_a_new_leader_finishes_a_replacement_its_predecessor_was_killed_in_without_doing_anything_twice(
        make_controller) -> None:
    """The leader wrote the status, created the new generation's pods, posted the Events and
    was killed in its deletes; another operator process (a fresh cache, nothing but the API
    server's state) takes over."""
    raw = raw_job(nodesPerReplica=2)
    job = api.TrainingJob.model_validate(raw)
    pods = [_running(resources.worker_pod(job, r, n, 0), f"n{2 * r + n}") for r in (0, 1) for n in (0, 1)]
    pods[2]["status"] = {"phase": "Failed", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}
    nodes = [{"metadata": {"name": f"n{i}", "resourceVersion": "1"},
              "status": {"conditions": [{"type": "Ready", "status": "True"}]}} for i in range(6)]
    kube = PodKube(raw, pods, nodes)

    def killed(namespace: str, name: str, force: bool = False) -> None:
        raise ConnectionError("the operator was killed")

    kube.delete_pod = killed  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        make_controller(kube).reconcile("ml", "demo")
    del kube.delete_pod  # the next process's deletes go through
    told = [reason for _, reason, _ in kube.events]
    assert told.count(reasons.EVENT_REPLICA_FAILED) == 1 and kube.job["status"]["totalRestarts"] == 1

    make_controller(kube).reconcile("ml", "demo")
    assert sorted(kube.deleted) == ["demo-r1-n0-g0", "demo-r1-n1-g0"]
    assert [name for kind, name in kube.created if kind == "Pod" and name.startswith("demo-r1-")] == [
        "demo-r1-n0-g1", "demo-r1-n1-g1"]  # each once
    assert [reason for _, reason, _ in kube.events] == told  # nothing told twice
    status = kube.job["status"]
    assert status["totalRestarts"] == 1 and [h["generation"] for h in status["restartHistory"]] == [0]


def test_every_job_gets_a_disruption_budget_before_its_pods_and_it_follows_the_jobs_size(make_controller):
    kube = MemoryKube(raw_job())
    ctl = make_controller(kube)
    ctl.reconcile("ml", "demo")
    first_pod = next(i for i, (kind, _) in enumerate(kube.created) if kind == "Pod")
    assert kube.created.index(("PodDisruptionBudget", "demo-workers")) < first_pod
    assert kube.budgets["demo-workers"]["spec"]["minAvailable"] == 1  # 2 replicas of one pod
    kube.job["spec"]["replicas"] = 4  # a scale-up: a new spec generation
    kube.job["metadata"].update(generation=2, resourceVersion="90")
    ctl.cache.drop_job("ml", "demo")
    ctl.reconcile("ml", "demo")
    assert ("patched PodDisruptionBudget", "demo-workers") in kube.created
    assert kube.budgets["demo-workers"]["spec"]["minAvailable"] == 3
    del kube.budgets["demo-workers"]  # deleted by hand: back at the next check
    ctl.provisioner.checked.clear()
    ctl.reconcile("ml", "demo")
    assert kube.created.count(("PodDisruptionBudget", "demo-workers")) == 2


def test_a_job_from_before_disruption_budgets_gets_one_without_a_new_coordinator(make_controller):
    job = api.TrainingJob.model_validate(raw_job())
    kube = MemoryKube(raw_job(), deployment=resources.coordinator_deployment(job, "transom:1"))
    make_controller(kube).reconcile("ml", "demo")
    assert ("PodDisruptionBudget", "demo-workers") in kube.created
    assert ("Deployment", "demo-coordinator") not in kube.created


def test_a_coordinator_from_before_its_node_loss_tolerations_gets_them_once_and_keeps_others(make_controller):
    job = api.TrainingJob.model_validate(raw_job())
    deployment = resources.coordinator_deployment(job, "transom:1")
    admins = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    stale = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 300}
    deployment["spec"]["template"]["spec"]["tolerations"] = [admins, stale]
    kube = MemoryKube(raw_job(), deployment=deployment)
    ctl = make_controller(kube)
    ctl.reconcile("ml", "demo")
    assert kube.deployment["spec"]["template"]["spec"]["tolerations"] == [admins, *resources.coordinator_tolerations()]
    ctl.provisioner.checked.clear()  # the next check (30 s later) finds them and rolls nothing
    ctl.reconcile("ml", "demo")
    assert kube.created.count(("patched Deployment tolerations", "demo-coordinator")) == 1


def test_a_budget_the_operator_may_not_make_never_stops_the_replicas_recovery(make_controller, caplog) -> None:
    """An installation whose RBAC is older than disruption budgets: a warning, and the pass goes on."""
    kube = MemoryKube(raw_job())

    def forbidden(namespace: str, name: str) -> dict | None:
        raise PermissionError("403 Forbidden: poddisruptionbudgets")

    kube.get_disruption_budget = forbidden  # type: ignore[method-assign]
    make_controller(kube).reconcile("ml", "demo")
    assert ("Pod", "demo-r0-n0-g0") in kube.created and "status" in kube.job
    assert "could not make the disruption budget demo-workers: 403 Forbidden" in caplog.text


def test_oom_kills_in_place_and_the_job_they_end_are_counted_in_the_metrics(make_controller):
    from transom_operator import metrics

    def count(metric, reason):
        return metrics.REGISTRY.get_sample_value(f"{metric}_total", {"reason": reason}) or 0.0

    raw = raw_job(replicas=1)
    job = api.TrainingJob.model_validate(raw)
    pod = _running(resources.worker_pod(job, 0, 0, 0), "n0")
    nodes = [{"metadata": {"name": "n0", "resourceVersion": "1"},
              "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]
    kube = PodKube(raw, [pod], nodes)
    ctl = make_controller(kube)
    ctl.reconcile("ml", "demo")
    failures, jobs = count("transom_operator_replica_failures", "OOMKilled"), count("transom_operator_job_failures",
                                                                                   "OOMKilled")
    kube.job["status"]["training"] = {"oomKills": [{"replica": 0, "generation": 0, "count": 1,
                                                    "time": "2025-01-01T00:00:05Z", "message": "worker rank 0 ..."}]}
    kube.job["metadata"]["resourceVersion"] = "50"
    ctl.cache.job_event("MODIFIED", _copy(kube.job))  # the coordinator's write, as the watch brings it
    ctl.reconcile("ml", "demo")  # a kill restarted in place: the pod runs on
    ctl.reconcile("ml", "demo")  # shown already: not counted again
    assert count("transom_operator_replica_failures", "OOMKilled") == failures + 1
    assert [r for _, r, _ in kube.events].count(reasons.OOM_KILLED) == 1
    kube.pods[pod["metadata"]["name"]]["status"] = {"phase": "Failed", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": contract.EXIT_OOM_KILLED, "reason": "OOMKilled"}}}]}
    kube.pods[pod["metadata"]["name"]]["metadata"]["resourceVersion"] = "6"
    ctl.cache.pod_event("MODIFIED", _copy(kube.pods[pod["metadata"]["name"]]))
    ctl.reconcile("ml", "demo")
    assert kube.job["status"]["state"] == "Failed"
    assert count("transom_operator_job_failures", "OOMKilled") == jobs + 1
    assert count("transom_operator_replica_failures", "OOMKilled") == failures + 2
