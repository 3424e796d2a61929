"""What a TrainingJob needs besides its replicas' pods: its coordinator (Deployment, Service,
token Secret), the replicas' ServiceAccount, peer Secret and disruption budget, its
NetworkPolicy, and the cluster-wide binding that lets its coordinator review tokens.

Made once and checked again only when the spec changed or every COORDINATOR_RECHECK_S, not
on every reconcile pass (controller.py); every create is idempotent (a 409 is success).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from transom import contract
from transom_operator import api, disruption, naming, resources
from transom_operator.kube import Kube

log = logging.getLogger("transom.operator")
COORDINATOR_RECHECK_S = 30.0
SWEEP_EVERY_S = 600.0


@dataclass
class Provisioner:
    kube: Kube
    coordinator_image: str
    network_policy: bool  # give every job a NetworkPolicy that admits only its own pods
    token_reviewer_role: str  # the ClusterRole that lets a coordinator create TokenReviews
    # Per job: (metadata.generation, when) the coordinator was last checked against the spec.
    checked: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    # Jobs whose worker ServiceAccount, peer Secret and token review binding this process
    # created or found (once per job and process).
    worker_accounts: set[tuple[str, str]] = field(default_factory=set)
    _swept_at: float | None = None  # when token review bindings of deleted jobs were last looked for

    def forget(self, namespace: str, name: str) -> None:
        """A job deleted: what it owns goes with it (ownerReferences), but not its cluster-wide
        binding, which cannot be owned."""
        self.checked.pop((namespace, name), None)
        self.worker_accounts.discard((namespace, name))
        self.kube.delete_cluster_role_binding(naming.token_review_binding(namespace, name))

    def ensure(self, namespace: str, job: api.TrainingJob) -> None:
        """Create the job's coordinator and its replicas' disruption budget, or roll the coordinator
        and resize the budget when the spec changed what they follow. Read again when the spec
        changed (metadata.generation) or every COORDINATOR_RECHECK_S (one deleted by hand comes
        back), not on every pass."""
        name = job.metadata["name"]
        key, generation = (namespace, name), job.metadata.get("generation", 0)
        checked = self.checked.get(key)
        if checked is not None and checked[0] == generation and time.monotonic() - checked[1] < COORDINATOR_RECHECK_S:
            return
        self._ensure_coordinator_now(namespace, job)
        self._ensure_budget(namespace, job)
        self.checked[key] = (generation, time.monotonic())

    def _ensure_budget(self, namespace: str, job: api.TrainingJob) -> None:
        """The replicas' PodDisruptionBudget (disruption.py): created where it is missing (a new
        job, one from before budgets, one deleted by hand), patched when the job's size changed.
        A budget only holds drains back, so failing to make one (an installation whose RBAC is
        older than budgets) is logged and tried again at the next check, and never stops the
        pass that replaces the job's replicas."""
        wanted = disruption.worker_budget(job)
        name = wanted["metadata"]["name"]
        try:
            current = self.kube.get_disruption_budget(namespace, name)
            if current is None:
                self.kube.create(namespace, wanted)
            elif (patch := disruption.spec_patch(current, wanted)) is not None:
                self.kube.patch_disruption_budget(namespace, name, patch)
                log.info("%s/%s: disruption budget %s now %s", namespace, job.metadata["name"], name, patch["spec"])
        except Exception as e:
            log.warning("%s/%s: could not make the disruption budget %s: %s", namespace, job.metadata["name"], name, e)

    def _ensure_coordinator_now(self, namespace: str, job: api.TrainingJob) -> None:
        name = job.metadata["name"]
        deployment = self.kube.get_deployment(namespace, naming.coordinator(name))
        if deployment is not None and (namespace, name) not in self.worker_accounts:
            # A job from before the workers had a ServiceAccount, a peer Secret and an
            # identity of their own: their pods would be refused or unknown without them (a
            # 409 means it is there). Its coordinator rolls below: its command changed.
            account_and_secret = (resources.worker_service_account(job),
                                  resources.peer_secret(job, secrets.token_urlsafe(32)))
            for manifest in account_and_secret:
                self.kube.create(namespace, manifest)
            self.kube.create(None, resources.token_review_binding(job, self.token_reviewer_role))
            self.worker_accounts.add((namespace, name))
        if deployment is not None:
            # A spec change the coordinator must know (replicas, minReplicas, heartbeat
            # timeout) rolls it; the replicas register again with the new one on their own.
            want = resources.coordinator_command(job)
            containers = deployment["spec"]["template"]["spec"]["containers"]
            current = next((c for c in containers if c["name"] == "coordinator"), None)
            if current is not None and current.get("command") != want:
                self.kube.set_container_command(namespace, naming.coordinator(name), "coordinator", want)
                log.info("%s/%s: coordinator settings changed; rolling it", namespace, name)
            tolerations = with_node_loss_tolerations(deployment["spec"]["template"]["spec"].get("tolerations"))
            if tolerations is not None:  # a coordinator from before them: it would wait 300 s on a lost node
                self.kube.set_tolerations(namespace, naming.coordinator(name), tolerations)
                log.info("%s/%s: coordinator tolerations of a lost node set; rolling it", namespace, name)
            return
        # A fresh token only matters if the Secret does not exist yet: a 409 keeps the old one.
        # The policy comes first, so no pod of the job is ever reachable from outside it.
        manifests = [resources.network_policy(job)] if self.network_policy else []
        manifests += resources.coordinator_resources(job, secrets.token_urlsafe(32), self.coordinator_image,
                                                     peer_token=secrets.token_urlsafe(32))
        # Before the Deployment: a coordinator that cannot review tokens refuses every replica.
        self.kube.create(None, resources.token_review_binding(job, self.token_reviewer_role))
        for manifest in manifests:
            self.kube.create(namespace, manifest)
        self.worker_accounts.add((namespace, name))

    def sweep_bindings(self) -> None:
        """Delete the token review bindings of jobs that are gone: a job deleted while no
        operator ran left its binding behind (it has no owner to be collected with). At most
        every SWEEP_EVERY_S, from whichever job's pass comes first."""
        now = time.monotonic()
        if self._swept_at is not None and now - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = now
        selector = f"{resources.LABEL_COMPONENT}={resources.COMPONENT_TOKEN_REVIEW}"
        for binding in self.kube.list_cluster_role_bindings(selector):
            labels = binding["metadata"].get("labels") or {}
            namespace, job = labels.get(resources.LABEL_NAMESPACE), labels.get(contract.LABEL_JOB)
            if not (namespace and job):
                continue
            try:
                gone = self.kube.get_job(namespace, job) is None
            except Exception as e:  # a namespace this operator does not watch: another one's to sweep
                log.debug("not sweeping %s: %s", binding["metadata"]["name"], e)
                continue
            if gone:
                log.info("deleting %s: job %s/%s is gone", binding["metadata"]["name"], namespace, job)
                self.kube.delete_cluster_role_binding(binding["metadata"]["name"])


def with_node_loss_tolerations(current: list[dict] | None) -> list[dict] | None:
    """The coordinator template's tolerations with resources.coordinator_tolerations() in place of
    any of the same taint; None when they are there already. Others are kept (an admin's, a
    webhook's), so that nothing is patched back and forth."""
    ours = resources.coordinator_tolerations()
    current = list(current or [])
    if all(t in current for t in ours):
        return None
    keys = {t["key"] for t in ours}
    return [t for t in current if t.get("key") not in keys] + ours
