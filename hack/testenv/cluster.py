"""Start and stop the local control plane: etcd, API server, controller manager, scheduler,
kwok with fake GPU nodes, and a SeaweedFS S3 server, all on 127.0.0.1 with free ports;
with `real_nodes`, also real nodes (kubelet, kube-proxy, containerd) that run containers,
each in a network namespace of its own (realnodes.py).

`up()` is idempotent: when everything recorded in the state file still runs and the API
server answers, it returns that environment; a half-dead one is stopped and started
afresh. Processes run in their own sessions, so they outlive the command that started
them; `down()` stops exactly the processes it recorded (checking that each pid still runs
the binary it started, so a reused pid is never signalled) and removes the state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from testenv import build, certs, realnodes

STATE_FILE = "state.json"
START_TIMEOUT_S = 90.0
NODE_LABELS = {
    "type": "kwok",
    "transom.io/testenv-node": "kwok",
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
    "node.kubernetes.io/instance-type": "gpu-8x-h100",
}

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
# A GPU node's resources, local disk included (the examples request ephemeral-storage).
KWOK_NODE_RESOURCES = {"cpu": "96", "memory": "1Ti", "ephemeral-storage": "2Ti", "pods": "110", "nvidia.com/gpu": "8"}


@dataclass
class Env:
    kubeconfig: Path
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    version: str
    state_dir: Path
    nodes: list[str]
    bin_dir: Path
    real_nodes: list[str] = dataclasses.field(default_factory=list)
    s3_url_in_cluster: str = ""  # the S3 server as pods on real nodes reach it

    def exports(self) -> str:
        return "\n".join(
            [
                f"export KUBECONFIG={self.kubeconfig}",
                f"export PATH={self.bin_dir}:$PATH",
                f"export TRANSOM_S3_ENDPOINT={self.s3_endpoint}",
                f"export AWS_ACCESS_KEY_ID={self.s3_access_key}",
                f"export AWS_SECRET_ACCESS_KEY={self.s3_secret_key}",
                "export AWS_DEFAULT_REGION=us-east-1",
            ]
        )


def state_dir() -> Path:
    return Path(os.environ.get("TRANSOM_TESTENV_STATE", build.cache_root() / "run"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- processes ----------------------------------------------------------------------------
def _start(name: str, argv: list[str], d: Path, procs: dict, env: dict | None = None, exe: str | None = None) -> None:
    """Start `argv` in its own session, logging to logs/<name>.log; `exe` is the binary the
    process ends up running when argv[0] execs another (nsenter)."""
    log = open(d / "logs" / f"{name}.log", "ab")
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True, cwd=d, env={**os.environ, **(env or {})})
    procs[name] = {"pid": p.pid, "exe": str(Path(exe or argv[0]).resolve()), "argv": argv}
    _save(d, {"procs": procs})  # record at once: a failed up must still be stoppable


def _alive(entry: dict) -> bool:
    try:
        exe = os.readlink(f"/proc/{entry['pid']}/exe")
    except OSError:
        return False
    with open(f"/proc/{entry['pid']}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return exe.removesuffix(" (deleted)") == entry["exe"]


def _wait(what: str, check, d: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready within {timeout_s:.0f}s; logs in {d / 'logs'}")
        time.sleep(0.2)


def _save(d: Path, update: dict) -> None:
    path = d / STATE_FILE
    state = json.loads(path.read_text()) if path.exists() else {}
    state.update(update)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, default=str))
    os.replace(tmp, path)


# --- configuration files -------------------------------------------------------------------
def _kubeconfig(path: Path, server: str, ca: Path, client: certs.Pair, user: str) -> Path:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: transom-testenv
  cluster: {{server: "{server}", certificate-authority: "{ca}"}}
users:
- name: {user}
  user: {{client-certificate: "{client.cert}", client-key: "{client.key}"}}
contexts:
- name: transom-testenv
  context: {{cluster: transom-testenv, user: {user}}}
current-context: transom-testenv
"""
    )
    path.chmod(0o600)
    return path


def _https_ok(url: str, ca: Path, client: certs.Pair) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(client.cert), str(client.key))
    with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
        return r.status == 200


