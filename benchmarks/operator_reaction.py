"""How fast the operator reacts to a failure, and how it copes with a 2,000-pod job.

    .venv/bin/python benchmarks/operator_reaction.py [--failures 20] [--replicas 250 --nodes-per-replica 8]

Starts a private control plane (hack/testenv: real kube-apiserver, scheduler,
controller-manager, kwok nodes) in a temporary state directory and the operator from
source, then measures:

1. Reaction: a replica's pod is force-deleted `--failures` times; the figure is the time
   from the delete to the replacement pod (next generation) existing in the API server,
   p50/p99 (target p99 <= 2 s); and to it Running. Then the same with a hot spare
   (`spareReplicas: 1`): time from the delete to the replica's next generation Running
   (the promoted spare), side by side with the fresh replacement. kwok starts pods at once,
   so the fresh figure is a lower bound: a real node adds image pull and container start.
2. Scale: a job of `--replicas` x `--nodes-per-replica` pods (default 250 x 8 = 2,000) on
   `--kwok-nodes` fake nodes: seconds from `kubectl apply` to every pod Running (target
   <= 120 s), the operator's CPU seconds meanwhile, and API requests per reconcile pass
   (from the operator's own metrics).
3. Reaction inside that job: `--big-failures` pods of the large job force-deleted one after
   the other, delete -> replacement created, alternating with failures in a small job of
   the same replica shape (3 x `--nodes-per-replica`: the same pod writes per replacement)
   that runs beside it, so both see the same load on the cluster: a replacement must not be
   slowed by the job's size (`big_vs_small_reaction_ratio`). The small job's reaction is
   also measured before the big job exists: during/alone is the cluster's share (2,000 more
   pods for the API server, etcd and kwok on the same cores), not the operator's.

Prints readable lines and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack"))


def kubectl(env, *args, input=None, check=True):
    return subprocess.run([str(env.bin_dir / "kubectl"), f"--kubeconfig={env.kubeconfig}", *args],
                          input=input, capture_output=True, text=True, check=check, timeout=120)


def job_manifest(name: str, replicas: int, nodes_per_replica: int, spares: int = 0) -> dict:
    return {
        "apiVersion": "transom.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "replicas": replicas, "minReplicas": 1, "nodesPerReplica": nodes_per_replica, "procsPerNode": 1,
            "spareReplicas": spares,
            # The testenv's kwok nodes stand for GPU nodes: they carry the GPU taint.
            "template": {"spec": {"containers": [{"name": "trainer", "image": "transom/bench:0"}],
                                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                   "effect": "NoSchedule"}]}},
            # No backoff: the benchmark measures the operator's reaction, not the policy's delay.
            "faultTolerance": {"maxReplicaRestarts": 1000, "restartWindowSeconds": 3600, "backoffSeconds": 0,
                               "maxBackoffSeconds": 0},
        },
    }


def pods(env, ns: str) -> list[dict]:
    out = kubectl(env, "get", "pods", "-n", ns, "-l", "transom.io/replica", "-o", "json").stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def wait(pred, timeout_s: float, what: str, interval_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval_s)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    """The private cluster and the operator under test, and the reads every phase makes of them."""

    def __init__(self, env, state: Path, args: argparse.Namespace, metrics_port: int, op: subprocess.Popen):
        from kubernetes import client, config

        self.env, self.state, self.args, self.metrics_port, self.op = env, state, args, metrics_port, op
        self.core = client.CoreV1Api(config.new_client_from_config(str(env.kubeconfig)))
        self.deleted: list[tuple[str, int]] = []  # (job, replica) of every deletion of reactions_inside

    def operator_log_tail(self) -> str:
        return (self.state / "operator.log").read_text()[-3000:]

    def job(self, name: str) -> dict:
        return json.loads(kubectl(self.env, "get", "tj", name, "-n", "bench", "-o", "json").stdout)

    def exists(self, name: str) -> bool:
        from kubernetes.client.rest import ApiException

        try:
            self.core.read_namespaced_pod(name, "bench", _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    def generation_pods(self, job: str, replica: int, generation: int) -> list[dict]:
        selector = f"transom.io/job={job},transom.io/replica={replica},transom.io/generation={generation}"
        return json.loads(self.core.list_namespaced_pod("bench", label_selector=selector,
                                                        _preload_content=False).data)["items"]

    def replica_running(self, replica: int, generation: int, job: str) -> bool:
        items = self.generation_pods(job, replica, generation)
        return bool(items) and all(p["status"].get("phase") == "Running" for p in items)

    def recorded_running(self, job: str, replica: int, gen: int) -> bool:
        """The operator recorded this incarnation as Running (a pod deleted before that is
        re-created under the same generation, by design)."""
        mine = [r for r in self.job(job).get("status", {}).get("replicas", []) if r["id"] == replica]
        return bool(mine) and mine[0]["generation"] == gen and mine[0]["state"] == "Running"

    def delete(self, pod: str) -> float:
        """Force-deletes a pod: the monotonic time of the delete."""
        t0 = time.monotonic()
        self.core.delete_namespaced_pod(pod, "bench", grace_period_seconds=0, _preload_content=False)
        return t0

    def apply_job(self, name: str, replicas: int, nodes_per_replica: int, spares: int = 0) -> None:
        kubectl(self.env, "apply", "-n", "bench", "-f", "-",
                input=json.dumps(job_manifest(name, replicas, nodes_per_replica, spares)))

    def running_pods(self, prefix: str) -> int:
        return sum(p["metadata"]["name"].startswith(prefix) and p["status"].get("phase") == "Running"
                   for p in pods(self.env, "bench"))

    def reactions_inside(self, job: str, replicas: int, failures: int, start: int = 0, of: int = 0) -> list[float]:
        """Delete node rank 3's pod (or the last) of `failures` replicas, one after another
        (failures number start.. of a series of `of`, spread over the replicas)."""
        rank = min(3, self.args.nodes_per_replica - 1)
        out = []
        for i in range(start, start + failures):
            replica = 1 + i * max(1, replicas // max(1, of or failures)) % max(1, replicas - 1)
            gen = sum(1 for r in self.deleted if r == (job, replica))
            self.deleted.append((job, replica))
            # As in (1): a pod of an incarnation not yet recorded Running comes back as it was.
            wait(functools.partial(self.recorded_running, job, replica, gen), 60,
                 f"{job} replica {replica} gen {gen} recorded", interval_s=0.1)
            victim, successor = f"{job}-r{replica}-n{rank}-g{gen}", f"{job}-r{replica}-n{rank}-g{gen + 1}"
            t0 = self.delete(victim)
            wait(functools.partial(self.exists, successor), 60, f"{successor} created", interval_s=0.01)
            out.append(time.monotonic() - t0)
            time.sleep(1.0)  # the replacement's own events settle, as between real failures
        return sorted(out)


def start_operator(env, state: Path, args: argparse.Namespace, metrics_port: int) -> subprocess.Popen:
    """The CRD, the namespace, and the operator from source, logging into operator.log."""
    kubectl(env, "apply", "--server-side", "-f", str(ROOT / "crds" / "trainingjobs.transom.io.yaml"))
    kubectl(env, "wait", "--for=condition=Established", "crd/trainingjobs.transom.io", "--timeout=60s")
    kubectl(env, "create", "namespace", "bench")
    wait(lambda: kubectl(env, "get", "sa", "default", "-n", "bench", check=False).returncode == 0, 30, "default SA")
    log = open(state / "operator.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "transom_operator.main", "--metrics-port", str(metrics_port),
         "--metrics-address", "127.0.0.1", "--lease-namespace", "bench",
         *(["--verbose"] if args.operator_verbose else [])],
        env={**os.environ, "KUBECONFIG": str(env.kubeconfig)}, stdout=log, stderr=subprocess.STDOUT)


def react_to_failures(b: Bench) -> tuple[list[float], list[float]]:
    """(1) A 3 x 1 job's replica 1 deleted `--failures` times: sorted seconds from the delete
    to the replacement created, and to it Running."""
    b.apply_job("react", 3, 1)
    try:
        wait(lambda: sum(p["status"].get("phase") == "Running" for p in pods(b.env, "bench")) == 3, 90, "3 running")
    except TimeoutError:
        print(kubectl(b.env, "get", "tj,pods,lease", "-n", "bench", "-o", "wide", check=False).stdout[-3000:])
        print(b.operator_log_tail())
        raise
    reactions, fresh_running = [], []
    for i in range(b.args.failures):
        victim = f"react-r1-n0-g{i}"
        successor = f"react-r1-n0-g{i + 1}"
        t0 = b.delete(victim)
        try:
            wait(functools.partial(b.exists, successor), 30, f"{successor} created", interval_s=0.01)
        except TimeoutError:
            print(kubectl(b.env, "get", "tj", "react", "-n", "bench", "-o", "json").stdout[-3000:])
            print(b.operator_log_tail())
            raise
        reactions.append(time.monotonic() - t0)
        wait(functools.partial(b.replica_running, 1, i + 1, "react"), 30, f"{successor} Running", interval_s=0.01)
        fresh_running.append(time.monotonic() - t0)
        # The next failure only after the operator recorded the new incarnation as Running.
        wait(functools.partial(b.recorded_running, "react", 1, i + 1), 60, f"{successor} recorded Running",
             interval_s=0.1)
    kubectl(b.env, "delete", "tj", "react", "-n", "bench", "--wait=true", "--timeout=60s")
    wait(lambda: not pods(b.env, "bench"), 60, "react pods gone")
    return sorted(reactions), sorted(fresh_running)


def react_with_a_spare(b: Bench) -> list[float]:
    """(1b) The same failures with a hot spare: sorted seconds from the delete to the
    replica's next generation (the promoted spare) Running."""
    b.apply_job("spare", 3, 1, spares=1)

    def spare_ready() -> bool:
        st = b.job("spare").get("status", {})
        return st.get("readySpareReplicas") == 1 and st.get("state") == "Running"

    spare_running = []
    for i in range(b.args.failures):
        wait(spare_ready, 90, "spare Ready and job Running", interval_s=0.05)
        (victim,) = b.generation_pods("spare", 1, i)
        t0 = b.delete(victim["metadata"]["name"])
        wait(functools.partial(b.replica_running, 1, i + 1, "spare"), 30, f"replica 1 generation {i + 1} Running",
             interval_s=0.01)
        spare_running.append(time.monotonic() - t0)
    kubectl(b.env, "delete", "tj", "spare", "-n", "bench", "--wait=false")
    return sorted(spare_running)


