"""The only module that talks to the Kubernetes API server.

Reads come back as plain dicts (the API's own camelCase JSON, `_preload_content=False`) so
the pure reconcile code parses exactly what the server sent. Writes are idempotent where
Kubernetes lets them be: a 409 on create means the object exists (deterministic names), a
404 on delete means it is gone already.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timezone
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException

from transom import contract
from transom_operator import metrics

log = logging.getLogger("transom.operator")
GROUP, VERSION, PLURAL = "transom.io", "v1alpha1", "trainingjobs"
EXCLUDE_TAINT_KEY = "transom.io/excluded"


def _json(resp) -> Any:
    return json.loads(resp.data)


def _list_rv(resp: dict) -> int:
    raw = (resp.get("metadata") or {}).get("resourceVersion") or "0"
    return int(raw) if raw.isdigit() else 0


class Kube:
    def __init__(self, api: client.ApiClient):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.dynamic = dynamic.DynamicClient(api)
        self._kinds: dict[tuple[str, str], Any] = {}
        self._kinds_lock = threading.Lock()

    def _count(self) -> None:
        metrics.API_REQUESTS.inc()

    def _kind(self, api_version: str, kind: str):
        """The dynamic client's resource for a kind, resolved once: its discovery fills a shared
        cache that is not safe from several threads at once (passes and their pod writes run
        in threads)."""
        key = (api_version, kind)
        with self._kinds_lock:
            if key not in self._kinds:
                self._kinds[key] = self.dynamic.resources.get(api_version=api_version, kind=kind)
            return self._kinds[key]

    def _resource(self, manifest: dict):
        # The dynamic client sends the manifest as it is: the typed client would re-validate
        # it against its own models and refuse valid YAML (e.g. `nvidia.com/gpu: 8`).
        return self._kind(manifest["apiVersion"], manifest["kind"])

    # --- reads ---------------------------------------------------------------------------
    def get_job(self, namespace: str, name: str) -> dict | None:
        self._count()
        try:
            return _json(self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list_pods(self, namespace: str, job: str) -> tuple[list[dict], int]:
        """The job's pods, and the list's resourceVersion (cache.py)."""
        self._count()
        resp = _json(self.core.list_namespaced_pod(
            namespace, label_selector=f"{contract.LABEL_JOB}={job}", _preload_content=False))
        return resp["items"], _list_rv(resp)

    def list_nodes(self) -> tuple[list[dict], int]:
        self._count()
        resp = _json(self.core.list_node(_preload_content=False))
        return resp["items"], _list_rv(resp)

    def get_deployment(self, namespace: str, name: str) -> dict | None:
        self._count()
        try:
            return _json(self.apps.read_namespaced_deployment(name, namespace, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def set_container_command(self, namespace: str, deployment: str, container: str, command: list[str]) -> None:
        """Strategic merge on the container list (merged by name): only its command changes."""
        self._count()
        deployments = self._kind("apps/v1", "Deployment")
        body = {"spec": {"template": {"spec": {"containers": [{"name": container, "command": command}]}}}}
        deployments.patch(body=body, name=deployment, namespace=namespace,
                          content_type="application/strategic-merge-patch+json")

    # --- writes --------------------------------------------------------------------------
    def create(self, namespace: str, manifest: dict) -> bool:
        """Create any of the kinds the operator makes; False if it already existed."""
        self._count()
        try:
            # serialize=False: the answer is not wrapped into objects nobody reads.
            self._resource(manifest).create(body=manifest, namespace=namespace, serialize=False)
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

    def delete_pod(self, namespace: str, name: str, force: bool = False) -> None:
        self._count()
        try:
            # A pod on a dead node never confirms its own deletion: force it.
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0 if force else None,
                                            _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    def patch_pod_labels(self, namespace: str, name: str, labels: dict[str, str | None]) -> bool:
        """Merge-patch a pod's labels (None removes one); False if the pod is gone."""
        self._count()
        pods = self._kind("v1", "Pod")
        try:
            pods.patch(body={"metadata": {"labels": labels}}, name=name, namespace=namespace,
                       content_type="application/merge-patch+json", serialize=False)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    def patch_job_status(self, namespace: str, name: str, ops: list[dict]) -> dict:
        """A JSON patch of the job's status (reconcile/status_diff.py: only what changed); returns
        the job as the API server has it after the patch."""
        self._count()
        status = self._kind(f"{GROUP}/{VERSION}", "TrainingJob").subresources["status"]
        return _json(status.patch(body=ops, name=name, namespace=namespace,
                                  content_type="application/json-patch+json", serialize=False))

    def exclude_node(self, node: str, policy: str, reason: str) -> None:
        """Taint (NoSchedule) or cordon a node the job excluded; `Exclude` touches nothing."""
        if policy == "Cordon":
            body: dict = {"spec": {"unschedulable": True}}
        elif policy == "Taint":
            current = self.core.read_node(node).spec.taints or []
            taints = [t.to_dict() for t in current if t.key != EXCLUDE_TAINT_KEY]
            taints.append({"key": EXCLUDE_TAINT_KEY, "value": reason[:63], "effect": "NoSchedule"})
            body = {"spec": {"taints": taints}}
        else:
            return
        self._count()
        nodes = self._kind("v1", "Node")
        nodes.patch(body=body, name=node, content_type="application/merge-patch+json")

    def event(self, job: dict, type_: str, reason: str, message: str) -> None:
        meta = job["metadata"]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
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
        self._count()
        try:
            self._resource(body).create(body=body, namespace=meta["namespace"])
        except ApiException as e:  # an Event is a courtesy: never fail a reconcile for it
            log.warning("could not post event %s for %s: %s", reason, meta["name"], e.reason)