def _http_ok(url: str) -> bool:
    """The server answers HTTP (an auth refusal is an answer too)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status < 500
    except urllib.error.HTTPError as e:
        return e.code < 500


def _node_manifest(name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {**NODE_LABELS, "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64"},
        },
        # As GPU node pools are tainted in real clusters: only pods that tolerate it (the GPU
        # example does) land here, never a CPU pod meant for a real node.
        "spec": {"taints": [GPU_TAINT]},
        "status": {
            "allocatable": dict(KWOK_NODE_RESOURCES),
            "capacity": dict(KWOK_NODE_RESOURCES),
        },
    }


# --- public --------------------------------------------------------------------------------
@contextlib.contextmanager
def session_lock(timeout_s: float) -> Iterator[None]:
    """Hold the state directory for one test session. Two sessions on one machine share it
    (and the real nodes' fixed host paths): without the lock the second's `up` stops the
    first's processes and each sees the other's kubelet changes as its own leftovers. The
    second waits for the first; the lock file lies beside the state directory, which `down`
    removes, and the kernel drops the lock when its holder dies."""
    d = state_dir()
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.with_name(d.name + ".lock"), "a+") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another test session has held the test environment {d} for "
                                       f"{timeout_s:.0f} s; wait for it to end or stop it") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def current() -> Env | None:
    d = state_dir()
    path = d / STATE_FILE
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    if "env" not in state or not all(_alive(p) for p in state.get("procs", {}).values()):
        return None
    env = Env(**{**state["env"], "kubeconfig": Path(state["env"]["kubeconfig"]),
                 "state_dir": Path(state["env"]["state_dir"]), "bin_dir": Path(state["env"]["bin_dir"])})
    try:
        admin = certs.Pair(Path(state["admin_cert"]), Path(state["admin_key"]))
        if not _https_ok(state["readyz"], Path(state["ca"]), admin):
            return None
    except Exception:
        return None
    return env


def up(num_nodes: int = 4, real_nodes: int = 0) -> Env:
    running = current()
    if running is not None and len(running.nodes) == num_nodes and len(running.real_nodes) == real_nodes:
        return running
    down()
    tools = build.binaries(real_nodes=real_nodes > 0)
    d = state_dir()
    (d / "logs").mkdir(parents=True)
    (d / "pki").mkdir()
    procs: dict = {}
    try:
        return _up(d, tools, num_nodes, real_nodes, procs)
    except BaseException as e:
        kept = Path(tempfile.mkdtemp(prefix="transom-testenv-logs-"))
        shutil.copytree(d / "logs", kept, dirs_exist_ok=True)
        (kept / "error.txt").write_text(f"{type(e).__name__}: {e}\n{_cluster_state(d, tools)}")
        down()
        raise RuntimeError(f"testenv up failed ({e}); the component logs are kept in {kept}") from e


def _cluster_state(d: Path, tools: dict[str, Path]) -> str:
    """What the API server says of the nodes, pods and service accounts (for a failed up)."""
    kubeconfig = d / "admin.kubeconfig"
    if not kubeconfig.exists():
        return ""
    try:
        out = subprocess.run([str(tools["kubectl"]), f"--kubeconfig={kubeconfig}", "--request-timeout=10s", "get",
                              "nodes,pods,serviceaccounts,deployments", "-A", "-o", "wide"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError) as e:
        return f"(kubectl failed: {e})"


def _up(d: Path, tools: dict[str, Path], num_nodes: int, real_nodes: int, procs: dict) -> Env:
    pki = d / "pki"
    ca = certs.CA(pki)
    admin = ca.issue("admin", "transom-admin", organizations=("system:masters",))
    sa = certs.service_account_keys(pki)
    api_port = free_port()
    server = f"https://127.0.0.1:{api_port}"
    readyz = _start_apiserver(d, tools, ca, admin, sa, api_port, real_nodes, procs)
    admin_kc = _kubeconfig(d / "admin.kubeconfig", server, ca.pair.cert, admin, "transom-admin")
    _start_controllers(d, tools, ca, sa, server, procs)
    s3_port, access, secret = _start_s3(d, tools, procs)

    kubectl = [str(tools["kubectl"]), f"--kubeconfig={admin_kc}"]
    nodes = _add_kwok_nodes(d, kubectl, num_nodes)
    s3_endpoint = f"http://127.0.0.1:{s3_port}"
    _wait("S3 server", lambda: _http_ok(s3_endpoint), d)

    real = realnodes.up(d, tools, ca, real_nodes, api_port, s3_port, kubectl,
                        start=lambda name, argv, exe=None: _start(name, argv, d, procs, exe=exe),
                        kubeconfig=_kubeconfig, save=lambda update: _save(d, update),
                        wait=lambda what, check, timeout_s=START_TIMEOUT_S: _wait(what, check, d, timeout_s))
    env = Env(kubeconfig=admin_kc, s3_endpoint=s3_endpoint, s3_access_key=access, s3_secret_key=secret,
              version=build.K8S_VERSION, state_dir=d, nodes=nodes, bin_dir=build.bin_dir(),
              real_nodes=real, s3_url_in_cluster=realnodes.S3_URL_IN_CLUSTER if real else "")
    _save(d, {"env": asdict(env), "readyz": readyz, "ca": str(ca.pair.cert),
              "admin_cert": str(admin.cert), "admin_key": str(admin.key)})
    return env


def _start_apiserver(d: Path, tools: dict[str, Path], ca: certs.CA, admin: certs.Pair, sa: certs.Pair,
                     api_port: int, real_nodes: int, procs: dict) -> str:
    """etcd and the API server, started and ready: the API server's /readyz URL."""
    serving = ca.issue(
        "apiserver", "kube-apiserver", server=True,
        dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local"),
        ips=("127.0.0.1", "10.0.0.1", realnodes.SERVICES_IP),
    )
    etcd_port, etcd_peer = free_port(), free_port()
    _start("etcd", [
        str(tools["etcd"]), "--name", "default", "--data-dir", str(d / "etcd"),
        "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
        "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
        "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
        "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
        "--listen-metrics-urls", "", "--quota-backend-bytes", str(2 << 30),
    ], d, procs)
    _wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), d)

    _start("kube-apiserver", [
        str(tools["kube-apiserver"]),
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
        f"--cert-dir={d / 'apiserver'}",
        f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
        f"--client-ca-file={ca.pair.cert}",
        f"--service-account-key-file={sa.cert}", f"--service-account-signing-key-file={sa.key}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--service-cluster-ip-range=10.0.0.0/24",
        *realnodes.apiserver_flags(d, ca, real_nodes),
        "--anonymous-auth=false", "--allow-privileged=true",
        "--enable-priority-and-fairness=false", "--profiling=false",
        "--endpoint-reconciler-type=none",
        # Streaming lists (WatchList) need etcd progress notifications, which Debian's etcd
        # 3.4 lacks: kwok's newer client-go would see every watch end at once and notice new
        # pods only on relists, tens of seconds late. Off, clients fall back to list+watch.
        "--feature-gates=WatchList=false",
    ], d, procs)
    readyz = f"https://127.0.0.1:{api_port}/readyz"
    _wait("kube-apiserver", lambda: _https_ok(readyz, ca.pair.cert, admin), d)
    return readyz


