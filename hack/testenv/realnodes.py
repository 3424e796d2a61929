"""Bring the real nodes up beside the control plane, and take them down leaving no trace.

Order matters both ways. Up: record the host's state, create the namespaces, start the
forwarder (so kubelets reach the API server and the API server reaches them), then per
node containerd (images imported), kubelet and kube-proxy, then the cluster add-ons
(`kubernetes` endpoints, CoreDNS, the S3 Service, Prometheus, Kueue). Down: delete the pods while the
kubelets still run (so the CNI plugin and the volume manager undo their work), stop the
processes, kill what is left in the nodes' cgroups and namespaces, unmount, delete the
namespaces and cgroups, and put back the host's sysctls and paths.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from testenv import addons, build, certs, dockerfiles, hostguard, images, kueue, network, nodes, prometheus

SERVICES_IP = network.SERVICES_IP
S3_URL_IN_CLUSTER = addons.S3_URL_IN_CLUSTER
FORWARDER = Path(__file__).resolve().parent / "forward.py"
EGRESS_SOCKET = "egress.sock"
DRAIN_TIMEOUT_S = 60.0


def apiserver_flags(d: Path, ca: certs.CA, real_nodes: int) -> list[str]:
    """What the API server needs for real kubelets: the Node authorizer and NodeRestriction
    (each kubelet may touch only its own Node and pods), a client certificate for its
    calls to kubelets, and those calls routed through the forwarder (egress selector)."""
    if not real_nodes:
        return ["--authorization-mode=RBAC"]
    client = ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", organizations=("system:masters",))
    egress = d / "egress-selector.yaml"
    egress.write_text(f"""apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: HTTPConnect
    transport:
      uds:
        udsName: {d / EGRESS_SOCKET}
- name: controlplane
  connection:
    proxyProtocol: Direct
- name: etcd
  connection:
    proxyProtocol: Direct
""")
    return [
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        f"--kubelet-client-certificate={client.cert}", f"--kubelet-client-key={client.key}",
        "--kubelet-preferred-address-types=InternalIP", f"--egress-selector-config-file={egress}",
    ]


def up(d: Path, tools: dict, ca: certs.CA, count: int, api_port: int, s3_port: int, kubectl: list[str],
       start, kubeconfig, save, wait) -> list[str]:
    """Start `count` real nodes; their names. `start`, `kubeconfig`, `save` and `wait` are
    cluster.py's process starter, kubeconfig writer, state recorder and bounded wait."""
    if not count:
        return []
    save({"host": hostguard.record(), "real_nodes": [network.NodeNet(i).name for i in range(count)]})
    nets = [network.NodeNet(i) for i in range(count)]
    network.create(nets)
    forward = {
        "services_ip": SERVICES_IP, "proxy_socket": str(d / EGRESS_SOCKET),
        "listen": [{"port": nodes.API_PORT_IN_NODE, "target_port": api_port},
                   {"port": addons.S3_FORWARD_PORT, "target_port": s3_port}],
        "nodes": [{"netns": n.netns_path, "networks": n.networks} for n in nets],
    }
    (d / "forward.json").write_text(json.dumps(forward, indent=2))
    start("forwarder", [sys.executable, str(FORWARDER), str(d / "forward.json")])
    wait("forwarder", lambda: (d / EGRESS_SOCKET).exists(), 30)

    def kubeconfig_for(path, server, pair, user):
        return kubeconfig(path, server, ca.pair.cert, pair, user)

    paths = {}
    for n in nets:
        hostguard.make_cgroups(n.netns)
        paths[n.name] = nodes.write_configs(d, n, ca, kubeconfig_for, images.PAUSE_IMAGE)
        start(f"containerd-{n.name}", nodes.in_netns(n, nodes.containerd_argv(tools, paths[n.name])),
              exe=str(tools["containerd"]))
    load_images(d, count)
    for n in nets:
        start(f"kubelet-{n.name}", nodes.in_netns(n, nodes.kubelet_argv(tools, d, n, paths[n.name])),
              exe=str(tools["kubelet"]))
        start(f"kube-proxy-{n.name}", nodes.in_netns(n, nodes.kube_proxy_argv(tools, paths[n.name])),
              exe=str(tools["kube-proxy"]))

    def apply(manifests: list[dict]) -> None:
        doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests})
        out = subprocess.run([*kubectl, "apply", "-f", "-"], input=doc, text=True, capture_output=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"applying the test environment's add-ons failed: {out.stderr}")

    apply(addons.host_services())
    wait("real nodes Ready", lambda: _ready_nodes(kubectl) >= set(n.name for n in nets))
    # The controller manager makes each namespace's `default` ServiceAccount a moment later.
    wait("ServiceAccount kube-system/default", lambda: _ok(kubectl, "get", "sa", "default", "-n", "kube-system"))
    apply(addons.coredns(images.COREDNS_IMAGE, replicas=min(2, count)))
    wait("CoreDNS ready", lambda: _ok(kubectl, "wait", "-n", "kube-system", "--for=condition=Available",
                                      "deployment/coredns", "--timeout=1s"), 90)
    apply(prometheus.manifests(images.PROMETHEUS_IMAGE))
    start_kueue(kubectl, ca, apply)
    wait("Prometheus ready", lambda: _ok(kubectl, "wait", "-n", prometheus.NAMESPACE, "--for=condition=Available",
                                         f"deployment/{prometheus.NAME}", "--timeout=1s"), 90)
    wait("Kueue ready", lambda: _ok(kubectl, "wait", "-n", kueue.NAMESPACE, "--for=condition=Available",
                                    f"deployment/{kueue.NAME}", "--timeout=1s"), kueue.READY_TIMEOUT_S)
    return [n.name for n in nets]


