"""One reconcile pass of one TrainingJob: read the world, plan (pure), act, write status once.

This is the glue between `kube.py` (all I/O) and `reconcile/` (all decisions). It is
synchronous; the kopf daemon runs it in a worker thread. Every pass starts from the job, its
pods and the nodes as the watches last showed them (cache.py; the job never older than the
operator's own last write to it), so a pass interrupted anywhere (operator killed
mid-recovery) is simply repeated by the next one.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from datetime import datetime, timezone

from pydantic import ValidationError

from transom import contract

from transom_operator import api, disruption, metrics, naming, reasons, resources
from transom_operator.cache import WatchCache
from transom_operator.kube import REQUEST_TIMEOUT_S, Kube
from transom_operator.reconcile import failures, job_status, replicas
from transom_operator.reconcile.observe import observe_node, observe_pod
from transom_operator.reconcile.status_diff import status_ops

log = logging.getLogger("transom.operator")
DEFAULT_REQUEUE_S = 10.0
# Pod writes of one pass in flight at once: a replica's 8 or 32 pods are replaced in about one
# round trip instead of one after another (the kubernetes client pools 10+ connections).
WRITE_CONCURRENCY = 16
COORDINATOR_RECHECK_S = 30.0
SWEEP_EVERY_S = 600.0
# Past any write's own end: kube.REQUEST_TIMEOUT_S per attempt, and urllib3 tries an idempotent
# request (a delete) up to four times.
WRITE_TIMEOUT_S = 4 * sum(REQUEST_TIMEOUT_S) + 5.0


@dataclass
class Controller:
    kube: Kube
    coordinator_image: str
    # What the cluster admin allows beyond excluding a node for one job (failures.NODE_ACTIONS).
    node_actions: frozenset[str] = frozenset()
    network_policy: bool = True  # give every job a NetworkPolicy that admits only its own pods
    # The chart's ClusterRole that lets a coordinator create TokenReviews (its pods' identities).
    token_reviewer_role: str = "transom-operator-token-reviewer"
    cache: WatchCache = field(default_factory=WatchCache)  # fed by the pod and node watches (handlers.py)
    # (namespace, job, replica, generation) -> monotonic time its predecessor's failure was seen
    _replacing: dict[tuple[str, str, int, int], float] = field(default_factory=dict)
    _states: dict[tuple[str, str], str] = field(default_factory=dict)
    # Per job: (metadata.generation, when) the coordinator was last checked against the spec.
    _coordinator_checked: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    # Jobs whose worker ServiceAccount, peer Secret and token review binding this process
    # created or found (once per job and process).
    _worker_accounts: set[tuple[str, str]] = field(default_factory=set)
    _swept_at: float | None = None  # when token review bindings of deleted jobs were last looked for
    _writers: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(WRITE_CONCURRENCY, thread_name_prefix="transom-write"))

    def close(self) -> None:
        """Stop the write threads (main.py, when kopf has stopped every daemon)."""
        self._writers.shutdown(wait=True, cancel_futures=True)

    def reconcile(self, namespace: str, name: str) -> float | None:
        """Returns seconds until the next pass is due (None: the job is gone)."""
        t0 = time.monotonic()
        try:
            return self._reconcile(namespace, name)
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - t0)

    def _reconcile(self, namespace: str, name: str) -> float | None:
        t0 = time.monotonic()
        raw = self.cache.job(namespace, name, lambda: self.kube.get_job(namespace, name))
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            self._set_state(namespace, name, None)
            self.cache.forget_job(namespace, name)
            self._coordinator_checked.pop((namespace, name), None)
            self._worker_accounts.discard((namespace, name))
            # Owned objects go with it (ownerReferences); the one cluster-wide object cannot be owned.
            self.kube.delete_cluster_role_binding(naming.token_review_binding(namespace, name))
            return None
        self._sweep_bindings()
        try:
            job = api.TrainingJob.model_validate(raw)
        except ValidationError as e:
            self._refuse(namespace, name, raw, spec_error(e))
            return DEFAULT_REQUEUE_S
        self._ensure_coordinator(namespace, job)
        # From the watches' cache (cache.py): a pass lists nothing, whatever the job's size, and
        # observes again only the pods that changed.
        pods = self.cache.pods(namespace, name, lambda: self.kube.list_pods(namespace, name), observe_pod)
        nodes = [observe_node(n) for n in self.cache.nodes(self.kube.list_nodes)]
        departed = self.cache.departed(namespace, name, observe_pod)  # why a pod that is gone went
        now = datetime.now(timezone.utc)
        plan = replicas.plan(job, pods, nodes, now, departed)

        # The pod creates go out with the status write, the deletes and relabels after it: a
        # replacement waits for no status write of tens of kilobytes (a 250-replica job's), and
        # an operator killed before the write leaves the failed incarnation's pods in place, on
        # which the next pass finds the failure again and records it (reconcile/replicas.py).
        # Only what changed is written (reconcile/status_diff.py), and nothing when nothing
        # did: most passes are woken by events that change nothing.
        t_plan = time.monotonic()
        creates = [self._writers.submit(self.kube.create, namespace, manifest) for manifest in plan.create]
        ops = status_ops(raw.get("status"), plan.status_patch())
        try:
            if ops:
                self.cache.wrote_job(self.kube.patch_job_status(namespace, name, ops))
        except Exception:
            self.cache.drop_job(namespace, name)  # e.g. a `test` failed: read it afresh
            wait_all(creates, timeout=WRITE_TIMEOUT_S)  # every write of the pass ends with it
            raise
        # The Events tell what the status now records, so they go out once it is written and
        # before anything that can fail or be cut short: a pass that did not get this far is
        # recorded again by the next one (with its Events), and one that did is not, so an
        # operator killed in its deletes (a new leader finishing them) posts nothing twice.
        policy, refused = failures.node_action(job.spec.fault_tolerance.node_exclusion_policy, self.node_actions)
        if refused and plan.excluded_nodes_added:
            plan.events.append((reasons.WARNING, reasons.EVENT_NODE_ACTION_NOT_ALLOWED, refused))
        for type_, reason, message in plan.events:
            self.kube.event(raw, type_, reason, message)
            log.info("%s/%s: %s", namespace, name, message)
        _first_error(creates)
        t_status = time.monotonic()
        self._act(namespace, pods, plan)
        t_act = time.monotonic()
        log.debug("%s/%s pass: read+plan %.3fs, status and %d creates %.3fs, %d deletes %d relabels %.3fs",
                  namespace, name, t_plan - t0, len(plan.create), t_status - t_plan, len(plan.delete),
                  len(plan.relabel), t_act - t_status)
        for node, reason in plan.excluded_nodes_added:
            self.kube.exclude_node(node, policy, reason)
        self._observe(namespace, name, job, plan)
        self._set_state(namespace, name, plan.status.state)
        return plan.requeue_after if plan.requeue_after is not None else DEFAULT_REQUEUE_S

    def _refuse(self, namespace: str, name: str, raw: dict, message: str) -> None:
        """A job whose spec the models refuse (what the API server cannot check, such as the
        template's depth, or a spec stored before a rule existed): Ready False with reason
        InvalidSpec and a Warning Event, once per spec generation; nothing else is touched
        until the spec is changed, which wakes the daemon."""
        generation = raw["metadata"].get("generation")
        wanted = job_status.refused(raw.get("status"), message, generation, datetime.now(timezone.utc))
        ops = status_ops(raw.get("status") if isinstance(raw.get("status"), dict) else None, wanted)
        if not ops:
            return  # reported already
        try:
            self.cache.wrote_job(self.kube.patch_job_status(namespace, name, ops))
        except Exception:
            self.cache.drop_job(namespace, name)
            raise
        self.kube.event(raw, reasons.WARNING, reasons.INVALID_SPEC, message)
        log.warning("%s/%s: %s", namespace, name, message)

    def _act(self, namespace: str, pods: list, plan: replicas.Plan) -> None:
        """The plan's relabels and deletes (once its status is written), all at once: they touch
        distinct pods, so none waits for another. The first failure is raised after every write
        was tried; the next pass repeats what is missing (every write is idempotent)."""
        dead_nodes = {n for n, _ in plan.excluded_nodes_added}
        on_dead_node = {p.name for p in pods if p.node_name in dead_nodes}
        writes: list[Callable[[], object]] = [
            # A spare's pods become the replica's by their labels; a pod gone meanwhile leaves a
            # rank missing, which the next pass creates like any replacement pod.
            *(lambda pod=pod, labels=labels: self._relabel(namespace, pod, labels) for pod, labels in plan.relabel),
            *(lambda pod=pod: self.kube.delete_pod(namespace, pod, force=pod in on_dead_node) for pod in plan.delete),
        ]
        _first_error([self._writers.submit(w) for w in writes])
        metrics.SPARE_PROMOTIONS.inc(len({labels[contract.LABEL_REPLICA] for _, labels in plan.relabel}))

    def _relabel(self, namespace: str, pod: str, labels: dict[str, str | None]) -> None:
        """Relabel a pod and put the answer in the cache at once. The next pass must see the
        promoted spare's pods as the replica's: from the watch alone, a pass that ran before
        the event arrived took them for stale spare pods, deleted them and started the
        replica afresh (the race that once cost a hot spare its takeover)."""
        patched = self.kube.patch_pod_labels(namespace, pod, labels)
        if patched is not None:
            self.cache.pod_event("MODIFIED", patched)

    def _ensure_coordinator(self, namespace: str, job: api.TrainingJob) -> None:
        """Create the job's coordinator and its replicas' disruption budget, or roll the coordinator
        and resize the budget when the spec changed what they follow. Read again when the spec
        changed (metadata.generation) or every COORDINATOR_RECHECK_S (one deleted by hand comes
        back), not on every pass."""
        name = job.metadata["name"]
        key, generation = (namespace, name), job.metadata.get("generation", 0)
        checked = self._coordinator_checked.get(key)
        if checked is not None and checked[0] == generation and time.monotonic() - checked[1] < COORDINATOR_RECHECK_S:
            return
        self._ensure_coordinator_now(namespace, job)
        self._ensure_budget(namespace, job)
        self._coordinator_checked[key] = (generation, time.monotonic())

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
        if deployment is not None and (namespace, name) not in self._worker_accounts:
            # A job from before the workers had a ServiceAccount, a peer Secret and an
            # identity of their own: their pods would be refused or unknown without them (a
            # 409 means it is there). Its coordinator rolls below: its command changed.
            for manifest in (resources.worker_service_account(job), resources.peer_secret(job, secrets.token_urlsafe(32))):
                self.kube.create(namespace, manifest)
            self.kube.create(None, resources.token_review_binding(job, self.token_reviewer_role))
            self._worker_accounts.add((namespace, name))
        if deployment is not None:
            # A spec change the coordinator must know (replicas, minReplicas, heartbeat
            # timeout) rolls it; the replicas register again with the new one on their own.
            want = resources.coordinator_command(job)
            containers = deployment["spec"]["template"]["spec"]["containers"]
            current = next((c for c in containers if c["name"] == "coordinator"), None)
            if current is not None and current.get("command") != want:
                self.kube.set_container_command(namespace, naming.coordinator(name), "coordinator", want)
                log.info("%s/%s: coordinator settings changed; rolling it", namespace, name)
            tolerations = _with_node_loss_tolerations(deployment["spec"]["template"]["spec"].get("tolerations"))
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
        self._worker_accounts.add((namespace, name))

    def _sweep_bindings(self) -> None:
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

    def _observe(self, namespace: str, name: str, job: api.TrainingJob, plan: replicas.Plan) -> None:
        before = {r.id: r for r in (job.status.replicas if job.status and job.status.replicas else [])}
        for r in plan.status.replicas or []:
            old = before.get(r.id)
            if old is not None and r.generation > old.generation and r.last_failure is not None:
                metrics.REPLICA_FAILURES.labels(r.last_failure.reason).inc()
                metrics.REPLACEMENTS.inc()
                self._replacing[(namespace, name, r.id, r.generation)] = time.monotonic()
            elif (old is not None and r.generation == old.generation and r.last_failure is not None
                  and r.last_failure != old.last_failure and r.last_failure.reason == reasons.OOM_KILLED):
                metrics.REPLICA_FAILURES.labels(reasons.OOM_KILLED).inc()  # restarted in place, or ended the job
            key = (namespace, name, r.id, r.generation)
            if r.state == "Running" and key in self._replacing:
                metrics.REPLACEMENT_SECONDS.observe(time.monotonic() - self._replacing.pop(key))
        was = job.status.state if job.status else None
        failed = next((c for c in plan.status.conditions if c.type == "Failed"), None)
        if plan.status.state == "Failed" and was != "Failed" and failed is not None and failed.reason:
            metrics.JOB_FAILURES.labels(failed.reason).inc()

    def _set_state(self, namespace: str, name: str, state: str | None) -> None:
        if state is None:
            self._states.pop((namespace, name), None)
        else:
            self._states[(namespace, name)] = state
        for s in ("Pending", "Running", "Degraded", "Recovering", "Succeeded", "Failed", "Suspended"):
            metrics.JOBS.labels(s).set(sum(1 for v in self._states.values() if v == s))


def _with_node_loss_tolerations(current: list[dict] | None) -> list[dict] | None:
    """The coordinator template's tolerations with resources.coordinator_tolerations() in place of
    any of the same taint; None when they are there already. Others are kept (an admin's, a
    webhook's), so that nothing is patched back and forth."""
    ours = resources.coordinator_tolerations()
    current = list(current or [])
    if all(t in current for t in ours):
        return None
    keys = {t["key"] for t in ours}
    return [t for t in current if t.get("key") not in keys] + ours


def spec_error(error: ValidationError, limit: int = 5) -> str:
    """What is wrong with a job, for its condition and Event: each error's place and message."""
    parts = [f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in error.errors()]
    more = f" (and {len(parts) - limit} more)" if len(parts) > limit else ""
    return "the operator cannot use this spec: " + "; ".join(parts[:limit]) + more


def _first_error(futures: list[Future]) -> None:
    """Wait for every write; raise the first failure (the next pass repeats what is missing)."""
    errors = [f.exception(timeout=WRITE_TIMEOUT_S) for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
