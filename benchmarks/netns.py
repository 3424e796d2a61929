"""A small cluster on one machine: one network namespace per replica, joined by a bridge,
each link shaped with `tc` (benchmarks/recovery.py --network netns).

    root namespace: bridge tsbr0 10.213.0.1/24 (the coordinator or lighthouse listens here)
      veth tsv<k>h ── tsv<k>r in namespace transom-bench-<k>, 10.213.0.<k+2>/24

Each veth end gets a token bucket filter (`tc qdisc ... tbf`) of `rate_mbit` on its
egress, so everything a replica sends and everything it receives crosses a link of that
rate. (No added latency: netem, which would add it, is not in every kernel, and not in this
project's development VMs.) Traffic never leaves the machine: the addresses are on the bridge
only, and nothing routes them anywhere. Needs root (CAP_NET_ADMIN), `ip` and `tc`
(Debian: `apt-get install iproute2`). `down()` removes everything `up()` made, also after a
partial `up()`.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

SUBNET = "10.213.0"
BRIDGE = "tsbr0"


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Cluster:
    replicas: int
    rate_mbit: float

    host_addr: str = f"{SUBNET}.1"

    def namespace(self, k: int) -> str:
        return f"transom-bench-{k}"

    def addr(self, k: int) -> str:
        return f"{SUBNET}.{k + 2}"

    def interface(self, k: int) -> str:
        """The replica's end of its link, inside its namespace (GLOO_SOCKET_IFNAME)."""
        return f"tsv{k}r"

    def prefix(self, k: int) -> list[str]:
        """The command prefix that runs a process inside replica `k`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(k)]

    def up(self) -> None:
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"`{tool}` is missing: apt-get install iproute2")
        self.down()  # what a killed earlier run left behind
        try:
            _run("ip", "link", "add", BRIDGE, "type", "bridge")
            _run("ip", "addr", "add", f"{self.host_addr}/24", "dev", BRIDGE)
            _run("ip", "link", "set", BRIDGE, "up")
            for k in range(self.replicas):
                ns, host_end, ns_end = self.namespace(k), f"tsv{k}h", self.interface(k)
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                _run("ip", "link", "set", ns_end, "netns", ns)
                _run("ip", "link", "set", host_end, "master", BRIDGE)
                _run("ip", "link", "set", host_end, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", ns_end)
                _run("ip", "-n", ns, "link", "set", ns_end, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                # A burst of at least one timer tick's worth of bytes, or tbf cannot reach the rate.
                burst = max(64 << 10, int(self.rate_mbit * 1e6 / 8 / 100))
                for where, dev in (([], host_end), (self.prefix(k), ns_end)):
                    _run(*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                         "burst", str(burst), "latency", "100ms")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            self.down()
            detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else str(e)
            raise RuntimeError(f"could not build the benchmark network (needs root): {detail}") from None

    def down(self) -> None:
        for k in range(self.replicas):
            subprocess.run(["ip", "netns", "del", self.namespace(k)], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", f"tsv{k}h"], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, timeout=30)
