"""Prometheus metrics of the operator (prefix `transom_operator_`, bounded labels only)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from transom import contract
from transom_operator import reasons

REGISTRY = CollectorRegistry()
JOBS = Gauge("transom_operator_jobs", "TrainingJobs by state", ["state"], registry=REGISTRY)
REPLICA_FAILURES = Counter(
    "transom_operator_replica_failures",
    "Replica failures detected, by reason (an OOMKilled one also when its launcher restarted it in place)",
    ["reason"], registry=REGISTRY,
)
# Every reason exported from the start at 0: a series that appears only with its first
# failure would hide that failure from increase() and rate().
for _reason in reasons.FAILURE_REASONS:
    REPLICA_FAILURES.labels(_reason)
JOB_FAILURES = Counter(
    "transom_operator_job_failures", "TrainingJobs that became Failed, by the Failed condition's reason", ["reason"],
    registry=REGISTRY,
)
for _job_reason in (reasons.TOO_MANY_RESTARTS, reasons.SCRIPT_ERROR, reasons.OOM_KILLED):
    JOB_FAILURES.labels(_job_reason)
PREFLIGHT_FAILURES = Counter(
    "transom_operator_preflight_failures",
    "Pods (replicas' and spares') whose pre-flight checks failed, by the check that failed",
    ["check"], registry=REGISTRY,
)
for _check in contract.PREFLIGHT_CHECKS:
    PREFLIGHT_FAILURES.labels(_check)
REPLACEMENTS = Counter("transom_operator_replacements", "Replica incarnations replaced", registry=REGISTRY)
SPARE_PROMOTIONS = Counter(
    "transom_operator_spare_promotions", "Failed replicas taken over by a hot spare", registry=REGISTRY
)
REPLACEMENT_SECONDS = Histogram(
    "transom_operator_replacement_seconds",
    "From a replica failure detected to all of its replacement pods Running",
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "transom_operator_reconcile_seconds", "Duration of one reconcile pass of one job",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=REGISTRY,
)
IS_LEADER = Gauge("transom_operator_leader", "1 while this operator instance holds the lease", registry=REGISTRY)
API_REQUESTS = Counter("transom_operator_api_requests", "Requests the operator sent to the API server",
                       registry=REGISTRY)
