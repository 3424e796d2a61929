"""Real nodes: containerd, kubelet and kube-proxy in a network namespace per node.

Each node has its own containerd (two kubelets must never share one), state directory,
pod range and cgroup (`cgroupRoot: /transom-real-<i>` in every v1 hierarchy), and joins
the control plane with a client certificate of `system:node:<name>`, so the Node
authorizer and NodeRestriction treat it as a real node. The settings below are the ones a
machine of this kind needs (docs/testenv.md, and ../shared/notes/real-node.md):

- cgroup v1 (the VM's agent holds the v1 memory controller): `failCgroupV1: false`;
- no CAP_SYS_RESOURCE: containerd's `restrict_oom_score_adj`, or every sandbox fails;
- no registry: images are imported from OCI archives (images.py) and never collected
  (`imageGCHighThresholdPercent: 100`); the sandbox image is our own pause;
- the host's iptables stay untouched: kube-proxy's rules live in the node's namespace,
  and the kubelet's own chains are off (`makeIPTablesUtilChains: false`).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from testenv import certs, hostguard, network, oci

NODE_LABEL = "transom.io/testenv-node"  # value "real"; kwok nodes carry "kwok"
CLUSTER_DNS_IP = "10.0.0.10"
API_PORT_IN_NODE = 6443
CNI_BIN_DIR = "/usr/lib/cni"


def node_dir(d: Path, node: network.NodeNet) -> Path:
    return d / "nodes" / node.name


def containerd_socket(d: Path, node: network.NodeNet) -> Path:
    return node_dir(d, node) / "containerd.sock"


def _containerd_config(d: Path, node: network.NodeNet, pause_image: str) -> str:
    nd = node_dir(d, node)
    return f"""version = 2
root = "{nd}/containerd/root"
state = "{nd}/containerd/state"
[grpc]
  address = "{containerd_socket(d, node)}"
[ttrpc]
  address = "{nd}/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{nd}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_image}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{nd}/cni"
"""


def _cni_config(d: Path, node: network.NodeNet) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": f"transom-{node.name}",
        "plugins": [
            {
                "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                "ipam": {"type": "host-local", "dataDir": str(node_dir(d, node) / "ipam"),
                         "ranges": [[{"subnet": node.pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]},
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def _kubelet_config(d: Path, node: network.NodeNet, ca: Path) -> dict:
    nd = node_dir(d, node)
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.ip, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{containerd_socket(d, node)}",
        "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{node.netns}", "failCgroupV1": False,
        "failSwapOn": False, "makeIPTablesUtilChains": False, "protectKernelDefaults": False,
        "clusterDNS": [CLUSTER_DNS_IP], "clusterDomain": "cluster.local",
        "resolvConf": str(nd / "resolv.conf"),
        "podLogsDir": str(nd / "pod-logs"), "volumePluginDir": str(nd / "volume-plugins"),
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "serializeImagePulls": False, "maxPods": 30,
        "nodeStatusReportFrequency": "10s", "nodeStatusUpdateFrequency": "2s",
        "rotateCertificates": False, "serverTLSBootstrap": False,
    }


def _kube_proxy_config(kubeconfig: Path, node: network.NodeNet) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables", "hostnameOverride": node.name, "clusterCIDR": network.CLUSTER_CIDR,
        "bindAddress": node.ip, "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
        "nodePortAddresses": [f"{node.ip}/32"],
        # 0 leaves the host-wide conntrack table size and timeouts as they are.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"syncPeriod": "10s", "minSyncPeriod": "0s"},
    }


def write_configs(d: Path, node: network.NodeNet, ca: certs.CA, kubeconfig_for, pause_image: str) -> dict[str, Path]:
    """Every file the node's three processes read; the paths by name."""
    nd = node_dir(d, node)
    for sub in ("cni", "pod-logs", "volume-plugins", "kubelet", "kubelet-certs", "ipam"):
        (nd / sub).mkdir(parents=True, exist_ok=True)
    server = f"https://{network.SERVICES_IP}:{API_PORT_IN_NODE}"
    kubelet_cert = ca.issue(f"kubelet-{node.name}", f"system:node:{node.name}", organizations=("system:nodes",))
    proxy_cert = ca.issue(f"kube-proxy-{node.name}", "system:kube-proxy")
    paths = {
        "containerd": nd / "containerd.toml",
        "kubelet": nd / "kubelet.yaml",
        "kubelet-kubeconfig": kubeconfig_for(nd / "kubelet.kubeconfig", server, kubelet_cert,
                                             f"system:node:{node.name}"),
        "kube-proxy-kubeconfig": kubeconfig_for(nd / "kube-proxy.kubeconfig", server, proxy_cert, "kube-proxy"),
        "kube-proxy": nd / "kube-proxy.yaml",
    }
    paths["containerd"].write_text(_containerd_config(d, node, pause_image))
    (nd / "cni" / "10-transom.conflist").write_text(json.dumps(_cni_config(d, node), indent=2))
    (nd / "resolv.conf").write_text("# pods with dnsPolicy Default get no resolver: nothing outside is reachable\n"
                                    "nameserver 127.0.0.1\n")
    paths["kubelet"].write_text(json.dumps(_kubelet_config(d, node, ca.pair.cert), indent=2))
    paths["kube-proxy"].write_text(json.dumps(_kube_proxy_config(paths["kube-proxy-kubeconfig"], node), indent=2))
    return paths