def scale_up(b: Bench, total: int) -> dict:
    """(3) The big job applied: seconds to every pod Running, the operator's CPU seconds and
    its API requests meanwhile."""
    args = b.args
    before = scrape(b.metrics_port)
    cpu0 = cpu_seconds(b.op.pid)
    t0 = time.monotonic()
    b.apply_job("big", args.replicas, args.nodes_per_replica)
    wait(lambda: b.running_pods("big-") >= total, 600, f"{total} pods running", interval_s=1.0)
    to_running = time.monotonic() - t0
    time.sleep(3)  # let the passes that saw the last pods finish
    cpu = cpu_seconds(b.op.pid) - cpu0
    after = scrape(b.metrics_port)
    passes = after["transom_operator_reconcile_seconds_count"] - before["transom_operator_reconcile_seconds_count"]
    requests = after["transom_operator_api_requests_total"] - before["transom_operator_api_requests_total"]
    creates = total  # one POST per pod; the rest is reads, status writes and events
    per_pass = (requests - creates) / passes if passes else float("nan")
    print(f"scale: {args.replicas} replicas x {args.nodes_per_replica} = {total} pods on {args.kwok_nodes} "
          f"kwok nodes: all Running in {to_running:.1f}s (target <= 120 s); operator CPU {cpu:.1f}s; "
          f"{int(passes)} passes, {int(requests)} API requests ({per_pass:.1f} per pass besides the "
          f"{creates} pod creates)")
    return {"seconds_to_all_running": round(to_running, 1), "operator_cpu_s": round(cpu, 2),
            "reconcile_passes": int(passes), "api_requests": int(requests),
            "api_requests_per_pass_besides_creates": round(per_pass, 1)}


