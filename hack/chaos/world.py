"""The cluster a chaos scenario acts on: the test environment with real nodes, the operator
installed by its chart (two replicas, leader election), and ways to find what runs where.

Reads go through the Kubernetes Python client (cheap enough to poll every second beside
three training replicas on two cores); `kubectl` and `helm` are used where a user would use
them (drain, apply, install).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kubernetes import client, config

from e2e_demo import BUILT, CHART, HOST_VENV, OPERATOR_NAMESPACE
from testenv import cluster, network, realnodes
from testenv.tools import kube_tools

GROUP, VERSION, PLURAL = "transom.io", "v1alpha1", "trainingjobs"
API_TIMEOUT_S = 5
CGROUP_PIDS = Path("/sys/fs/cgroup/pids")


class World:
    def __init__(self, env: cluster.Env, log=print, trainer: str = HOST_VENV):
        self.env, self.log = env, log
        self.trainer = trainer  # the trainer image the jobs' pods run (e2e_demo.TRAINER_IMAGES)
        tools = kube_tools(env)
        self.kubectl, self.helm = tools.kubectl, tools.helm
        self.api = config.new_client_from_config(config_file=str(env.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.coordination = client.CoordinationV1Api(self.api)

    def close(self) -> None:
        self.api.close()

    # --- nodes -----------------------------------------------------------------------------
    @staticmethod
    def node_index(node_name: str) -> int:
        """The index faults.py takes for a real node's name (real-<i>)."""
        for i in range(16):
            if network.NodeNet(i).name == node_name:
                return i
        raise ValueError(f"{node_name} is not a real node of the test environment")

    def node_ready(self, name: str) -> bool:
        node = self.core.read_node(name, _request_timeout=API_TIMEOUT_S)
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    def real_nodes(self) -> list[str]:
        return list(self.env.real_nodes)

    # --- the operator ------------------------------------------------------------------------
    def install_operator(self, replicas: int = 2) -> None:
        """`helm upgrade --install` of the chart with `replicas` operator pods (one leads)."""
        # Today's operator image; the trainer's too when the jobs run it.
        realnodes.load_images(self.env.state_dir, len(self.env.real_nodes), trainer=self.trainer == BUILT)
        # helm installs CRDs only once, never upgrades them; an environment that ran an older
        # checkout would prune today's status fields. Apply them first, as an admin upgrades.
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"), timeout_s=60)
        self.helm("upgrade", "--install", "transom", str(CHART), "-n", OPERATOR_NAMESPACE, "--create-namespace",
                  "--set", f"replicaCount={replicas}", timeout_s=120)
        self.kubectl("rollout", "status", "deployment/transom-operator", "-n", OPERATOR_NAMESPACE,
                     "--timeout=180s", timeout_s=190)

    def uninstall_operator(self) -> None:
        self.helm("uninstall", "transom", "-n", OPERATOR_NAMESPACE, "--wait", "--timeout=90s", check=False,
                  timeout_s=100)

    def operator_pods(self) -> list[client.V1Pod]:
        pods = self.core.list_namespaced_pod(OPERATOR_NAMESPACE, _request_timeout=API_TIMEOUT_S,
                                             label_selector="app.kubernetes.io/name=transom-operator").items
        return [p for p in pods if p.metadata.deletion_timestamp is None]

    def operator_leader(self) -> str | None:
        """The operator pod that holds the Lease now (its identity is `<pod>-<suffix>`)."""
        leases = self.coordination.list_namespaced_lease(OPERATOR_NAMESPACE, _request_timeout=API_TIMEOUT_S).items
        holders = [ls.spec.holder_identity for ls in leases if ls.spec and ls.spec.holder_identity]
        for pod in self.operator_pods():
            if any(h.startswith(pod.metadata.name + "-") for h in holders):
                return pod.metadata.name
        return None

    # --- a job's pods ------------------------------------------------------------------------
    def job(self, ns: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name,
                                                        _request_timeout=API_TIMEOUT_S)

    def worker_pods(self, ns: str, job: str) -> dict[int, client.V1Pod]:
        """Live (not deleting) worker pods by replica id."""
        pods = self.core.list_namespaced_pod(ns, label_selector=f"transom.io/job={job},transom.io/replica",
                                             _request_timeout=API_TIMEOUT_S).items
        return {int(p.metadata.labels["transom.io/replica"]): p for p in pods if p.metadata.deletion_timestamp is None}

    def all_pods(self, ns: str) -> list[client.V1Pod]:
        return self.core.list_namespaced_pod(ns, _request_timeout=API_TIMEOUT_S).items

    def coordinator_pod(self, ns: str, job: str) -> client.V1Pod | None:
        pods = self.core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=coordinator",
                                             _request_timeout=API_TIMEOUT_S).items
        live = [p for p in pods if p.metadata.deletion_timestamp is None and p.status.phase == "Running"]
        return live[0] if live else None

    def coordinator_metrics(self, ns: str, job: str) -> dict[str, float] | None:
        """One scrape of the job's coordinator through the API server's service proxy (as a
        Prometheus would reach it); None while it does not answer."""
        try:
            text = self.core.connect_get_namespaced_service_proxy_with_path(
                f"{job}-coordinator:http", ns, "metrics", _request_timeout=3)
        except Exception:
            return None
        out = {}
        for line in str(text).splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                try:
                    out[key] = float(value)
                except ValueError:
                    pass
        return out

    def events(self, ns: str) -> list[client.CoreV1Event]:
        return self.core.list_namespaced_event(ns, _request_timeout=API_TIMEOUT_S).items

    def logs(self, ns: str, pod: str, previous: bool = False) -> str:
        try:
            return self.core.read_namespaced_pod_log(pod, ns, previous=previous, _request_timeout=10)
        except Exception:
            return ""

    # --- host processes --------------------------------------------------------------------
    @staticmethod
    def pod_pids(uid: str, argv_part: bytes | None = None) -> list[int]:
        """Host pids in the pod's containers (all hierarchies of the real nodes' pids
        cgroup), optionally only those whose command line contains `argv_part`."""
        pids = set()
        for procs in CGROUP_PIDS.glob(f"transom-real-*/kubepods*/**/pod{uid}/*/cgroup.procs"):
            try:
                found = procs.read_text().split()
            except OSError:
                continue
            for pid in found:
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if argv_part is None or argv_part in argv:
                    pids.add(int(pid))
        return sorted(pids)

    def wait(self, what: str, check, timeout_s: float, every_s: float = 0.5):
        """Poll `check` until it returns something true; TimeoutError names `what`."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while True:
            try:
                value = check()
            except Exception as e:  # an API blip during a fault is not the end of the scenario
                value, last = None, e
            else:
                last = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f}s" + (f" (last error: {last})" if last else ""))
            time.sleep(every_s)


def dump(obj) -> str:
    return json.dumps(obj, default=str)[:2000]