def _start_controllers(d: Path, tools: dict[str, Path], ca: certs.CA, sa: certs.Pair, server: str,
                       procs: dict) -> None:
    """The controller manager, the scheduler and kwok, each with a client certificate of its own."""
    kcm = ca.issue("controller-manager", "system:kube-controller-manager")
    sched = ca.issue("scheduler", "system:kube-scheduler")
    kwok_client = ca.issue("kwok", "kwok-controller", organizations=("system:masters",))
    sched_port, kwok_port = free_port(), free_port()
    kcm_kc = _kubeconfig(d / "controller-manager.kubeconfig", server, ca.pair.cert, kcm, "controller-manager")
    sched_kc = _kubeconfig(d / "scheduler.kubeconfig", server, ca.pair.cert, sched, "scheduler")
    kwok_kc = _kubeconfig(d / "kwok.kubeconfig", server, ca.pair.cert, kwok_client, "kwok")

    _start("kube-controller-manager", [
        str(tools["kube-controller-manager"]), f"--kubeconfig={kcm_kc}",
        f"--authentication-kubeconfig={kcm_kc}", f"--authorization-kubeconfig={kcm_kc}",
        "--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={sa.key}", f"--root-ca-file={ca.pair.cert}",
        f"--cluster-signing-cert-file={ca.pair.cert}", f"--cluster-signing-key-file={ca.pair.key}",
        "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller",
        "--node-monitor-grace-period=20s", "--profiling=false",
    ], d, procs)
    _start("kube-scheduler", [
        str(tools["kube-scheduler"]), f"--kubeconfig={sched_kc}",
        f"--authentication-kubeconfig={sched_kc}", f"--authorization-kubeconfig={sched_kc}",
        "--bind-address=127.0.0.1", f"--secure-port={sched_port}", "--leader-elect=false", "--profiling=false",
    ], d, procs)
    _start("kwok", [
        str(tools["kwok"]), f"--kubeconfig={kwok_kc}", f"--config={build.kwok_stages_file()}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        "--manage-nodes-with-label-selector=",
        "--cidr=10.0.0.1/24", "--node-ip=10.0.0.1", "--node-lease-duration-seconds=40",
        f"--server-address=127.0.0.1:{kwok_port}",
    ], d, procs)


