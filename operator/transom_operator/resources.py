"""Builders of the Kubernetes objects a TrainingJob owns, as plain manifest dicts.

Pure functions of the job (the pydantic model, with `metadata.name`, `namespace` and `uid`
as the API server returns them) and the child's identity: no I/O, so `kube.py` creates
what these return and the tests compare dicts. Every object carries an ownerReference to
the job (controller, blockOwnerDeletion), so deleting the job deletes them.

- `worker_pod`: one pod of one replica, from `spec.template`, with the transom.io labels,
  the pod environment of contract.py (the token only through a secretKeyRef), a node
  affinity keeping it off the job's excluded nodes, the job's `<job>-worker`
  ServiceAccount with no token mounted, and a restricted security context wherever the
  template does not ask otherwise.
- `spare_pod`: a hot spare's pod, which waits to be promoted to a replica by relabelling.
- `network_policy`: only the job's own pods may connect to the job's pods.
- `coordinator_resources`: the per-job objects: token Secret, the workers' ServiceAccount
  (no Role), the coordinator's ServiceAccount, a Role limited to this job, RoleBinding,
  ClusterIP Service and a locked-down Deployment.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Iterable
from typing import Any

from transom import contract
from transom_operator import api, naming

HOSTNAME_LABEL = "kubernetes.io/hostname"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "transom-operator"
COMPONENT_WORKER = "worker"
COMPONENT_COORDINATOR = "coordinator"
COMPONENT_NETWORK = "network-policy"
COMPONENT_TOKEN_REVIEW = "token-review"
LABEL_NAMESPACE = "transom.io/namespace"  # on the one cluster-wide object per job: whose it is
IDENTITY_VOLUME = "transom-identity"
IDENTITY_TOKEN_SECONDS = 3600  # the kubelet renews a projected token at 80% of its life

# The coordinator is a small asyncio HTTP server; these hold a few thousand replicas.
# Ephemeral storage: its /tmp emptyDir (COORDINATOR_SCRATCH, which Python may use) and its
# logs; bounded so that a runaway writer is evicted rather than fill the node's disk.
COORDINATOR_SCRATCH = "64Mi"
COORDINATOR_RESOURCES = {
    "requests": {"cpu": "100m", "memory": "128Mi", "ephemeral-storage": "64Mi"},
    "limits": {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "256Mi"},
}
COORDINATOR_PROBES = {
    "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 2,
                       "initialDelaySeconds": 1},
    "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 2,
                      "initialDelaySeconds": 10, "failureThreshold": 6},
}
COORDINATOR_UID = 65532  # "nonroot" of distroless images; the image must not need root
# How long the coordinator's pod stays on a node the node controller has marked NotReady or
# unreachable (its NoExecute taints) before Kubernetes evicts it and the Deployment starts it
# elsewhere; without a toleration of its own, admission gives every pod 300 s. Every step of
# every replica waits on the coordinator, so on a lost node the whole job stalls for the node
# controller's grace (node-monitor-grace-period: 40-50 s by default) plus this, while a
# coordinator restart costs the replicas one registration and one group rebuild, and no step.
# 10 s rides out a node that comes back within seconds, is below nodeNotReadyGraceSeconds (30 s
# by default: the coordinator is back before that node's replicas are replaced) and far below
# the 900 s for which a replica's quorum request keeps retrying.
COORDINATOR_NODE_LOSS_TOLERATION_S = 10
NODE_LOSS_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def job_name(job: api.TrainingJob) -> str:
    return job.metadata["name"]


def job_namespace(job: api.TrainingJob) -> str:
    return job.metadata.get("namespace") or "default"


def owner_reference(job: api.TrainingJob) -> dict[str, Any]:
    """The ownerReference every child carries: the job is its controller."""
    uid = job.metadata.get("uid")
    if not uid:
        raise ValueError(f"TrainingJob {job_name(job)} must have metadata.uid to own objects")
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": job_name(job),
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_metadata(job: api.TrainingJob, name: str, component: str,
                   labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Metadata of an object the job owns: name, namespace, the job and component labels, and the
    ownerReference through which it goes with the job."""
    return {
        "name": name,
        "namespace": job_namespace(job),
        "labels": {
            **(labels or {}),
            contract.LABEL_JOB: job_name(job),
            LABEL_COMPONENT: component,
            LABEL_MANAGED_BY: MANAGED_BY,
        },
        "ownerReferences": [owner_reference(job)],
    }


# --- worker pods ----------------------------------------------------------------------

