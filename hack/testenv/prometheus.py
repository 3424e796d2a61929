"""A real Prometheus in the test environment, configured from the chart as a Prometheus
operator would configure it.

Prometheus (built from its Go module, image from images.py) runs as a pod on a real node,
discovers targets through Kubernetes service discovery (role `endpoints`, its own
ServiceAccount) and evaluates the chart's alerts. Its configuration is not written by hand:
`helm template` renders the chart with the ServiceMonitors and the PrometheusRule on, and
`scrape_configs` turns each ServiceMonitor into the scrape job the Prometheus operator would
generate for it (namespaces, the Service's labels, the endpoint's port name and path, and
the target labels `namespace`, `service`, `pod`, `job` = the Service's name), so that the
dashboard's and the alerts' selectors are tested against what a real installation labels.

Two settings differ from the chart's defaults, because an e2e run lasts minutes: every
scrape and evaluation every SCRAPE_INTERVAL, and the alerts rendered with RULE_VALUES
(TransomReplicaRestartLoop at two failures, which the e2e demo's kill and pod deletion make).
Queries reach it from the host through the API server's service proxy (QUERY_PATH).
"""

from __future__ import annotations

import yaml

from testenv.tools import render_chart

NAMESPACE = "transom-monitoring"
NAME = "prometheus"
PORT = 9090
SCRAPE_INTERVAL = "5s"
# The chart's release as the tests install it (hack/e2e_demo.py), so that the rendered
# ServiceMonitors select the operator's Service by the labels it will have.
RELEASE, RELEASE_NAMESPACE = "transom", "transom-system"
RULE_VALUES = ("metrics.prometheusRule.failuresPerHour=2",)
QUERY_PATH = f"/api/v1/namespaces/{NAMESPACE}/services/{NAME}:{PORT}/proxy"


def rendered_chart() -> list[dict]:
    """The chart's objects with its ServiceMonitors and PrometheusRule on (RULE_VALUES)."""
    sets = ["metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.enabled=true", *RULE_VALUES]
    return render_chart(*[a for s in sets for a in ("--set", s)], namespace=RELEASE_NAMESPACE, release=RELEASE)


def _label_keep(label: str, value: str) -> dict:
    """Keep targets whose Service has `label` = `value` (Prometheus sanitises label names)."""
    meta = "".join(c if c.isalnum() else "_" for c in label)
    return {"source_labels": [f"__meta_kubernetes_service_label_{meta}"], "regex": value, "action": "keep"}


def scrape_job(monitor: dict, endpoint_index: int = 0) -> dict:
    """The scrape job the Prometheus operator generates for one ServiceMonitor endpoint."""
    spec, meta = monitor["spec"], monitor["metadata"]
    endpoint = spec["endpoints"][endpoint_index]
    selector = spec.get("namespaceSelector") or {}
    sd: dict = {"role": "endpoints"}
    if not selector.get("any"):
        sd["namespaces"] = {"names": selector.get("matchNames") or [meta["namespace"]]}
    relabel = [_label_keep(k, v) for k, v in sorted(spec["selector"].get("matchLabels", {}).items())]
    relabel += [
        {"source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": endpoint["port"], "action": "keep"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
    ]
    return {"job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{endpoint_index}",
            "scrape_interval": SCRAPE_INTERVAL, "metrics_path": endpoint.get("path", "/metrics"),
            "kubernetes_sd_configs": [sd], "relabel_configs": relabel}


def config(chart: list[dict]) -> tuple[dict, dict]:
    """prometheus.yml and the rules file, from the rendered chart."""
    monitors = [d for d in chart if d["kind"] == "ServiceMonitor"]
    [rule] = [d for d in chart if d["kind"] == "PrometheusRule"]
    if not monitors:
        raise RuntimeError("the chart rendered no ServiceMonitor")
    prometheus = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": ["/etc/prometheus/rules.yaml"],
        "scrape_configs": [scrape_job(m, i) for m in monitors for i in range(len(m["spec"]["endpoints"]))],
    }
    return prometheus, {"groups": rule["spec"]["groups"]}


def manifests(image: str) -> list[dict]:
    """Namespace, RBAC for discovery, the configuration and the Prometheus Deployment and Service."""
    prometheus, rules = config(rendered_chart())
    meta = {"name": NAME, "namespace": NAMESPACE}
    labels = {"app.kubernetes.io/name": NAME}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "transom-prometheus"},
         "rules": [{"apiGroups": [""], "resources": ["services", "endpoints", "pods", "namespaces"],
                    "verbs": ["get", "list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "transom-prometheus"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "transom-prometheus"},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
         "data": {"prometheus.yml": yaml.safe_dump(prometheus, sort_keys=False),
                  "rules.yaml": yaml.safe_dump(rules, sort_keys=False)}},
        _deployment(image, meta, labels),
        {"apiVersion": "v1", "kind": "Service", "metadata": {**meta, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "web", "port": PORT, "targetPort": "web"}]}},
    ]


def _deployment(image: str, meta: dict, labels: dict) -> dict:
    container = {
        "name": NAME, "image": image, "imagePullPolicy": "Never",
        "args": ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus",
                 "--storage.tsdb.retention.time=6h", f"--web.listen-address=:{PORT}"],
        "ports": [{"name": "web", "containerPort": PORT}],
        "readinessProbe": {"httpGet": {"path": "/-/ready", "port": "web"}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/-/healthy", "port": "web"}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/prometheus", "readOnly": True},
                         {"name": "data", "mountPath": "/prometheus"}],
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"serviceAccountName": NAME,
                         "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "fsGroup": 65532,
                                             "seccompProfile": {"type": "RuntimeDefault"}},
                         "containers": [container],
                         "volumes": [{"name": "config", "configMap": {"name": NAME}},
                                     {"name": "data", "emptyDir": {"sizeLimit": "1Gi"}}]}}}}
