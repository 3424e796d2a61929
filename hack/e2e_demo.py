"""`make e2e-demo`: a TrainingJob trains in containers on real kubelets and survives a
killed worker process and a deleted pod.

    .venv/bin/python hack/e2e_demo.py [--keep] [--panels-out FILE] [--trainer-image built|host-venv]

It brings up the test environment with two real nodes (hack/testenv.sh up --real-nodes 2),
installs the operator with the chart as a user would (`helm install`), applies
examples/trainingjob-cpu.yaml (its pods on the trainer image built from
images/trainer.Dockerfile; `--trainer-image host-venv`: the test image), and while it trains:
SIGKILLs one worker process inside replica 0's container (the launcher restarts it in
place), deletes replica 1's pod (the operator replaces that replica, preferably on the
other node), and lets the job finish. It prints `kubectl get tj` as it goes and ends with
a summary whose last line is one JSON object. Then it reads every dashboard panel over the
run from the test environment's Prometheus (as Grafana would, hack/prom_panels.py) and the
alerts that fired; `--panels-out` keeps those series for hack/render_dashboard.py. The e2e
test (tests/e2e/test_real_nodes.py) runs the same `Scenario` and asserts on what it saw.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack"))

import prom_panels  # noqa: E402
from testenv import addons, cluster, dockerfiles, images, prometheus, realnodes  # noqa: E402
from testenv.tools import Tool, kube_tools  # noqa: E402
from transom_operator import dashboard  # noqa: E402

EXAMPLE = ROOT / "examples" / "trainingjob-cpu.yaml"
CHART = ROOT / "charts" / "transom"
OPERATOR_NAMESPACE = "transom-system"
BUCKET = "checkpoints"
STEP_BEFORE_KILL = 40
STEP_BEFORE_DELETE = 90
JOB_TIMEOUT_S = 420.0
IMAGE_EXAMPLES = "/opt/transom/examples"  # where images/trainer.Dockerfile puts examples/
# The trainer image the job's pods run. BUILT: images/trainer.Dockerfile's own, built offline
# (hack/testenv/dockerfiles.py) and imported into every real node (about 6 GB unpacked on
# each): `make e2e-demo` and `make chaos`. HOST_VENV: the test image that mounts the host's
# venv (use_test_image): the test suites, whose three nodes would need 18 GB more disk than
# a CI machine can count on.
BUILT, HOST_VENV = "built", "host-venv"
TRAINER_IMAGES = (BUILT, HOST_VENV)


def with_trainer_image(manifest: dict, trainer: str, checkout: Path = ROOT) -> dict:
    """The example as it runs on the test nodes with the trainer image `trainer` names."""
    if trainer == HOST_VENV:
        return use_test_image(manifest, checkout)
    if trainer != BUILT:
        raise ValueError(f"trainer image {trainer!r}: one of {', '.join(TRAINER_IMAGES)}")
    out = copy.deepcopy(manifest)
    for c in out["spec"]["template"]["spec"]["containers"]:
        if c["image"] != dockerfiles.TRAINER_IMAGE:
            raise ValueError(f"{EXAMPLE.name} runs {c['image']}, not the image images/trainer.Dockerfile builds")
        c["imagePullPolicy"] = "Never"  # imported, never pulled: a missing import fails at once
    return out


def use_test_image(manifest: dict, checkout: Path = ROOT) -> dict:
    """The example with the test image in place of the published one. The test image is
    the host's venv (torch is several GB) mounted read-only: so besides the image, the pod
    gets those hostPath mounts, and examples/ where the real image has it. Test-only."""
    out = copy.deepcopy(manifest)
    pod = out["spec"]["template"]["spec"]
    staged = _stage_checkout(checkout)
    mounts = [(str(staged) if host == str(checkout.resolve()) else host, path)
              for host, path in images.trainer_test_mounts(checkout)]
    mounts.append((str(staged / "examples"), IMAGE_EXAMPLES))
    pod["volumes"] = list(pod.get("volumes") or []) + [
        {"name": f"host-{i}", "hostPath": {"path": host, "type": "Directory"}} for i, (host, _) in enumerate(mounts)]
    for c in pod["containers"]:
        c["image"] = images.TRAINER_TEST_IMAGE
        c["imagePullPolicy"] = "Never"
        c["volumeMounts"] = list(c.get("volumeMounts") or []) + [
            {"name": f"host-{i}", "mountPath": path, "readOnly": True} for i, (_, path) in enumerate(mounts)]
    return out


def _stage_checkout(checkout: Path) -> Path:
    """A world-readable copy of what the pods read from the checkout (the packages of the
    editable install, and examples/), mounted at the checkout's path: the pods run as uid
    65532, and a checkout may live in a directory only root may enter (`mktemp -d`)."""
    staged = cluster.state_dir() / "trainer-checkout"
    shutil.rmtree(staged, ignore_errors=True)
    for part in ("launcher", "operator", "examples"):
        shutil.copytree(checkout / part, staged / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for d in [staged, *(p for p in staged.rglob("*") if p.is_dir())]:
        d.chmod(0o755)
    return staged


@dataclass
class Observed:
    """What the scenario saw; the summary and the test's assertions read it."""

    namespace: str
    job: str
    container_runtime: str = ""
    killed_pid: int = 0
    killed_pod: str = ""
    killed_pod_uid: tuple[str, str] = ("", "")  # before, after
    deleted_pod: str = ""
    deleted_pod_node: str = ""
    replacement_pod: str = ""
    replacement_node: str = ""
    replacement_seconds: float = 0.0
    untouched_pod: str = ""
    untouched_uids: tuple[str, str] = ("", "")
    in_place_restarts: int = 0
    losses: list[float] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    checkpoint_keys: list[str] = field(default_factory=list)
    seconds: float = 0.0
    panels_with_data: list[str] = field(default_factory=list)  # dashboard panels Prometheus had data for
    alerts_fired: list[str] = field(default_factory=list)  # alerts firing for the job's namespace
    trainer_image: str = HOST_VENV
    built_image_ids: dict[str, str] = field(default_factory=dict)  # operator/trainer -> the built image's id
    pod_image_ids: dict[str, list[str]] = field(default_factory=dict)  # operator/coordinator/trainer -> imageIDs

    def summary(self) -> dict:
        training = self.status.get("training") or {}
        return {
            "steps": training.get("completedStep") or training.get("step"),
            "in_place_restarts": self.in_place_restarts,
            "replica_replacements": self.status.get("totalRestarts", 0),
            "succeeded": self.status.get("state") == "Succeeded",
            "container_runtime": self.container_runtime,
            "last_checkpoint_step": training.get("lastCheckpoint"),
            "goodput": training.get("goodput"),
            "replacement_seconds": round(self.replacement_seconds, 2),
            "replacement_moved_node": bool(self.replacement_node) and self.replacement_node != self.deleted_pod_node,
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
            "seconds": round(self.seconds, 1),
            "prometheus_panels_with_data": len(self.panels_with_data),
            "prometheus_panels": len(dashboard.PANELS),
            "alerts_fired": self.alerts_fired,
            "trainer_image": self.trainer_image,
            "built_image_ids": self.built_image_ids,
            "pod_image_ids": self.pod_image_ids,
            "pods_run_the_built_images": self.pods_run_the_built_images(),
        }

    def pods_run_the_built_images(self) -> bool:
        """Every operator and coordinator pod ran the operator image built from its Dockerfile,
        and (with the built trainer) every worker pod the trainer image built from its own."""
        want = {"operator": "operator", "coordinator": "operator", "trainer": "trainer"}
        if self.trainer_image != BUILT:
            want.pop("trainer")
        return all(self.pod_image_ids.get(kind) and all(_digest_of(i) == self.built_image_ids.get(image)
                                                        for i in self.pod_image_ids[kind])
                   for kind, image in want.items())


