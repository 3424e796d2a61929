"""Deterministic names of the objects the operator creates for a TrainingJob.

Every child's name is a function of the job's name and the child's identity, so that a
restarted operator finds what an earlier one created (and a create that answers 409 means
the object is already there). Job names are at most `api.MAX_JOB_NAME` (40) characters, so
the names below stay within a DNS label (63) for any realistic replica, node rank and
generation; a name that would not fit raises ValueError rather than being truncated into a
collision.
"""

from __future__ import annotations

DNS_LABEL_MAX = 63
COORDINATOR_PORT = 8080
TOKEN_KEY = "token"  # key of the token in the coordinator's Secret


def _label(name: str) -> str:
    if len(name) > DNS_LABEL_MAX:
        raise ValueError(f"name {name!r} must be at most {DNS_LABEL_MAX} characters")
    return name


def _check_ids(**ids: int) -> None:
    for what, value in ids.items():
        if value < 0:
            raise ValueError(f"{what} must not be negative, got {value}")


def worker_pod(job: str, replica: int, node_rank: int, generation: int) -> str:
    """Pod `node_rank` of incarnation `generation` of data-parallel replica `replica`."""
    _check_ids(replica=replica, node_rank=node_rank, generation=generation)
    return _label(f"{job}-r{replica}-n{node_rank}-g{generation}")


def spare_pod(job: str, spare: int, node_rank: int, generation: int) -> str:
    """Pod `node_rank` of hot spare `spare` (incarnation `generation`)."""
    _check_ids(spare=spare, node_rank=node_rank, generation=generation)
    return _label(f"{job}-s{spare}-n{node_rank}-g{generation}")


def coordinator(job: str) -> str:
    """The coordinator's Deployment, Service, ServiceAccount, Role and RoleBinding."""
    return _label(f"{job}-coordinator")


def worker_service_account(job: str) -> str:
    """The ServiceAccount every worker and spare pod runs as: no Role, no token mounted."""
    return _label(f"{job}-worker")


def coordinator_token_secret(job: str) -> str:
    """The Secret holding the job's bearer token (key `TOKEN_KEY`)."""
    return _label(f"{job}-coordinator-token")


def peer_token_secret(job: str) -> str:
    """The Secret holding the token of the replicas' state servers (key `TOKEN_KEY`)."""
    return _label(f"{job}-peer-token")


def token_review_binding(namespace: str, job: str) -> str:
    """The ClusterRoleBinding that lets the job's coordinator review its pods' tokens; a
    cluster-wide name, so it carries the namespace (at most 63 + 40 + 23 characters)."""
    return f"transom-{namespace}-{job}-token-review"


def network_policy(job: str) -> str:
    """The NetworkPolicy that admits only the job's own pods to the job's pods."""
    return _label(f"{job}-isolation")


def disruption_budget(job: str) -> str:
    """The PodDisruptionBudget of the job's replica pods (disruption.py)."""
    return _label(f"{job}-workers")


def coordinator_url(job: str, namespace: str, port: int = COORDINATOR_PORT) -> str:
    """How pods in the cluster reach the job's coordinator (its ClusterIP Service)."""
    return f"http://{coordinator(job)}.{namespace}.svc:{port}"