def start_kueue(kubectl: list[str], ca: certs.CA, apply) -> None:
    """Kueue's CRDs (server-side: the Workload CRD is too big for client-side apply's
    annotation), Established, then its manifests; `up` waits for its Deployment after."""
    t0 = time.monotonic()
    crds = build.kueue_manifests_dir() / "crds"
    for args in (["apply", "--server-side", "--force-conflicts", "-f", str(crds)],
                 ["wait", "--for=condition=Established", "--timeout=60s", "-f", str(crds)]):
        out = subprocess.run([*kubectl, *args], text=True, capture_output=True, timeout=90)
        if out.returncode != 0:
            raise RuntimeError(f"kubectl {args[0]} of Kueue's CRDs failed: {out.stderr}")
    role = kueue.load_cluster_role((build.kueue_manifests_dir() / "role.yaml").read_text())
    pair = kueue.serving_certificate(ca)
    apply(kueue.manifests(images.KUEUE_IMAGE, role, pair.cert.read_bytes(), pair.key.read_bytes(),
                          ca.pair.cert.read_bytes()))
    print(f"Kueue's CRDs and manifests applied in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def load_images(d: Path, count: int, trainer: bool = False) -> list[str]:
    """Build the offline images (cached: only what changed is rebuilt) and import them into
    every real node's containerd; the refs. Run by `up`, and again before a test or demo on
    a running environment, so that its pods never run yesterday's operator. `trainer`: the
    trainer image built from its Dockerfile too (about 6 GB unpacked on each node)."""
    archives = images.build_images()
    if trainer:
        archives[dockerfiles.TRAINER_IMAGE] = Path(dockerfiles.build_image("trainer")["archive"])
    tools = {"ctr": build.NODE_TOOLS["ctr"]}
    for n in (network.NodeNet(i) for i in range(count)):
        nodes.wait_containerd(tools, d, n)
        nodes.import_images(tools, d, n, archives)
    return sorted(archives)


def _ok(kubectl: list[str], *args: str) -> bool:
    return subprocess.run([*kubectl, *args], capture_output=True, timeout=30).returncode == 0


def _ready_nodes(kubectl: list[str]) -> set[str]:
    out = subprocess.run([*kubectl, "get", "nodes", "-l", f"{nodes.NODE_LABEL}=real", "-o", "json"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    ready = set()
    for n in json.loads(out)["items"]:
        conds = {c["type"]: c["status"] for c in n.get("status", {}).get("conditions", [])}
        if conds.get("Ready") == "True":
            ready.add(n["metadata"]["name"])
    return ready


def drain(d: Path, state: dict, bin_dir: Path) -> None:
    """Delete every pod on the real nodes and wait (bounded) until their containers stopped,
    while the kubelets still run; a dead API server or kubelet just skips ahead."""
    kubeconfig = d / "admin.kubeconfig"
    kubectl = [str(bin_dir / "kubectl"), f"--kubeconfig={kubeconfig}", "--request-timeout=10s"]
    tools = {"ctr": build.NODE_TOOLS["ctr"]}
    nets = [network.NodeNet(i) for i in range(len(state.get("real_nodes", [])))]
    for n in nets:  # cordoned first, or a Deployment's new pod (CoreDNS's) would take the old one's place
        subprocess.run([*kubectl, "cordon", n.name], capture_output=True, timeout=30)
    for n in nets:
        subprocess.run([*kubectl, "delete", "pods", "-A", "--field-selector", f"spec.nodeName={n.name}",
                        "--grace-period=1", "--wait=false"], capture_output=True, timeout=30)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline and any(nodes.running_tasks(tools, d, n) for n in nets):
        time.sleep(0.5)


def down(d: Path, state: dict) -> None:
    """After the recorded processes stopped: sweep each node, delete the namespaces, and
    restore the host. Safe to call when nothing was started (or after a crash)."""
    nets = [network.NodeNet(i) for i in range(len(state.get("real_nodes", [])))]
    for n in nets:
        hostguard.kill_netns(n.netns_path)
        nodes.sweep(d, n)
    network.delete()
    if "host" in state:
        hostguard.restore(state["host"])