def _image_ids(pods: dict) -> list[str]:
    """The imageIDs the kubelet reported for the pods' containers."""
    return sorted({c["imageID"] for p in pods["items"] for c in p["status"].get("containerStatuses") or []
                   if c.get("imageID")})


def _digest_of(image_id: str) -> str:
    """The kubelet's imageID (`sha256:<id>`, or `<repository>@sha256:<digest>`) as the digest."""
    return image_id.rpartition("@")[2] if "@" in image_id else image_id


def _worker_pids(pod_uid: str) -> list[int]:
    """Host pids of the training processes (not the launcher) in the pod's container cgroups."""
    pids = []
    for procs in Path("/sys/fs/cgroup/pids").glob(f"transom-real-*/kubepods*/**/pod{pod_uid}/*/cgroup.procs"):
        for pid in procs.read_text().split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                name = Path(f"/proc/{pid}/comm").read_bytes().strip()
            except OSError:
                continue
            # A worker forked by the warm interpreter has its command line, and the script's
            # name (launcher.md, "Warm starts"); one started fresh has the script in argv.
            if (len(argv) > 1 and argv[1].endswith(b"train_tiny_gpt.py")) or name == b"train_tiny_gpt.py"[:15]:
                pids.append(int(pid))
    return sorted(pids)


