"""Helpers for e2e tests against the local control plane of hack/testenv (not fixtures).

kwok runs no containers and no kubelet: it only writes the status a kubelet would. A test
that needs a pod to fail or a node to go away therefore writes that status itself, through
the status subresource, the way a kubelet (or its absence) would show it to the operator.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

T = TypeVar("T")

MERGE_PATCH = "application/merge-patch+json"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """Poll until `predicate` returns something truthy and return it; AssertionError on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last value: {value!r})")
        time.sleep(interval_s)


def holds_for(predicate: Callable[[], object], duration_s: float, what: str, interval_s: float = 0.5) -> None:
    """Assert that `predicate` stays truthy for `duration_s` (nothing reverts a written state)."""
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        value = predicate()
        assert value, f"{what} stopped holding (value: {value!r})"
        time.sleep(interval_s)


def read_or_none(read: Callable[..., T], *args, **kwargs) -> T | None:
    """The object, or None when the API server answers 404."""
    try:
        return read(*args, **kwargs)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def namespace_name(test_name: str) -> str:
    """A fresh DNS-1123 label derived from a test's name: at most 63 characters."""
    slug = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-")[:54].rstrip("-") or "test"
    return f"{slug}-{secrets.token_hex(4)}"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def fail_pod(core_v1: client.CoreV1Api, namespace: str, name: str, exit_code: int, reason: str = "Error",
             message: str | None = None) -> client.V1Pod:
    """Make a pod on a kwok node fail as if every container had exited with `exit_code`.

    The patch is a JSON merge patch of the status subresource, so the status lists are
    written whole: each container's state becomes `terminated` only (a strategic merge
    would keep `running` beside it, which the API server rejects).
    """
    pod = core_v1.read_namespaced_pod(name, namespace)
    status = core_v1.api_client.sanitize_for_serialization(pod.status) or {}
    now = _now()
    by_name = {cs["name"]: cs for cs in status.get("containerStatuses", [])}
    container_statuses = []
    for container in pod.spec.containers:
        old = by_name.get(container.name, {})
        started_at = old.get("state", {}).get("running", {}).get("startedAt", now)
        terminated = {"exitCode": exit_code, "reason": reason, "startedAt": started_at, "finishedAt": now}
        if message is not None:  # what the kubelet copies from terminationMessagePath
            terminated["message"] = message
        if "containerID" in old:
            terminated["containerID"] = old["containerID"]
        container_statuses.append({
            **old,
            "name": container.name,
            "image": old.get("image", container.image),
            "imageID": old.get("imageID", ""),
            "restartCount": old.get("restartCount", 0),
            "ready": False,
            "started": False,
            "state": {"terminated": terminated},
        })
    conditions = [
        {**c, "status": "False", "reason": "PodFailed", "lastTransitionTime": now}
        if c["type"] in ("Ready", "ContainersReady") and c["status"] != "False" else c
        for c in status.get("conditions", [])
    ]
    body = {"status": {"phase": "Failed", "containerStatuses": container_statuses, "conditions": conditions}}
    return core_v1.patch_namespaced_pod_status(name, namespace, body, _content_type=MERGE_PATCH)


def node_condition(node: client.V1Node, type_: str) -> client.V1NodeCondition | None:
    return next((c for c in node.status.conditions or [] if c.type == type_), None)


def make_node_not_ready(core_v1: client.CoreV1Api, node: str) -> client.V1Node:
    """Take a kwok node away: kwok stops heartbeating it and its Ready condition turns False.

    Removing the annotation first matters: kwok manages only annotated nodes, and a node it
    still managed would have its Ready condition written back to True.
    """
    core_v1.patch_node(node, {"metadata": {"annotations": {KWOK_NODE_ANNOTATION: None}}}, _content_type=MERGE_PATCH)
    current = core_v1.read_node(node)
    now = _now()
    conditions = []
    for c in core_v1.api_client.sanitize_for_serialization(current.status.conditions or []):
        if c["type"] == "Ready":
            c = {**c, "status": "False", "reason": "KubeletNotReady",
                 "message": "kubelet stopped posting node status (e2e)", "lastHeartbeatTime": now,
                 "lastTransitionTime": now}
        conditions.append(c)
    if not any(c["type"] == "Ready" for c in conditions):
        conditions.append({"type": "Ready", "status": "False", "reason": "KubeletNotReady",
                           "message": "kubelet stopped posting node status (e2e)",
                           "lastHeartbeatTime": now, "lastTransitionTime": now})
    return core_v1.patch_node_status(node, {"status": {"conditions": conditions}}, _content_type=MERGE_PATCH)


def restore_kwok_node(core_v1: client.CoreV1Api, node: str, value: str = "fake", timeout_s: float = 60) -> None:
    """Hand a node back to kwok and wait until kwok reports it Ready again."""
    core_v1.patch_node(node, {"metadata": {"annotations": {KWOK_NODE_ANNOTATION: value}}}, _content_type=MERGE_PATCH)

    def ready() -> bool:
        cond = node_condition(core_v1.read_node(node), "Ready")
        return cond is not None and cond.status == "True"

    wait_for(ready, timeout_s, f"kwok to report node {node} Ready again")
