"""One reconcile pass of one TrainingJob: read the world, plan (pure), act, write status once.

This is the glue between `kube.py` (all I/O) and `reconcile/` (all decisions). It is
synchronous; the kopf daemon runs it in a worker thread. Every pass starts from the job, its
pods and the nodes as the watches last showed them (cache.py; the job never older than the
operator's own last write to it), so a pass interrupted anywhere (operator killed
mid-recovery) is simply repeated by the next one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import ValidationError

from transom import contract
from transom_operator import api, metrics, reasons
from transom_operator.cache import WatchCache
from transom_operator.kube import REQUEST_TIMEOUT_S, Kube
from transom_operator.provision import Provisioner
from transom_operator.queueing import Queueing
from transom_operator.reconcile import failures, job_status, replicas
from transom_operator.reconcile.observe import observe_node, observe_pod
from transom_operator.reconcile.status_diff import status_ops

log = logging.getLogger("transom.operator")
DEFAULT_REQUEUE_S = 10.0
# Pod writes of one pass in flight at once: a replica's 8 or 32 pods are replaced in about one
# round trip instead of one after another (the kubernetes client pools 10+ connections).
WRITE_CONCURRENCY = 16
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
    _writers: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(WRITE_CONCURRENCY, thread_name_prefix="transom-write"))

    def __post_init__(self) -> None:
        # The job's coordinator and the rest of what it needs besides its pods (provision.py).
        self.provisioner = Provisioner(self.kube, self.coordinator_image, self.network_policy,
                                       self.token_reviewer_role)
        self.queueing = Queueing(self.kube)  # the Workload of a job queued through Kueue

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
            self.provisioner.forget(namespace, name)
            return None
        self.provisioner.sweep_bindings()
        try:
            job = api.TrainingJob.model_validate(raw)
        except ValidationError as e:
            self._refuse(namespace, name, raw, spec_error(e))
            return DEFAULT_REQUEUE_S
        self.provisioner.ensure(namespace, job)
        queued = self.queueing.admission(namespace, job)  # None: not queued through Kueue
        # From the watches' cache (cache.py): a pass lists nothing, whatever the job's size, and
        # observes again only the pods that changed.
        pods = self.cache.pods(namespace, name, lambda: self.kube.list_pods(namespace, name), observe_pod)
        nodes = [observe_node(n) for n in self.cache.nodes(self.kube.list_nodes)]
        departed = self.cache.departed(namespace, name, observe_pod)  # why a pod that is gone went
        now = datetime.now(UTC)
        plan = replicas.plan(job, pods, nodes, now, departed, queued.admission if queued else None)

        # The pod creates go out with the status write, the deletes and relabels after it: a
        # replacement waits for no status write of tens of kilobytes (a 250-replica job's), and
        # an operator killed before the write leaves the failed incarnation's pods in place, on
        # which the next pass finds the failure again and records it (reconcile/replicas.py).
        # Only what changed is written (reconcile/status_diff.py), and nothing when nothing
        # did: most passes are woken by events that change nothing.
        t_plan = time.monotonic()
        policy = self._record(namespace, name, raw, job, plan)
        t_status = time.monotonic()
        self._act(namespace, pods, plan)
        t_act = time.monotonic()
        log.debug("%s/%s pass: read+plan %.3fs, status and %d creates %.3fs, %d deletes %d relabels %.3fs",
                  namespace, name, t_plan - t0, len(plan.create), t_status - t_plan, len(plan.delete),
                  len(plan.relabel), t_act - t_status)
        for node, reason in plan.excluded_nodes_added:
            self.kube.exclude_node(node, policy, reason)
        if queued is not None:
            self.queueing.settle(namespace, queued, plan.status.state, pods)
        self._observe(namespace, name, job, plan)
        self._set_state(namespace, name, plan.status.state)
        return plan.requeue_after if plan.requeue_after is not None else DEFAULT_REQUEUE_S

    def _record(self, namespace: str, name: str, raw: dict, job: api.TrainingJob, plan: replicas.Plan) -> str:
        """The plan's pod creates, its status write and its Events; the node exclusion policy
        the cluster admin allows for this job."""
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
        return policy

    def _refuse(self, namespace: str, name: str, raw: dict, message: str) -> None:
        """A job whose spec the models refuse (what the API server cannot check, such as the
        template's depth, or a spec stored before a rule existed): Ready False with reason
        InvalidSpec and a Warning Event, once per spec generation; nothing else is touched
        until the spec is changed, which wakes the daemon."""
        generation = raw["metadata"].get("generation")
        wanted = job_status.refused(raw.get("status"), message, generation, datetime.now(UTC))
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

    def _observe(self, namespace: str, name: str, job: api.TrainingJob, plan: replicas.Plan) -> None:
        before = {r.id: r for r in (job.status.replicas if job.status and job.status.replicas else [])}
        for r in plan.status.replicas or []:
            old = before.get(r.id)
            if old is not None and r.generation > old.generation and r.last_failure is not None:
                metrics.REPLICA_FAILURES.labels(r.last_failure.reason).inc()
                _count_preflight(r.last_failure)
                metrics.REPLACEMENTS.inc()
                self._replacing[(namespace, name, r.id, r.generation)] = time.monotonic()
            elif (old is not None and r.generation == old.generation and r.last_failure is not None
                  and r.last_failure != old.last_failure and r.last_failure.reason == reasons.OOM_KILLED):
                metrics.REPLICA_FAILURES.labels(reasons.OOM_KILLED).inc()  # restarted in place, or ended the job
            key = (namespace, name, r.id, r.generation)
            if r.state == api.ReplicaPhase.RUNNING and key in self._replacing:
                metrics.REPLACEMENT_SECONDS.observe(time.monotonic() - self._replacing.pop(key))
        spares_before = {s.id: s for s in (job.status.spares if job.status and job.status.spares else [])}
        for s in plan.status.spares or []:
            old_spare = spares_before.get(s.id)
            if s.last_failure is not None and (old_spare is None or old_spare.last_failure != s.last_failure):
                _count_preflight(s.last_failure)
        was = job.status.state if job.status else None
        failed = next((c for c in plan.status.conditions if c.type == "Failed"), None)
        failed_now = plan.status.state == api.JobState.FAILED and was != api.JobState.FAILED
        if failed_now and failed is not None and failed.reason:
            metrics.JOB_FAILURES.labels(failed.reason).inc()

    def _set_state(self, namespace: str, name: str, state: str | None) -> None:
        if state is None:
            self._states.pop((namespace, name), None)
        else:
            self._states[(namespace, name)] = state
        for s in api.JobState:
            metrics.JOBS.labels(s).set(sum(1 for v in self._states.values() if v == s))


def _count_preflight(failure: api.Failure) -> None:
    if failure.reason == reasons.PREFLIGHT_FAILED:
        for check in failures.preflight_checks(failure.message or ""):
            metrics.PREFLIGHT_FAILURES.labels(check).inc()


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
