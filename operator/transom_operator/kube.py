"""The only module that talks to the Kubernetes API server.

Reads come back as plain dicts (the API's own camelCase JSON, `_preload_content=False`) so
the pure reconcile code parses exactly what the server sent. Writes are idempotent where
Kubernetes lets them be: a 409 on create means the object exists (deterministic names), a
404 on delete means it is gone already. Every request has a connect and a read timeout
(REQUEST_TIMEOUT_S): an API server that accepts a connection and never answers costs a pass
one timeout, never a worker thread forever.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException

from transom import contract
from transom_operator import metrics

log = logging.getLogger("transom.operator")
GROUP, VERSION, PLURAL = "transom.io", "v1alpha1", "trainingjobs"
EXCLUDE_TAINT_KEY = "transom.io/excluded"
# (connect, read) seconds for one request. The read bound is far above any answer a healthy
# API server gives (a 2,000-pod list takes well under a second) and well below the pass's
# own bound on its writes (controller.WRITE_TIMEOUT_S).
REQUEST_TIMEOUT_S = (5.0, 30.0)


def _json(resp) -> Any:
    return json.loads(resp.data)


def _list_rv(resp: dict) -> int:
    raw = (resp.get("metadata") or {}).get("resourceVersion") or "0"
    return int(raw) if raw.isascii() and raw.isdigit() else 0


# Where the API server serves each kind the operator writes. It writes a fixed set of kinds,
# so it needs no discovery: the dynamic client's would send a dozen requests, none of them
# with a timeout, and share a cache that is not safe from several threads at once.
_PLURALS = {
    "Pod": "pods", "Secret": "secrets", "ServiceAccount": "serviceaccounts", "Service": "services",
    "Event": "events", "Node": "nodes", "Deployment": "deployments", "NetworkPolicy": "networkpolicies",
    "Role": "roles", "RoleBinding": "rolebindings", "ClusterRoleBinding": "clusterrolebindings", "TrainingJob": PLURAL,
    "PodDisruptionBudget": "poddisruptionbudgets", "Workload": "workloads", "ResourceFlavor": "resourceflavors",
}


def _path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None,
          subresource: str | None = None) -> str:
    """The API path of a kind's collection (no name) or of one object, e.g.
    /apis/apps/v1/namespaces/ml/deployments/demo-coordinator."""
    if kind not in _PLURALS:
        raise ValueError(f"kube.py does not know where the API serves {kind} (add it to _PLURALS)")
    parts = ["/api/v1" if api_version == "v1" else f"/apis/{api_version}"]
    if namespace is not None:
        parts += ["namespaces", namespace]
    parts.append(_PLURALS[kind])
    parts += [p for p in (name, subresource) if p is not None]
    return "/".join(parts)


class _Requests(dynamic.DynamicClient):
    """The dynamic client's `request` (authentication, headers, error mapping to ApiException,
    any body sent as it is) without its discovery, which its constructor would run at once."""

    def __init__(self, api: client.ApiClient):  # deliberately not super().__init__: no discovery
        self.client = api


class Kube:
    def __init__(self, api: client.ApiClient, timeout: tuple[float, float] = REQUEST_TIMEOUT_S):
        self.api = api
        self.timeout = timeout
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self._requests = _Requests(api)

    def _count(self) -> None:
        metrics.API_REQUESTS.inc()

    def _send(self, method: str, path: str, body: Any, content_type: str = "application/json") -> Any:
        """One request with a JSON body; the answer's parsed JSON. The typed client is not used
        for writes: it would re-validate a manifest against its own models and refuse valid
        YAML (e.g. `nvidia.com/gpu: 8`)."""
        self._count()
        # serialize=False: the raw answer, not wrapped into objects nobody reads.
        return _json(self._requests.request(method, path, body=body, content_type=content_type, serialize=False,
                                            _request_timeout=self.timeout))

    # --- reads ---------------------------------------------------------------------------
    def get_job(self, namespace: str, name: str) -> dict | None:
        self._count()
        try:
            return _json(self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False, _request_timeout=self.timeout))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list_pods(self, namespace: str, job: str) -> tuple[list[dict], int]:
        """The job's pods, and the list's resourceVersion (cache.py)."""
        self._count()
        resp = _json(self.core.list_namespaced_pod(
            namespace, label_selector=f"{contract.LABEL_JOB}={job}", _preload_content=False,
            _request_timeout=self.timeout))
        return resp["items"], _list_rv(resp)

    def list_nodes(self) -> tuple[list[dict], int]:
        self._count()
        resp = _json(self.core.list_node(_preload_content=False, _request_timeout=self.timeout))
        return resp["items"], _list_rv(resp)

    def get_deployment(self, namespace: str, name: str) -> dict | None:
        self._count()
        try:
            return _json(self.apps.read_namespaced_deployment(name, namespace, _preload_content=False,
                                                                 _request_timeout=self.timeout))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def get_disruption_budget(self, namespace: str, name: str) -> dict | None:
        return self.get("policy/v1", "PodDisruptionBudget", namespace, name)

    def patch_disruption_budget(self, namespace: str, name: str, patch: dict) -> None:
        """A merge patch (disruption.spec_patch): the budget follows the job's size."""
        self._send("PATCH", _path("policy/v1", "PodDisruptionBudget", namespace, name), patch,
                   "application/merge-patch+json")

    def set_container_command(self, namespace: str, deployment: str, container: str, command: list[str]) -> None:
        """Strategic merge on the container list (merged by name): only its command changes."""
        body = {"spec": {"template": {"spec": {"containers": [{"name": container, "command": command}]}}}}
        self._send("PATCH", _path("apps/v1", "Deployment", namespace, deployment), body,
                   "application/strategic-merge-patch+json")

    def set_tolerations(self, namespace: str, deployment: str, tolerations: list[dict]) -> None:
        """Strategic merge of the pod template's tolerations (a list without a merge key: replaced whole)."""
        body = {"spec": {"template": {"spec": {"tolerations": tolerations}}}}
        self._send("PATCH", _path("apps/v1", "Deployment", namespace, deployment), body,
                   "application/strategic-merge-patch+json")

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        """Any object of a kind the operator knows (a PodDisruptionBudget, kueue's Workloads and
        ResourceFlavors), or None if there is none."""
        try:
            return self._send("GET", _path(api_version, kind, namespace, name), None)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    # --- writes --------------------------------------------------------------------------
    def merge_patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: dict,
                    subresource: str | None = None) -> dict:
        """A JSON merge patch (one with metadata.resourceVersion fails with 409 if the object changed)."""
        return self._send("PATCH", _path(api_version, kind, namespace, name, subresource), patch,
                          "application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        try:
            self._send("DELETE", _path(api_version, kind, namespace, name), None)
        except ApiException as e:
            if e.status != 404:
                raise

    def create(self, namespace: str | None, manifest: dict) -> bool:
        """Create any of the kinds the operator makes (`namespace` None: a cluster-wide one);
        False if it already existed."""
        try:
            self._send("POST", _path(manifest["apiVersion"], manifest["kind"], namespace), manifest)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            if e.status == 403 and "NamespaceTerminating" in str(e.body or ""):
                # The job's namespace is being deleted, and the job with it: nothing to create.
                log.debug("not creating %s %s: namespace %s is terminating", manifest["kind"],
                          manifest["metadata"].get("name"), namespace)
                return False
            raise

    def list_cluster_role_bindings(self, selector: str) -> list[dict]:
        """The ClusterRoleBindings with labels matching `selector` (one page: the operator's own
        are one per job)."""
        return self._send("GET", _path("rbac.authorization.k8s.io/v1", "ClusterRoleBinding")
                          + f"?labelSelector={urllib.parse.quote(selector)}", None)["items"]

    def delete_cluster_role_binding(self, name: str) -> None:
        try:
            self._send("DELETE", _path("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", name=name), None)
        except ApiException as e:
            if e.status != 404:
                raise

    def delete_pod(self, namespace: str, name: str, force: bool = False) -> None:
        self._count()
        try:
            # A pod on a dead node never confirms its own deletion: force it.
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0 if force else None,
                                            _preload_content=False, _request_timeout=self.timeout)
        except ApiException as e:
            if e.status != 404:
                raise

    def patch_pod_labels(self, namespace: str, name: str, labels: dict[str, str | None]) -> dict | None:
        """Merge-patch a pod's labels (None removes one); the pod as patched, or None if it is gone."""
        try:
            return self._send("PATCH", _path("v1", "Pod", namespace, name), {"metadata": {"labels": labels}},
                              "application/merge-patch+json")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_job_status(self, namespace: str, name: str, ops: list[dict]) -> dict:
        """A JSON patch of the job's status (reconcile/status_diff.py: only what changed); returns
        the job as the API server has it after the patch."""
        return self._send("PATCH", _path(f"{GROUP}/{VERSION}", "TrainingJob", namespace, name, "status"), ops,
                          "application/json-patch+json")

    def exclude_node(self, node: str, policy: str, reason: str) -> None:
        """Taint (NoSchedule) or cordon a node the job excluded; `Exclude` touches nothing."""
        if policy == "Cordon":
            body: dict = {"spec": {"unschedulable": True}}
        elif policy == "Taint":
            current = self.core.read_node(node, _request_timeout=self.timeout).spec.taints or []
            taints = [t.to_dict() for t in current if t.key != EXCLUDE_TAINT_KEY]
            taints.append({"key": EXCLUDE_TAINT_KEY, "value": reason[:63], "effect": "NoSchedule"})
            body = {"spec": {"taints": taints}}
        else:
            return
        self._send("PATCH", _path("v1", "Node", name=node), body, "application/merge-patch+json")

    def event(self, job: dict, type_: str, reason: str, message: str) -> None:
        meta = job["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "name": meta["name"],
                "namespace": meta["namespace"], "uid": meta["uid"],
            },
            "type": type_, "reason": reason, "message": message[:1024],
            "firstTimestamp": now[:19] + "Z", "lastTimestamp": now[:19] + "Z", "eventTime": now,
            "reportingComponent": "transom-operator", "reportingInstance": "transom-operator",
            "action": reason, "source": {"component": "transom-operator"}, "count": 1,
        }
        try:
            self._send("POST", _path("v1", "Event", meta["namespace"]), body)
        except ApiException as e:  # an Event is a courtesy: never fail a reconcile for it
            log.warning("could not post event %s for %s: %s", reason, meta["name"], e.reason)