class Scenario:
    def __init__(self, env: cluster.Env, namespace: str, log=print, kubectl: Tool | None = None,
                 helm: Tool | None = None, panels_out: Path | None = None, trainer: str = HOST_VENV):
        self.env, self.ns, self.log = env, namespace, log
        tools = kube_tools(env)
        self.kubectl, self.helm = kubectl or tools.kubectl, helm or tools.helm
        self.panels_out = panels_out
        self.trainer = trainer
        self.manifest = with_trainer_image(yaml.safe_load(EXAMPLE.read_text()), trainer)
        self.job = self.manifest["metadata"]["name"]
        self.seen = Observed(namespace=namespace, job=self.job, trainer_image=trainer)
        # /metrics of the operator and of the job's coordinator, through the API server's
        # service proxy (as a Prometheus scraping the Services would see them).
        self.metrics_paths = {
            "operator":
                f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/services/transom-operator-metrics:metrics/proxy/metrics",
            "coordinator": f"/api/v1/namespaces/{namespace}/services/{self.job}-coordinator:http/proxy/metrics",
        }

    def scrape(self, source: str) -> dict[str, float]:
        """`name{labels}` -> value, from one scrape of `source` now."""
        text = self.kubectl("get", "--raw", self.metrics_paths[source], timeout_s=10).stdout
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines())
                if k and not k.startswith("#")}

    # --- reading the cluster ------------------------------------------------------------
    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def job_status(self) -> dict:
        return self.get("tj", self.job, "-n", self.ns).get("status") or {}

    def worker_pods(self) -> dict[int, dict]:
        """Live worker pods by replica id."""
        items = self.get("pods", "-n", self.ns, "-l", f"transom.io/job={self.job},transom.io/replica")["items"]
        return {int(p["metadata"]["labels"]["transom.io/replica"]): p for p in items
                if not p["metadata"].get("deletionTimestamp")}

    def wait(self, what: str, check, timeout_s: float, show_every_s: float = 10.0):
        deadline, shown = time.monotonic() + timeout_s, 0.0
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() - shown > show_every_s:
                shown = time.monotonic()
                self.log(self.kubectl("get", "tj", "-n", self.ns, check=False).stdout.rstrip())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f}s; status {json.dumps(self.job_status())}")
            time.sleep(0.5)

    def step(self) -> int:
        return (self.job_status().get("training") or {}).get("step") or 0

    # --- the scenario -------------------------------------------------------------------
    def install_operator(self) -> None:
        # One operator: the demo records the operator's metrics through its Service, which with
        # the chart's two replicas alternates between the leader and the standby (whose gauges
        # are empty). The two replicas and their leader election are make chaos's operator_loss.
        self.helm("upgrade", "--install", "transom", str(CHART), "-n", OPERATOR_NAMESPACE, "--create-namespace",
                  "--set", "grafanaDashboard.enabled=true", "--set", "replicaCount=1", timeout_s=120)
        self.kubectl("rollout", "status", "deployment/transom-operator", "-n", OPERATOR_NAMESPACE,
                     "--timeout=120s", timeout_s=130)

    def prepare_storage(self) -> None:
        """The bucket, empty under the job's prefix, and the job's S3 credentials Secret."""
        import s3fs

        fs = s3fs.S3FileSystem(key=self.env.s3_access_key, secret=self.env.s3_secret_key,
                               client_kwargs={"endpoint_url": self.env.s3_endpoint})
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        prefix = self.manifest["spec"]["checkpoint"]["uri"].removeprefix("s3://")
        if fs.exists(prefix):
            fs.rm(prefix, recursive=True)
        secret = self.manifest["spec"]["checkpoint"]["credentialsSecret"]["name"]
        self.kubectl("create", "secret", "generic", secret, "-n", self.ns,
                     f"--from-literal=AWS_ACCESS_KEY_ID={self.env.s3_access_key}",
                     f"--from-literal=AWS_SECRET_ACCESS_KEY={self.env.s3_secret_key}",
                     f"--from-literal=AWS_ENDPOINT_URL={addons.S3_URL_IN_CLUSTER}",
                     "--from-literal=AWS_DEFAULT_REGION=us-east-1")
        self._fs, self._prefix = fs, prefix

    def kill_a_worker(self) -> None:
        pod = self.worker_pods()[0]
        uid = pod["metadata"]["uid"]
        pids = self.wait("replica 0's worker process", lambda: _worker_pids(uid), 30)
        self.log(f"SIGKILL worker pid {pids[0]} in pod {pod['metadata']['name']} on {pod['spec']['nodeName']}")
        os.kill(pids[0], signal.SIGKILL)
        self.seen.killed_pid, self.seen.killed_pod = pids[0], pod["metadata"]["name"]
        # Back to training in place: a new worker process in the same pod, and steps again.
        self.wait("a new worker in the same pod", lambda: [p for p in _worker_pids(uid) if p != pids[0]], 60)

    def delete_a_pod(self) -> None:
        pods = self.worker_pods()
        victim = pods[1]
        self.seen.deleted_pod, self.seen.deleted_pod_node = victim["metadata"]["name"], victim["spec"]["nodeName"]
        self.log(f"kubectl delete pod {self.seen.deleted_pod} (on {self.seen.deleted_pod_node})")
        t0 = time.monotonic()
        self.kubectl("delete", "pod", self.seen.deleted_pod, "-n", self.ns, "--wait=false")

        def replaced():
            p = self.worker_pods().get(1)
            running = p and p["metadata"]["name"] != self.seen.deleted_pod and p["status"].get("phase") == "Running"
            return p if running else None

        new = self.wait("replica 1 replaced and Running", replaced, 120)
        self.seen.replacement_seconds = time.monotonic() - t0
        self.seen.replacement_pod, self.seen.replacement_node = new["metadata"]["name"], new["spec"]["nodeName"]
        self.log(f"replica 1 replaced by {self.seen.replacement_pod} on {self.seen.replacement_node} "
                 f"in {self.seen.replacement_seconds:.1f}s")

    def run(self) -> Observed:
        t0 = time.monotonic()
        nodes = self.get("nodes", "-l", "transom.io/testenv-node=real")["items"]
        if not nodes:
            raise RuntimeError("no real nodes: start the test environment with `hack/testenv.sh up --real-nodes 2`")
        self.seen.container_runtime = nodes[0]["status"]["nodeInfo"]["containerRuntimeVersion"]
        # Today's operator, not the one of `up`; the trainer's too when the pods run it.
        realnodes.load_images(self.env.state_dir, len(self.env.real_nodes), trainer=self.trainer == BUILT)
        self.seen.built_image_ids = {name: dockerfiles.build_image(name)["id"]
                                     for name in ("operator", *(["trainer"] if self.trainer == BUILT else []))}
        self.install_operator()
        self.prepare_storage()
        self.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps(self.manifest))
        self.log(f"applied {EXAMPLE.relative_to(ROOT)} in namespace {self.ns}")
        started = time.time()
        self.wait(f"step {STEP_BEFORE_KILL} with 3/3 replicas",
                  lambda: (s := self.job_status()).get("healthyReplicas") == 3
                  and ((s.get("training") or {}).get("step") or 0) >= STEP_BEFORE_KILL, 240)
        pods = self.worker_pods()
        self.seen.untouched_pod = pods[2]["metadata"]["name"]
        uids = (pods[0]["metadata"]["uid"], pods[2]["metadata"]["uid"])
        self.kill_a_worker()
        self.wait(f"step {STEP_BEFORE_DELETE}", lambda: self.step() >= STEP_BEFORE_DELETE, 180)
        self.delete_a_pod()
        self.record_images()
        final = self.wait("the job Succeeded or Failed",
                          lambda: (s := self.job_status()).get("state") in ("Succeeded", "Failed") and s,
                          JOB_TIMEOUT_S)
        self.seen.status = final
        self.log(self.kubectl("get", "tj", "-n", self.ns).stdout.rstrip())
        self._after(uids)
        self.read_prometheus(started)
        self.seen.seconds = time.monotonic() - t0
        return self.seen

    def record_images(self) -> None:
        """The images the kubelets report for the operator, the coordinator and the workers
        (the replacement among them), while all of them run."""
        operator = self.get("pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=transom-operator")
        self.seen.pod_image_ids = {
            "operator": _image_ids(operator),
            "coordinator": _image_ids(self.get("pods", "-n", self.ns, "-l", "app.kubernetes.io/component=coordinator")),
            "trainer": _image_ids({"items": list(self.worker_pods().values())}),
        }

    def read_prometheus(self, start: float) -> None:
        """The dashboard's panels over the run and the alerts that fired, from Prometheus, once
        it has scraped the last values and evaluated its rules on them."""
        time.sleep(3 * dashboard.parse_duration(prometheus.SCRAPE_INTERVAL))
        end = time.time()
        panels = prom_panels.panel_series(self.kubectl, self.ns, self.job, start, end)
        self.seen.panels_with_data = [title for title, series in panels.items() if any(p for _, p in series)]
        self.seen.alerts_fired = sorted(prom_panels.fired(self.kubectl, self.ns, start, end))
        if self.panels_out is not None:
            self.panels_out.write_text(json.dumps({"title": f"{self.ns}/{self.job}", "start": start, "end": end,
                                                   "panels": panels}))

    def _after(self, uids: tuple[str, str]) -> None:
        listed = self.get("pods", "-n", self.ns, "-l", f"transom.io/job={self.job}")["items"]
        pods = {p["metadata"]["name"]: p for p in listed}
        killed = pods.get(self.seen.killed_pod)
        self.seen.killed_pod_uid = (uids[0], killed["metadata"]["uid"] if killed else "")
        untouched = pods.get(self.seen.untouched_pod)
        self.seen.untouched_uids = (uids[1], untouched["metadata"]["uid"] if untouched else "")
        log = self.kubectl("logs", self.seen.killed_pod, "-n", self.ns, check=False).stdout
        self.seen.in_place_restarts = len(re.findall(r"replica 0 attempt \d+ failed", log))
        survivor = self.kubectl("logs", self.seen.untouched_pod, "-n", self.ns, check=False).stdout
        self.seen.losses = [float(x) for x in re.findall(r"replica 2: step \d+ loss ([0-9.]+)", survivor)]
        events = self.get("events", "-n", self.ns)["items"]
        self.seen.events = [e.get("reason", "") for e in events]
        self.seen.checkpoint_keys = sorted(self._fs.find(self._prefix))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="e2e-demo")
    p.add_argument("--panels-out", type=Path, default=ROOT / "e2e-demo.panels.json",
                   help="the dashboard's series from Prometheus, for hack/render_dashboard.py")
    p.add_argument("--keep", action="store_true", help="leave the job and the test environment running")
    p.add_argument("--trainer-image", choices=TRAINER_IMAGES, default=BUILT,
                   help="the job's pods run the trainer image built from images/trainer.Dockerfile (default), "
                        "or the test image that mounts the host's venv")
    args = p.parse_args()
    with cluster.session_lock(60):  # not under a running test session
        env = cluster.current()
        if env is None or len(env.real_nodes) < 2:
            t0 = time.monotonic()
            env = cluster.up(num_nodes=0, real_nodes=2)
            print(f"test environment up with real nodes {', '.join(env.real_nodes)} in {time.monotonic() - t0:.1f}s")
        tools = kube_tools(env)
        tools.kubectl("delete", "namespace", args.namespace, "--ignore-not-found", "--timeout=90s", timeout_s=100)
        tools.kubectl("create", "namespace", args.namespace)
        args.panels_out.unlink(missing_ok=True)
        seen = Scenario(env, args.namespace, panels_out=args.panels_out, trainer=args.trainer_image).run()
        if not args.keep:  # the job first, while the operator still runs to remove its finalizer
            tools.kubectl("delete", "namespace", args.namespace, "--timeout=120s", check=False, timeout_s=130)
            tools.helm("uninstall", "transom", "-n", OPERATOR_NAMESPACE, "--wait", "--timeout=90s", check=False,
                       timeout_s=100)
    s = seen.summary()
    print(f"steps {s['steps']}, in-place restarts {s['in_place_restarts']}, replica replacements "
          f"{s['replica_replacements']} (replica 1 from {seen.deleted_pod_node} to {seen.replacement_node} "
          f"in {s['replacement_seconds']}s), loss {s['first_loss']} -> {s['last_loss']}, last checkpoint "
          f"step {s['last_checkpoint_step']}, {len(seen.checkpoint_keys)} checkpoint objects, "
          f"on {s['container_runtime']}")
    built = ", ".join(f"{name} {image_id[7:19]}" for name, image_id in s["built_image_ids"].items())
    print(f"images built from images/*.Dockerfile: {built}; the pods ran them: "
          f"{'yes' if s['pods_run_the_built_images'] else 'NO'} ({s['pod_image_ids']})")
    print("# the test environment keeps running: `eval \"$(hack/testenv.sh env)\"`; "
          "stop it with `hack/testenv.sh down`")
    print(json.dumps(s))
    return 0 if s["succeeded"] and s["pods_run_the_built_images"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