def in_netns(node: network.NodeNet, argv: list[str]) -> list[str]:
    """`argv` run in the node's network namespace only (the host's mounts stay shared, so
    the kubelet's volume mounts are what containerd's runc sees)."""
    return ["nsenter", f"--net={node.netns_path}", "--", *argv]


def containerd_argv(tools: dict, paths: dict) -> list[str]:
    return [str(tools["containerd"]), "--config", str(paths["containerd"])]


def kubelet_argv(tools: dict, d: Path, node: network.NodeNet, paths: dict) -> list[str]:
    nd = node_dir(d, node)
    return [
        str(tools["kubelet"]), f"--config={paths['kubelet']}", f"--kubeconfig={paths['kubelet-kubeconfig']}",
        f"--root-dir={nd / 'kubelet'}", f"--cert-dir={nd / 'kubelet-certs'}",
        f"--hostname-override={node.name}", f"--node-ip={node.ip}",
        f"--node-labels={NODE_LABEL}=real", "--v=1",
    ]


def kube_proxy_argv(tools: dict, paths: dict) -> list[str]:
    return [str(tools["kube-proxy"]), f"--config={paths['kube-proxy']}", "--v=1"]


def ctr(tools: dict, d: Path, node: network.NodeNet, *args: str, timeout_s: float = 120) -> str:
    cmd = [str(tools["ctr"]), "--address", str(containerd_socket(d, node)), "-n", "k8s.io", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def wait_containerd(tools: dict, d: Path, node: network.NodeNet, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ctr(tools, d, node, "version", timeout_s=5)
            return
        except (RuntimeError, subprocess.TimeoutExpired):
            if time.monotonic() > deadline:
                raise RuntimeError(f"containerd of {node.name} did not answer within {timeout_s:.0f}s") from None
            time.sleep(0.2)


def import_images(tools: dict, d: Path, node: network.NodeNet, archives: dict[str, Path]) -> None:
    """Import each archive ({ref: path}) unless the node's image of that ref is the archive's
    already (the trainer's is gigabytes: an import reads and hashes all of it)."""
    have = {}
    for line in ctr(tools, d, node, "images", "ls").splitlines()[1:]:
        name, _type, digest, *_ = line.split()
        have[name] = digest
    for ref, archive in archives.items():
        digest, manifest = oci.archive_manifest(archive)
        if have.get(ref) == digest:
            continue
        ctr(tools, d, node, "images", "import", str(archive), timeout_s=900)
        # The layers are unpacked into the node's snapshots, which is what containers run from;
        # their compressed copies would only double the disk the image takes (3 GB of the
        # trainer's 9 per node). As containerd's CRI does with discard_unpacked_layers.
        for layer in manifest["layers"]:
            ctr(tools, d, node, "content", "rm", layer["digest"])


def running_tasks(tools: dict, d: Path, node: network.NodeNet) -> int:
    """Containers (sandboxes included) containerd still runs for the node."""
    try:
        out = ctr(tools, d, node, "tasks", "ls", "-q", timeout_s=10)
    except (RuntimeError, subprocess.TimeoutExpired):
        return 0
    return len(out.split())


def sweep(d: Path, node: network.NodeNet) -> None:
    """After the node's processes stopped: kill leftovers, unmount, remove its cgroups."""
    hostguard.kill_cgroups(node.netns)
    hostguard.unmount([str(node_dir(d, node))])
    hostguard.remove_cgroups(node.netns)
