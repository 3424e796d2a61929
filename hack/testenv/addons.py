"""What a cluster with real nodes needs beyond the control plane, as manifests.

- EndpointSlices for the `kubernetes` Service (the API server runs with
  `--endpoint-reconciler-type=none`, its only address being the host's loopback): pods
  reach it at the forwarder's address inside their node's namespace.
- CoreDNS (built from its Go module, image from images.py) as `kube-dns` at
  CLUSTER_DNS_IP, with the RBAC of the upstream manifest, so pods find Services by name.
- A selectorless `s3` Service in namespace `transom-testenv` for the S3 server on the host:
  checkpoints go to `http://s3.transom-testenv.svc.cluster.local`.
"""

from __future__ import annotations

from testenv import network, nodes

TESTENV_NAMESPACE = "transom-testenv"
S3_SERVICE_PORT = 80
S3_FORWARD_PORT = 8333  # the forwarder's port for S3 inside every node's namespace
S3_URL_IN_CLUSTER = f"http://s3.{TESTENV_NAMESPACE}.svc.cluster.local"
COREFILE = """.:1053 {
    errors
    health :8080
    ready :8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
    loadbalance
}
"""


def _endpoint_slice(namespace: str, service: str, port_name: str, port: int) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": service, "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service,
                                "endpointslice.kubernetes.io/managed-by": "transom-testenv"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [network.SERVICES_IP], "conditions": {"ready": True}}],
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def host_services() -> list[dict]:
    return [
        _endpoint_slice("default", "kubernetes", "https", nodes.API_PORT_IN_NODE),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TESTENV_NAMESPACE}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s3", "namespace": TESTENV_NAMESPACE},
         "spec": {"ports": [{"name": "http", "port": S3_SERVICE_PORT, "targetPort": S3_FORWARD_PORT}]}},
        _endpoint_slice(TESTENV_NAMESPACE, "s3", "http", S3_FORWARD_PORT),
    ]


def coredns(image: str, replicas: int = 1) -> list[dict]:
    """CoreDNS as a cluster runs it: with two or more real nodes, two replicas kept apart
    (a lost node does not take the job's name resolution with it)."""
    ns, name = "kube-system", "coredns"
    labels = {"k8s-app": "kube-dns"}
    meta = {"name": name, "namespace": ns}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "system:coredns"},
         "rules": [
             {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
              "verbs": ["list", "watch"]},
             {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"Corefile": COREFILE}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": labels},
         "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {
                 "serviceAccountName": name, "dnsPolicy": "Default",
                 "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                     "weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": labels},
                                                        "topologyKey": "kubernetes.io/hostname"}}]}},
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                     "seccompProfile": {"type": "RuntimeDefault"}},
                 "containers": [{
                     "name": "coredns", "image": image, "imagePullPolicy": "Never",
                     "args": ["-conf", "/etc/coredns/Corefile"],
                     "ports": [{"name": "dns", "containerPort": 1053, "protocol": "UDP"},
                               {"name": "dns-tcp", "containerPort": 1053, "protocol": "TCP"}],
                     "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 2},
                     "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}, "periodSeconds": 10},
                     "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
                     "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                         "capabilities": {"drop": ["ALL"]}},
                     "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
                 }],
                 "volumes": [{"name": "config", "configMap": {"name": name}}],
             }}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kube-dns", "namespace": ns, "labels": labels},
         "spec": {"clusterIP": nodes.CLUSTER_DNS_IP, "selector": labels, "ports": [
             {"name": "dns", "port": 53, "targetPort": 1053, "protocol": "UDP"},
             {"name": "dns-tcp", "port": 53, "targetPort": 1053, "protocol": "TCP"}]}},
    ]
