"""The real nodes' network: one network namespace per node, joined by a bridge of their own.

    switch namespace "transom-sw"       bridge br0
      veth n0 ─────────── eth0 in "transom-real-0"  node IP 10.201.0.10, pods 10.244.0.0/24 on cni0
      veth n1 ─────────── eth0 in "transom-real-1"  node IP 10.201.0.11, pods 10.244.1.0/24 on cni0

Each node routes the other nodes' pod ranges to their node IPs; the CNI bridge plugin
gives each pod an address from its node's range with the node as gateway. Every node also
holds SERVICES_IP on its loopback, where the forwarder (forward.py) listens for the API
server and S3; the `kubernetes` and `s3` Services point there. Nothing is added to the
host's own namespace: no address, route, iptables rule or sysctl. `ip_forward` and
`bridge-nf-call-iptables` (kube-proxy needs both) are set inside the node namespaces only.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SWITCH_NS = "transom-sw"
NODE_NS_PREFIX = "transom-real-"
NODE_NET = "10.201.0"          # node i is NODE_NET.(10+i)/24 on the switch
POD_NET = "10.244"             # node i's pods are POD_NET.i.0/24
CLUSTER_CIDR = f"{POD_NET}.0.0/16"
SERVICES_IP = "10.201.255.254"  # the forwarder's address inside every node namespace
NETNS_DIR = Path("/run/netns")


@dataclass(frozen=True)
class NodeNet:
    index: int

    @property
    def name(self) -> str:
        return f"real-{self.index}"

    @property
    def netns(self) -> str:
        return f"{NODE_NS_PREFIX}{self.index}"

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)

    @property
    def ip(self) -> str:
        return f"{NODE_NET}.{10 + self.index}"

    @property
    def pod_cidr(self) -> str:
        return f"{POD_NET}.{self.index}.0/24"

    @property
    def networks(self) -> list[str]:
        """What the forwarder reaches inside this namespace: the node and its pods."""
        return [f"{self.ip}/32", self.pod_cidr]


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def _sysctl(ns: str, key: str, value: str) -> None:
    """Write a sysctl inside `ns` only (/proc/sys/net is per network namespace)."""
    path = "/proc/sys/" + key.replace(".", "/")
    subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > {path}"], check=True, timeout=30)


def namespaces() -> list[str]:
    """Our namespaces that exist now (left behind by a crash, or running)."""
    if not NETNS_DIR.exists():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name == SWITCH_NS or p.name.startswith(NODE_NS_PREFIX))


def create(nodes: list[NodeNet]) -> None:
    _ip("netns", "add", SWITCH_NS)
    _ip("link", "add", "br0", "type", "bridge", ns=SWITCH_NS)
    _ip("link", "set", "br0", "up", ns=SWITCH_NS)
    _ip("link", "set", "lo", "up", ns=SWITCH_NS)
    for node in nodes:
        _ip("netns", "add", node.netns)
        _ip("link", "add", f"n{node.index}", "netns", SWITCH_NS, "type", "veth", "peer", "name", "eth0",
            "netns", node.netns)
        _ip("link", "set", f"n{node.index}", "master", "br0", "up", ns=SWITCH_NS)
        _ip("link", "set", "lo", "up", ns=node.netns)
        _ip("addr", "add", f"{SERVICES_IP}/32", "dev", "lo", ns=node.netns)
        _ip("addr", "add", f"{node.ip}/24", "dev", "eth0", ns=node.netns)
        _ip("link", "set", "eth0", "up", ns=node.netns)
        _sysctl(node.netns, "net.ipv4.ip_forward", "1")
        _sysctl(node.netns, "net.bridge.bridge-nf-call-iptables", "1")
    for node in nodes:
        for other in nodes:
            if other is not node:
                _ip("route", "add", other.pod_cidr, "via", other.ip, ns=node.netns)


def delete() -> None:
    """Delete every namespace of ours; their veths, bridges and addresses go with them."""
    for ns in namespaces():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