def run(b: Bench) -> dict:
    """Every phase in turn: the result's figures."""
    args = b.args
    reactions, fresh_running = react_to_failures(b)
    p50 = statistics.median(reactions)
    p99 = reactions[min(len(reactions) - 1, int(round(0.99 * (len(reactions) - 1))))]
    print(f"reaction (delete -> replacement pod created) over {len(reactions)} failures: "
          f"p50 {p50:.3f}s p99 {p99:.3f}s max {reactions[-1]:.3f}s (target p99 <= 2 s)")
    spare_running = react_with_a_spare(b)
    fresh_p50, spare_p50 = statistics.median(fresh_running), statistics.median(spare_running)
    print(f"failure -> replica Running, fresh pods: p50 {fresh_p50:.3f}s max {fresh_running[-1]:.3f}s; "
          f"hot spare: p50 {spare_p50:.3f}s max {spare_running[-1]:.3f}s; "
          f"ratio spare/fresh {spare_p50 / fresh_p50:.2f} (kwok: no image pull or container start)")

    # --- 2. a replacement in a small job of the big one's replica shape ---------------------
    shape_job = "shape"
    b.apply_job(shape_job, 3, args.nodes_per_replica)
    wait(lambda: b.running_pods(f"{shape_job}-") >= 3 * args.nodes_per_replica, 90, "shape job running")
    time.sleep(2)
    shape_reactions = b.reactions_inside(shape_job, 3, args.big_failures)
    shape_p50 = statistics.median(shape_reactions)
    print(f"reaction inside a 3 x {args.nodes_per_replica}-pod job over {len(shape_reactions)} failures: "
          f"p50 {shape_p50:.3f}s max {shape_reactions[-1]:.3f}s (the baseline: same replica shape)")
    # --- 3. a 2,000-pod job --------------------------------------------------------------
    total = args.replicas * args.nodes_per_replica
    scale = scale_up(b, total)
    # --- 4. failures inside the large job ---------------------------------------------------
    # Alternately in the big job and in the small one, which still runs: both under the same
    # load of the cluster (2,000 more pods for the API server, etcd and kwok on the same
    # cores), so their ratio is the operator's own job-size effect; the small job's figure
    # before and during tells the cluster's share.
    big_reactions, shape_during = [], []
    for i in range(args.big_failures):
        big_reactions += b.reactions_inside("big", args.replicas, 1, start=i, of=args.big_failures)
        shape_during += b.reactions_inside(shape_job, 3, 1, start=i, of=args.big_failures)
    big_reactions.sort()
    shape_during.sort()
    big_p50, during_p50 = statistics.median(big_reactions), statistics.median(shape_during)
    print(f"reaction inside the {total}-pod job over {len(big_reactions)} failures: p50 {big_p50:.3f}s "
          f"max {big_reactions[-1]:.3f}s; in the 3 x {args.nodes_per_replica}-pod job at the same time: p50 "
          f"{during_p50:.3f}s max {shape_during[-1]:.3f}s: ratio {big_p50 / during_p50:.2f} (the small job "
          f"alone: {shape_p50:.3f}s, so the cluster's load is x{during_p50 / shape_p50:.2f}; against the "
          f"3 x 1-pod job's {p50:.3f}s: {big_p50 / p50:.2f})")
    return {
        "big_reaction_p50_s": round(big_p50, 3), "big_reaction_max_s": round(big_reactions[-1], 3),
        "small_reaction_alone_p50_s": round(shape_p50, 3), "small_reaction_during_p50_s": round(during_p50, 3),
        "big_vs_small_reaction_ratio": round(big_p50 / during_p50, 2),
        "small_during_vs_alone_ratio": round(during_p50 / shape_p50, 2),
        "big_vs_one_pod_replica_ratio": round(big_p50 / p50, 2),
        "failures": len(reactions), "reaction_p50_s": round(p50, 3), "reaction_p99_s": round(p99, 3),
        "reaction_max_s": round(reactions[-1], 3),
        "fresh_running_p50_s": round(fresh_p50, 3), "spare_running_p50_s": round(spare_p50, 3),
        "spare_running_max_s": round(spare_running[-1], 3),
        "spare_vs_fresh_ratio": round(spare_p50 / fresh_p50, 2), "pods": total, "kwok_nodes": args.kwok_nodes,
        **scale,
        "targets": {"reaction_p99_s": 2.0, "seconds_to_all_running": 120, "big_vs_small_reaction_ratio": 1.25},
        "ok": p99 <= 2.0 and scale["seconds_to_all_running"] <= 120 and big_p50 / during_p50 <= 1.25,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--failures", type=int, default=20)
    p.add_argument("--replicas", type=int, default=250)
    p.add_argument("--big-failures", type=int, default=10)
    p.add_argument("--nodes-per-replica", type=int, default=8)
    p.add_argument("--kwok-nodes", type=int, default=32)  # at most 110 pods each
    p.add_argument("--operator-verbose", action="store_true",
                   help="the operator logs at DEBUG (each pass's timings) into the state directory's operator.log")
    args = p.parse_args()

    state = Path(tempfile.mkdtemp(prefix="transom-bench-"))
    os.environ["TRANSOM_TESTENV_STATE"] = str(state / "testenv")
    from testenv import cluster
    from testenv.cluster import free_port

    env = cluster.up(args.kwok_nodes)
    op = None
    result: dict = {"benchmark": "operator_reaction"}
    try:
        metrics_port = free_port()
        op = start_operator(env, state, args, metrics_port)
        result.update(run(Bench(env, state, args, metrics_port, op)))
    finally:
        if op is not None:
            op.terminate()
            try:
                op.wait(timeout=20)
            except subprocess.TimeoutExpired:
                op.kill()
        cluster.down()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