def _start_s3(d: Path, tools: dict[str, Path], procs: dict) -> tuple[int, str, str]:
    """SeaweedFS with one identity; every one of its ports is a free loopback port: the S3
    port, the access key and the secret key."""
    access, secret = "transom-" + secrets.token_hex(4), secrets.token_urlsafe(24)
    (d / "s3.json").write_text(json.dumps({"identities": [{
        "name": "transom", "credentials": [{"accessKey": access, "secretKey": secret}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}))
    s3_port = free_port()
    weed_ports = {k: free_port() for k in (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
        "filer.port.grpc", "s3.port.grpc", "webdav.port", "admin.port", "admin.port.grpc")}
    (d / "s3").mkdir()
    _start("weed", [
        str(tools["weed"]), "mini", f"-dir={d / 's3'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", f"-s3.port={s3_port}", f"-s3.config={d / 's3.json'}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # off: their defaults are fixed ports
        *(f"-{k}={v}" for k, v in weed_ports.items()),
    ], d, procs)
    return s3_port, access, secret


def _add_kwok_nodes(d: Path, kubectl: list[str], num_nodes: int) -> list[str]:
    """The fake nodes, created and Ready: their names."""
    nodes = [f"kwok-node-{i}" for i in range(num_nodes)]
    manifest = {"apiVersion": "v1", "kind": "List", "items": [_node_manifest(n) for n in nodes]}
    applied = subprocess.run([*kubectl, "apply", "-f", "-"], input=json.dumps(manifest), text=True,
                             capture_output=True, timeout=60) if nodes else None
    if applied is not None and applied.returncode != 0:
        raise RuntimeError(f"creating the kwok nodes failed: {applied.stderr}")

    def nodes_ready() -> bool:
        out = subprocess.run([*kubectl, "get", "nodes", "-o", "json"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
        ready = 0
        for n in json.loads(out)["items"]:
            conds = {c["type"]: c["status"] for c in n.get("status", {}).get("conditions", [])}
            ready += conds.get("Ready") == "True"
        return ready >= num_nodes

    _wait("kwok nodes", nodes_ready, d)
    return nodes


def _stop(entries: list[dict]) -> None:
    """SIGTERM the live ones, SIGKILL what is left after 15 s, reap those this process started."""
    live = [p for p in entries if _alive(p)]
    for p in live:
        try:
            os.kill(p["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in live) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in live:
        if _alive(p):
            os.kill(p["pid"], signal.SIGKILL)
    for p in entries:  # reap the ones this process started (tests), if any
        try:
            os.waitpid(p["pid"], os.WNOHANG)
        except ChildProcessError:
            pass


def stop_s3() -> None:
    """Stop the S3 server (an outage, for tests); `start_s3` brings it back with its data."""
    _stop([json.loads((state_dir() / STATE_FILE).read_text())["procs"]["weed"]])


def start_s3() -> None:
    """Start the S3 server again on the same ports and data directory; wait until it serves."""
    d = state_dir()
    state = json.loads((d / STATE_FILE).read_text())
    procs = state["procs"]
    if _alive(procs["weed"]):
        return
    if "argv" not in procs["weed"]:
        raise RuntimeError("this testenv was started by an older version: `hack/testenv.sh down` and start it again")
    _start("weed", procs["weed"]["argv"], d, procs)
    _wait("S3 server", lambda: _http_ok(state["env"]["s3_endpoint"]), d)


def down() -> None:
    """Stop every process the state file records (newest first), put back what the real
    nodes changed on the host, and remove the state."""
    d = state_dir()
    path = d / STATE_FILE
    state = json.loads(path.read_text()) if path.exists() else {}
    procs = state.get("procs", {})
    if state.get("real_nodes"):
        realnodes.drain(d, state, build.bin_dir())  # pods go while their kubelets still run
    # Clients first, then the API server (with its clients gone it has no watch to drain and
    # stops at once, where it took 10+ s stopped beside them), then etcd under it.
    last = ("kube-apiserver", "etcd")
    _stop([p for name, p in reversed(list(procs.items())) if name not in last])
    for name in last:
        if name in procs:
            _stop([procs[name]])
    realnodes.down(d, state)  # also after a crash: namespaces, mounts, cgroups, sysctls
    shutil.rmtree(d, ignore_errors=True)