def _identity_labels(job: api.TrainingJob, role: str, index: int, node_rank: int, generation: int) -> dict[str, str]:
    return {
        contract.LABEL_JOB: job_name(job),
        role: str(index),
        contract.LABEL_NODE_RANK: str(node_rank),
        contract.LABEL_GENERATION: str(generation),
    }


def worker_labels(job: api.TrainingJob, replica: int, node_rank: int, generation: int) -> dict[str, str]:
    """The labels by which the operator finds a pod's replica, node rank and generation."""
    return _identity_labels(job, contract.LABEL_REPLICA, replica, node_rank, generation)


def worker_env(job: api.TrainingJob, replica: int, node_rank: int, generation: int,
               coordinator_url: str) -> list[dict[str, Any]]:
    """The pod environment of contract.py (read by the launcher: contract.ReplicaEnv)."""
    spec = job.spec
    plain = {
        contract.ENV_JOB: job_name(job),
        # With the name, the job's identity, which its checkpoint location records
        # (job_identity.py): a job created again under the same name is another job.
        contract.ENV_JOB_UID: job.metadata.get("uid") or "",
        contract.ENV_NAMESPACE: job_namespace(job),
        contract.ENV_REPLICA_ID: str(replica),
        contract.ENV_NUM_REPLICAS: str(spec.replicas),
        contract.ENV_REPLICA_GENERATION: str(generation),
        contract.ENV_NODE_RANK: str(node_rank),
        contract.ENV_NNODES: str(spec.nodes_per_replica),
        contract.ENV_NPROC_PER_NODE: str(spec.procs_per_node),
        contract.ENV_COORDINATOR_URL: coordinator_url,
        contract.ENV_CHECKPOINT_URI: spec.checkpoint.uri if spec.checkpoint else "",
        contract.ENV_COLLECTIVE_TIMEOUT: str(spec.fault_tolerance.collective_timeout_seconds),
        contract.ENV_BACKEND: spec.fault_tolerance.backend,
        contract.ENV_DETECTION: detection_json(job),
        contract.ENV_PREFLIGHT: preflight_json(job),
    }
    if spec.checkpoint:
        plain[contract.ENV_CHECKPOINT_INTERVAL] = str(spec.checkpoint.interval_steps)
        plain[contract.ENV_CHECKPOINT_KEEP] = str(spec.checkpoint.keep)
    plain[contract.ENV_IDENTITY_TOKEN_FILE] = f"{contract.IDENTITY_TOKEN_DIR}/{contract.IDENTITY_TOKEN_NAME}"
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in plain.items()]
    # Not the job's token, which may act for any replica: the pod's own identity (the
    # projected token above) and the state servers' token.
    env.append({
        "name": contract.ENV_PEER_TOKEN,
        "valueFrom": {"secretKeyRef": {"name": naming.peer_token_secret(job_name(job)), "key": naming.TOKEN_KEY}},
    })
    env.append({
        "name": contract.ENV_ADVERTISE_ADDR,
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    })
    env.append({"name": contract.ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    return env


def preflight_json(job: api.TrainingJob) -> str:
    """spec.preflight as the launcher reads it (contract.ENV_PREFLIGHT)."""
    return json.dumps(job.spec.preflight.model_dump(by_alias=True, mode="json"), separators=(",", ":"))


def _member(obj: dict[str, Any], key: str, empty: type[dict] | type[list]) -> Any:
    """obj[key], made an empty dict or list where it is absent or null (the schema types it)."""
    if obj.get(key) is None:
        obj[key] = empty()
    return obj[key]


def _with_env(container: dict[str, Any], env: list[dict[str, Any]], env_from: list[dict[str, Any]]) -> None:
    # The operator's values win over same-named entries of the template: the launcher must
    # see its real identity.
    ours = {e["name"] for e in env}
    container["env"] = [e for e in container.get("env") or [] if e.get("name") not in ours] + copy.deepcopy(env)
    if env_from:
        container["envFrom"] = list(container.get("envFrom") or []) + copy.deepcopy(env_from)


def exclude_nodes(affinity: dict[str, Any] | None, excluded: Iterable[str]) -> dict[str, Any] | None:
    """`affinity` with a required `kubernetes.io/hostname NotIn excluded` added to every term.

    Node selector terms are ORed, the expressions within a term ANDed, so the exclusion goes
    into each existing term (or a new one), leaving the template's own rules intact.
    """
    names = sorted(set(excluded))
    if not names:
        return affinity
    out = copy.deepcopy(affinity) if affinity else {}
    required = _member(_member(out, "nodeAffinity", dict), "requiredDuringSchedulingIgnoredDuringExecution", dict)
    terms = required.get("nodeSelectorTerms") or [{}]
    expression = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": names}
    for term in terms:
        term["matchExpressions"] = list(term.get("matchExpressions") or []) + [dict(expression, values=list(names))]
    required["nodeSelectorTerms"] = terms
    return out


def prefer_other_nodes(affinity: dict[str, Any] | None, avoid: Iterable[str]) -> dict[str, Any] | None:
    """`affinity` with a preferred (soft) `kubernetes.io/hostname NotIn avoid` term: a
    replacement goes elsewhere when there is room elsewhere, and to the same node when
    that is the only one left (a hard rule would leave it Pending)."""
    names = sorted(set(avoid))
    if not names:
        return affinity
    out = copy.deepcopy(affinity) if affinity else {}
    preferred = _member(_member(out, "nodeAffinity", dict), "preferredDuringSchedulingIgnoredDuringExecution", list)
    preferred.append({"weight": 100, "preference": {"matchExpressions": [
        {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": names}]}})
    return out


def with_identity(job: api.TrainingJob, pod_spec: dict[str, Any]) -> None:
    """The pod's identity towards the job's coordinator: a projected token of the worker
    ServiceAccount, bound to this pod and to the job's audience (transom/coordinator/
    kube_identity.py), mounted read-only into every container at IDENTITY_TOKEN_DIR."""
    volume = {"name": IDENTITY_VOLUME, "projected": {"sources": [{"serviceAccountToken": {
        "audience": contract.identity_audience(job_namespace(job), job_name(job)),
        "expirationSeconds": IDENTITY_TOKEN_SECONDS, "path": contract.IDENTITY_TOKEN_NAME}}]}}
    volumes = [v for v in _member(pod_spec, "volumes", list) if v.get("name") != IDENTITY_VOLUME]
    pod_spec["volumes"] = [*volumes, volume]
    for key in ("initContainers", "containers"):
        for container in pod_spec.get(key) or []:
            mounts = [m for m in _member(container, "volumeMounts", list) if m.get("name") != IDENTITY_VOLUME]
            container["volumeMounts"] = [*mounts, {"name": IDENTITY_VOLUME, "mountPath": contract.IDENTITY_TOKEN_DIR,
                                                   "readOnly": True}]


def run_as_worker(job: api.TrainingJob, pod_spec: dict[str, Any]) -> None:
    """The pod runs as the job's `<job>-worker` ServiceAccount, which has no Role, and with no
    API token mounted: the workers never call the API server. The schema refuses a template
    that sets either (api_template.NO_SERVICE_ACCOUNT_RULES); this holds even for a job
    stored before it did."""
    pod_spec.pop("serviceAccount", None)  # the deprecated alias, which could disagree
    pod_spec["serviceAccountName"] = naming.worker_service_account(job_name(job))
    pod_spec["automountServiceAccountToken"] = False


def harden(pod_spec: dict[str, Any]) -> None:
    """Restricted defaults (Kubernetes' "restricted" Pod Security Standard) for whatever the
    template leaves unset: non-root, the RuntimeDefault seccomp profile, no privilege
    escalation, no capabilities. A template that sets a field keeps its value, and a default
    that would contradict it (a root user, a privileged container) is not added."""
    containers = [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]
    pod_sc = _member(pod_spec, "securityContext", dict)
    runs_as_root = pod_sc.get("runAsUser") == 0 or any(
        (c.get("securityContext") or {}).get("runAsUser") == 0 for c in containers)
    if not runs_as_root:
        pod_sc.setdefault("runAsNonRoot", True)
    pod_sc.setdefault("seccompProfile", {"type": "RuntimeDefault"})
    for container in containers:
        sc = _member(container, "securityContext", dict)
        if not sc.get("privileged"):
            sc.setdefault("allowPrivilegeEscalation", False)
            sc.setdefault("capabilities", {"drop": ["ALL"]})


def _termination_log(container: dict[str, Any]) -> dict[str, Any]:
    """Where the container's launcher writes why it ended with a ScriptError: the file the
    kubelet reports as the container's termination message (failures.script_error_message)."""
    path = container.get("terminationMessagePath")
    return {"name": contract.ENV_TERMINATION_LOG, "value": path if isinstance(path, str) and path
            else contract.TERMINATION_LOG}


def _pod(job: api.TrainingJob, name: str, labels: dict[str, str], env: list[dict[str, Any]],
         excluded_nodes: Iterable[str], avoid_nodes: Iterable[str] = ()) -> dict[str, Any]:
    """A worker pod from spec.template with our name, labels and environment."""
    template = copy.deepcopy(job.spec.template)
    template_meta = template.get("metadata") or {}
    pod_spec = template.get("spec") or {}

    metadata = owned_metadata(job, name, COMPONENT_WORKER, labels={**(template_meta.get("labels") or {})})
    metadata["labels"].update(labels)
    if template_meta.get("annotations"):
        metadata["annotations"] = dict(template_meta["annotations"])

    env_from = []
    if job.spec.checkpoint and job.spec.checkpoint.credentials_secret:
        env_from.append({"secretRef": {"name": job.spec.checkpoint.credentials_secret.name}})
    for key in ("initContainers", "containers"):
        for container in pod_spec.get(key) or []:
            _with_env(container, [*env, _termination_log(container)], env_from)

    # A replica's pod that exits is done: the launcher already restarted its processes in
    # place; anything further is the operator's replacement of the whole replica.
    pod_spec["restartPolicy"] = "Never"
    run_as_worker(job, pod_spec)
    with_identity(job, pod_spec)
    harden(pod_spec)
    affinity = prefer_other_nodes(exclude_nodes(pod_spec.get("affinity"), excluded_nodes), avoid_nodes)
    if affinity is not None:
        pod_spec["affinity"] = affinity
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def worker_pod(job: api.TrainingJob, replica: int, node_rank: int, generation: int,
               excluded_nodes: Iterable[str] = (), coordinator_url: str | None = None,
               avoid_nodes: Iterable[str] = ()) -> dict[str, Any]:
    """Pod `node_rank` of replica `replica`, incarnation `generation`, from spec.template;
    it must not run on `excluded_nodes` and prefers not to on `avoid_nodes`."""
    name = job_name(job)
    if coordinator_url is None:
        coordinator_url = naming.coordinator_url(name, job_namespace(job))
    return _pod(job, naming.worker_pod(name, replica, node_rank, generation),
                worker_labels(job, replica, node_rank, generation),
                worker_env(job, replica, node_rank, generation, coordinator_url), excluded_nodes, avoid_nodes)


PODINFO_VOLUME = "transom-podinfo"


def spare_labels(job: api.TrainingJob, spare: int, node_rank: int, generation: int) -> dict[str, str]:
    """A spare pod's labels: `transom.io/spare` instead of `transom.io/replica` until promoted."""
    return _identity_labels(job, contract.LABEL_SPARE, spare, node_rank, generation)


def promotion_labels(replica: int, generation: int) -> dict[str, str | None]:
    """The label patch that turns a spare pod into a pod of `replica` (None removes a label)."""
    return {
        contract.LABEL_SPARE: None,
        contract.LABEL_REPLICA: str(replica),
        contract.LABEL_GENERATION: str(generation),
    }


def spare_pod(job: api.TrainingJob, spare: int, node_rank: int, generation: int,
              excluded_nodes: Iterable[str] = (), coordinator_url: str | None = None) -> dict[str, Any]:
    """Pod `node_rank` of hot spare `spare`: a worker pod whose launcher waits to be promoted.

    Its environment has TRANSOM_SPARE_ID instead of the replica id and generation, and a
    downward-API volume with the pod's labels, through which the launcher learns the replica
    identity the operator gives it by relabelling (transom.launch.spare).
    """
    name = job_name(job)
    if coordinator_url is None:
        coordinator_url = naming.coordinator_url(name, job_namespace(job))
    env = [e for e in worker_env(job, 0, node_rank, 0, coordinator_url)
           if e["name"] not in (contract.ENV_REPLICA_ID, contract.ENV_REPLICA_GENERATION)]
    env.append({"name": contract.ENV_SPARE_ID, "value": str(spare)})
    env.append({"name": contract.ENV_PODINFO_DIR, "value": contract.PODINFO_DIR})
    pod = _pod(job, naming.spare_pod(name, spare, node_rank, generation),
               spare_labels(job, spare, node_rank, generation), env, excluded_nodes)
    pod_spec = pod["spec"]
    pod_spec["volumes"] = [v for v in pod_spec.get("volumes") or [] if v.get("name") != PODINFO_VOLUME] + [{
        "name": PODINFO_VOLUME,
        "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]},
    }]
    mount = {"name": PODINFO_VOLUME, "mountPath": contract.PODINFO_DIR, "readOnly": True}
    for container in pod_spec.get("containers") or []:
        container["volumeMounts"] = [m for m in container.get("volumeMounts") or []
                                     if m.get("name") != PODINFO_VOLUME] + [mount]
    return pod


# --- the coordinator ------------------------------------------------------------------

def coordinator_labels(job: api.TrainingJob) -> dict[str, str]:
    return {contract.LABEL_JOB: job_name(job), LABEL_COMPONENT: COMPONENT_COORDINATOR}


def coordinator_secret(job: api.TrainingJob, token: str) -> dict[str, Any]:
    """The job's own token, which may act for any replica: only the coordinator reads it
    (secretKeyRef), and an administrator who may read Secrets."""
    return _token_secret(job, naming.coordinator_token_secret(job_name(job)), token, COMPONENT_COORDINATOR)


def peer_secret(job: api.TrainingJob, token: str) -> dict[str, Any]:
    """The token of the replicas' state servers (peer recovery), which every worker holds."""
    return _token_secret(job, naming.peer_token_secret(job_name(job)), token, COMPONENT_WORKER)


def _token_secret(job: api.TrainingJob, name: str, token: str, component: str) -> dict[str, Any]:
    if not token:
        raise ValueError(f"the token of Secret {name} must not be empty")
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": owned_metadata(job, name, component),
        "stringData": {naming.TOKEN_KEY: token},
    }


def worker_service_account(job: api.TrainingJob) -> dict[str, Any]:
    """The ServiceAccount of the job's worker and spare pods. Nothing grants it anything, and
    it mounts no token: a pod's own identity, not a key to the API server. The pods must not
    run as `default`, to which an admin may have bound rights, nor as the coordinator's."""
    return {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": owned_metadata(job, naming.worker_service_account(job_name(job)), COMPONENT_WORKER),
        "automountServiceAccountToken": False,
    }


def coordinator_service_account(job: api.TrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": owned_metadata(job, naming.coordinator(job_name(job)), COMPONENT_COORDINATOR),
    }


def network_policy(job: api.TrainingJob) -> dict[str, Any]:
    """Ingress to the job's pods (workers, spares, coordinator) only from the job's own pods.

    The coordinator's API, the replicas' stores, state servers and collectives all trust the
    job's token; this keeps anyone else who holds it (or guesses a port) off the network
    path too. Policies add up: an admin may allow more (a Prometheus scraping the
    coordinator) with a policy of their own.
    """
    selector = {"matchLabels": {contract.LABEL_JOB: job_name(job)}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": owned_metadata(job, naming.network_policy(job_name(job)), COMPONENT_NETWORK),
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": selector}]}]},
    }


def coordinator_role(job: api.TrainingJob) -> dict[str, Any]:
    """Only what the coordinator does: write its job's status.training (progress, completion,
    verdicts) and Events, and read a pod whose token a caller presents (its labels say which
    replica it is: kube_identity.py). RBAC cannot narrow `get` to the job's pods by label."""
    name = job_name(job)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": owned_metadata(job, naming.coordinator(name), COMPONENT_COORDINATOR),
        "rules": [
            {"apiGroups": [api.GROUP], "resources": [api.PLURAL], "resourceNames": [name], "verbs": ["get"]},
            {"apiGroups": [api.GROUP], "resources": [f"{api.PLURAL}/status"], "resourceNames": [name],
             "verbs": ["get", "patch"]},
            {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        ],
    }


def token_review_binding(job: api.TrainingJob, cluster_role: str) -> dict[str, Any]:
    """Lets the job's coordinator create TokenReviews (the chart's ClusterRole `cluster_role`
    grants that alone): it checks its pods' tokens with them. Cluster-wide, so it cannot be
    owned by the job: the operator deletes it when the job is gone (controller.py)."""
    namespace, name = job_namespace(job), job_name(job)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": naming.token_review_binding(namespace, name), "labels": {
            contract.LABEL_JOB: name, LABEL_NAMESPACE: namespace, LABEL_COMPONENT: COMPONENT_TOKEN_REVIEW,
            LABEL_MANAGED_BY: MANAGED_BY}},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
        "subjects": [{"kind": "ServiceAccount", "name": naming.coordinator(name), "namespace": namespace}],
    }


def coordinator_role_binding(job: api.TrainingJob) -> dict[str, Any]:
    name = naming.coordinator(job_name(job))
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": owned_metadata(job, name, COMPONENT_COORDINATOR),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job_namespace(job)}],
    }


def coordinator_service(job: api.TrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": owned_metadata(job, naming.coordinator(job_name(job)), COMPONENT_COORDINATOR),
        "spec": {
            "type": "ClusterIP",
            "selector": coordinator_labels(job),
            "ports": [{"name": "http", "port": naming.COORDINATOR_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def detection_json(job: api.TrainingJob) -> str:
    """spec.detection as the coordinator, launchers and workers read it (TRANSOM_DETECTION)."""
    return job.spec.detection.model_dump_json(by_alias=True)


def coordinator_command(job: api.TrainingJob) -> list[str]:
    """`transom coordinator` with the job's settings (flags of transom.cli)."""
    spec = job.spec
    return [
        "transom", "coordinator",
        "--port", str(naming.COORDINATOR_PORT),
        "--job", job_name(job),
        "--replicas", str(spec.replicas),
        "--min-replicas", str(spec.min_replicas),
        "--heartbeat-timeout", str(spec.fault_tolerance.heartbeat_timeout_seconds),
        "--detection", detection_json(job),
        "--kube-status",  # the coordinator writes status.training (its Role allows just that)
        # A worker pod's projected token is its replica's identity (kube_identity.py).
        "--worker-service-account", naming.worker_service_account(job_name(job)),
    ]


def coordinator_tolerations() -> list[dict[str, Any]]:
    """The coordinator pod's tolerations of a lost node (COORDINATOR_NODE_LOSS_TOLERATION_S)."""
    return [{"key": key, "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": COORDINATOR_NODE_LOSS_TOLERATION_S} for key in NODE_LOSS_TAINTS]


def coordinator_deployment(job: api.TrainingJob, image: str,
                           image_pull_policy: str | None = None) -> dict[str, Any]:
    """One coordinator pod, non-root with a read-only root filesystem, probed for readiness
    on /readyz (its rounds can be decided now) and for liveness on /healthz (its loop answers)."""
    name = job_name(job)
    container: dict[str, Any] = {
        "name": "coordinator",
        "image": image,
        "command": coordinator_command(job),
        "ports": [{"name": "http", "containerPort": naming.COORDINATOR_PORT, "protocol": "TCP"}],
        "env": [
            {"name": contract.ENV_JOB, "value": name},
            {"name": contract.ENV_NAMESPACE, "value": job_namespace(job)},
            {"name": contract.ENV_COORDINATOR_TOKEN, "valueFrom": {"secretKeyRef": {
                "name": naming.coordinator_token_secret(name), "key": naming.TOKEN_KEY}}},
        ],
        **copy.deepcopy(COORDINATOR_PROBES),
        "resources": copy.deepcopy(COORDINATOR_RESOURCES),
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # Python writes nothing but may want a scratch directory.
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    if image_pull_policy:
        container["imagePullPolicy"] = image_pull_policy
    labels = coordinator_labels(job)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": owned_metadata(job, naming.coordinator(name), COMPONENT_COORDINATOR),
        "spec": {
            "replicas": 1,
            # Never two coordinators of one job at once in a roll: they would hand out two
            # quorums. (On a lost node the ReplicaSet does not wait for the old pod: the
            # tolerations above, and docs/operator.md "When the coordinator's node is lost".)
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": {**labels, LABEL_MANAGED_BY: MANAGED_BY}},
                "spec": {
                    "serviceAccountName": naming.coordinator(name),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": COORDINATOR_UID,
                        "runAsGroup": COORDINATOR_UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "tolerations": coordinator_tolerations(),
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": COORDINATOR_SCRATCH}}],
                },
            },
        },
    }


def coordinator_resources(job: api.TrainingJob, token: str, image: str,
                          image_pull_policy: str | None = None, peer_token: str | None = None) -> list[dict[str, Any]]:
    """Everything the job's coordinator and its workers need but their pods and the token
    review binding, in an order in which creating them works. The workers' ServiceAccount
    and Secret come before the Deployment, whose existence tells a pass that all of them are
    there (controller.py): the API server refuses a pod whose ServiceAccount does not exist,
    and the kubelet does not start one whose Secret is missing."""
    return [
        coordinator_secret(job, token),
        # Random, never derived from `token`: every worker holds the peer token.
        peer_secret(job, peer_token or secrets.token_urlsafe(32)),
        worker_service_account(job),
        coordinator_service_account(job),
        coordinator_role(job),
        coordinator_role_binding(job),
        coordinator_service(job),
        coordinator_deployment(job, image, image_pull_policy),
    ]
