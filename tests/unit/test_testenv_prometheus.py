"""The test environment's Prometheus is configured from the chart as the Prometheus operator
would configure it (hack/testenv/prometheus.py): each ServiceMonitor becomes a scrape job
that keeps the Services it selects, on its port, in its namespaces, with the target labels
the dashboard and the alerts select on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

from testenv import prometheus  # noqa: E402


def monitor(namespace_selector: dict | None) -> dict:
    spec = {"selector": {"matchLabels": {"app.kubernetes.io/component": "coordinator",
                                         "app.kubernetes.io/managed-by": "transom-operator"}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "30s"}]}
    if namespace_selector is not None:
        spec["namespaceSelector"] = namespace_selector
    return {"kind": "ServiceMonitor", "metadata": {"name": "transom-operator-coordinators",
                                                   "namespace": "transom-system"}, "spec": spec}


def test_a_service_monitor_becomes_the_scrape_job_the_prometheus_operator_makes():
    job = prometheus.scrape_job(monitor({"any": True}))
    assert job["job_name"] == "serviceMonitor/transom-system/transom-operator-coordinators/0"
    assert job["kubernetes_sd_configs"] == [{"role": "endpoints"}]  # every namespace
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert keeps == {("__meta_kubernetes_service_label_app_kubernetes_io_component",): "coordinator",
                     ("__meta_kubernetes_service_label_app_kubernetes_io_managed_by",): "transom-operator",
                     ("__meta_kubernetes_endpoint_port_name",): "http"}
    targets = {r["target_label"]: r.get("source_labels") for r in job["relabel_configs"] if "target_label" in r}
    assert targets["namespace"] == ["__meta_kubernetes_namespace"]
    assert targets["service"] == targets["job"] == ["__meta_kubernetes_service_name"]


def test_its_namespaces_are_the_listed_ones_or_its_own():
    listed = prometheus.scrape_job(monitor({"matchNames": ["ml", "research"]}))
    assert listed["kubernetes_sd_configs"] == [{"role": "endpoints", "namespaces": {"names": ["ml", "research"]}}]
    own = prometheus.scrape_job(monitor(None))
    assert own["kubernetes_sd_configs"] == [{"role": "endpoints", "namespaces": {"names": ["transom-system"]}}]


def test_the_configuration_needs_a_monitor_and_takes_the_rules_as_they_are():
    rule = {"kind": "PrometheusRule", "spec": {"groups": [{"name": "g", "rules": []}]}}
    config, rules = prometheus.config([monitor({"any": True}), rule])
    assert rules == {"groups": [{"name": "g", "rules": []}]}
    assert config["global"]["scrape_interval"] == prometheus.SCRAPE_INTERVAL
    assert len(config["scrape_configs"]) == 1
    with pytest.raises(RuntimeError, match="no ServiceMonitor"):
        prometheus.config([rule])
