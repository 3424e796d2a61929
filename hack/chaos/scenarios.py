"""The faults of `make chaos`, one function each: wait until the job trains, do the fault
the way the cluster would (testenv/faults.py, kubectl, the S3 server's process), watch the
reaction, undo what the fault changed in the environment, and leave judging to job.py.

Each scenario returns the Verdict it filled in (detected after, contributing again after,
notes); `run` wraps it with the job's start, finish, judgement and deletion, so that every
scenario is judged the same way. A fault is always undone in a `finally`, so one failed
scenario leaves the environment whole for the next.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable

from chaos.job import CHECKPOINT_INTERVAL, ChaosJob, Verdict, tended
from chaos.world import World
from e2e_demo import OPERATOR_NAMESPACE
from testenv import cluster, faults

STEPS = 2000  # a cap: each scenario ends its job END_MARGIN steps after it saw the job recover
RESUMED = re.compile(r"resumed from the checkpoint of step (\d+)")
MISSING_IMAGE = "localhost:5999/transom/no-such-image:0.0"  # a registry on the node's own loopback: refused


def run(world: World, name: str, act: Callable[[ChaosJob, Verdict], set[str]], steps: int = STEPS,
        env: dict[str, str] | None = None, fault_tolerance: dict | None = None) -> Verdict:
    """One scenario from start to deletion; `act` does the fault and returns the reasons
    status and Events must show."""
    job = ChaosJob(world, "chaos-" + name.replace("_", "-"), steps, env, fault_tolerance)
    verdict = Verdict(name)
    t0 = time.monotonic()
    try:
        with tended(job, verdict):
            job.start()
            expect = act(job, verdict)
            job.end_after()
            final = job.finish()
            job.judge(verdict, final, expect)
    finally:
        verdict.problems += environment_problems(world)
    verdict.survived = not verdict.problems
    verdict.notes.append(f"{time.monotonic() - t0:.0f} s in all")
    return verdict


def environment_problems(world: World) -> list[str]:
    """What a scenario must have put back: every real node Ready and schedulable, no cut."""
    problems = []
    if faults.cut_nodes():
        problems.append(f"still partitioned: {faults.cut_nodes()}")
    for name in world.real_nodes():
        try:
            world.wait(f"node {name} Ready", lambda n=name: world.node_ready(n), 90)
        except TimeoutError as e:
            problems.append(str(e))
        if world.core.read_node(name).spec.unschedulable:
            problems.append(f"node {name} left cordoned")
    return problems


# --- helpers -----------------------------------------------------------------------------------
def victim(job: ChaosJob, prefer: str | None = None) -> tuple[int, str]:
    """A replica on a node without the coordinator (the highest such id, one on node `prefer`
    first), and that node."""
    coord = job.world.coordinator_pod(job.ns, job.name)
    coord_node = coord.spec.node_name if coord else None
    pods = job.world.worker_pods(job.ns, job.name)
    for replica in sorted(pods, key=lambda r: (pods[r].spec.node_name == prefer, r), reverse=True):
        if pods[replica].spec.node_name != coord_node:
            return replica, pods[replica].spec.node_name
    replica = max(pods)
    return replica, pods[replica].spec.node_name


def wait_moved(job: ChaosJob, replica: int, away_from: str, timeout_s: float = 180) -> str:
    """Until the replica runs a newer generation on another node; that node."""
    def moved():
        pod = job.world.worker_pods(job.ns, job.name).get(replica)
        if pod and pod.spec.node_name and pod.spec.node_name != away_from and pod.status.phase == "Running":
            return pod.spec.node_name
        return None
    return job.world.wait(f"replica {replica} running on a node other than {away_from}", moved, timeout_s)


def detected(job: ChaosJob, replica: int | None = None) -> float | None:
    """Seconds from the fault until status or the coordinator first showed it: a replica no
    longer contributing (or the coordinator not answering), or the replica's new failure."""
    base = job.watch.samples[0] if job.watch.samples else None
    for s in job.watch.samples:
        if job.fault_at is None or s.t < job.fault_at:
            base = s
            continue
        failed = replica is not None and base is not None and \
            s.generations.get(replica, 0) > base.generations.get(replica, 0)
        if failed or s.contributing is None or s.contributing < job.replicas:
            return s.t - job.fault_at
    return None


def training_goes_on(job: ChaosJob, steps: int, timeout_s: float) -> None:
    start = job.watch.now().step or 0
    job.world.wait(f"{job.ns}: {steps} more steps committed", lambda: (job.watch.now().step or 0) >= start + steps,
                   timeout_s)


# --- the scenarios ---------------------------------------------------------------------------------
def node_loss(job: ChaosJob, v: Verdict) -> set[str]:
    job.wait_training(30)
    replica, node = victim(job)
    index = job.world.node_index(node)
    job.mark_fault()
    killed = faults.stop_node(index)
    try:
        v.notes.append(f"stopped {node} (replica {replica}; {killed} container processes killed)")
        moved_to = wait_moved(job, replica, node)
        v.recover_s = job.wait_contributing()
        v.detect_s = detected(job, replica)
        v.notes.append(f"replica {replica} moved to {moved_to}")
        excluded = job.watch.now().excluded
        if node not in excluded:
            v.problems.append(f"{node} not excluded (excludedNodes {excluded})")
    finally:
        faults.start_node(index)
    return {"NodeNotReady"}


def partition(job: ChaosJob, v: Verdict) -> set[str]:
    job.wait_training(30)
    replica, node = victim(job)
    index = job.world.node_index(node)
    cut_pod = job.world.worker_pods(job.ns, job.name)[replica].metadata.uid
    job.mark_fault()
    faults.cut(index)
    try:
        v.notes.append(f"cut {node} (replica {replica})")
        wait_moved(job, replica, node)
        v.recover_s = job.wait_contributing()
        v.detect_s = detected(job, replica)
        before = job.watch.now()
        fenced_before, unauth_before = before.fenced or 0, before.unauthenticated or 0
    finally:
        faults.heal(index)
    # Healed: the old incarnation runs on until its kubelet, back in touch, stops it. It
    # tries to speak for its replica and is refused: 409 while the coordinator still knows
    # its pod, 401 once the pod is gone (its token no longer authenticates).
    # Its kubelet may also stop it before it speaks again (its calls back off while cut off):
    # then nothing of it can be refused, and the judgement (no step lost, digests equal) stands.
    try:
        job.world.wait("the healed incarnation refused by the coordinator or stopped by its kubelet",
                       lambda: (job.watch.now().fenced or 0) > fenced_before or not job.world.pod_pids(cut_pod), 90)
        time.sleep(5)  # what else it tried before its kubelet stopped it
        now = job.watch.now()
        unauth = (now.unauthenticated or 0) - unauth_before
        v.notes.append(f"the healed incarnation refused {(now.fenced or 0) - fenced_before - unauth:.0f} times as "
                       f"superseded (409) and {unauth:.0f} times as a gone pod (401)")
    except TimeoutError as e:
        v.problems.append(str(e))
    return {"NodeNotReady"}


def drain(job: ChaosJob, v: Verdict) -> set[str]:
    job.wait_training(30)
    # The node of the operator that leads, where there is a replica: the pod is evicted and gone
    # before the standby takes the Lease, and must still be judged a requested eviction.
    leader = next((p for p in job.world.operator_pods() if p.metadata.name == job.world.operator_leader()), None)
    replica, node = victim(job, prefer=leader.spec.node_name if leader else None)
    job.mark_fault()
    try:
        out = job.world.kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=240s",
                                timeout_s=250, check=False)
        if out.returncode != 0:
            v.problems.append(f"kubectl drain failed: {out.stderr.strip()[-500:]}")
        moved_to = wait_moved(job, replica, node)
        v.recover_s = job.wait_contributing()
        v.detect_s = detected(job, replica)
        led = " (the operator's leader's node)" if leader and leader.spec.node_name == node else ""
        v.notes.append(f"drained {node}{led}; replica {replica} moved to {moved_to}")
    finally:
        job.world.kubectl("uncordon", node, check=False)
    return {"PodEvicted"}


def coordinator_loss(job: ChaosJob, v: Verdict) -> set[str]:
    job.wait_training(30)
    coord = job.world.coordinator_pod(job.ns, job.name)
    if coord is None:
        raise RuntimeError(f"{job.ns}: no running coordinator pod to delete")
    job.mark_fault()
    job.world.kubectl("delete", "pod", coord.metadata.name, "-n", job.ns, "--wait=false")
    v.recover_s = job.wait_contributing()
    v.detect_s = detected(job)
    v.notes.append(f"coordinator pod deleted: back in {v.recover_s:.1f} s")
    # Then the node under the new coordinator is lost.
    coord = job.world.wait("the new coordinator running", lambda: job.world.coordinator_pod(job.ns, job.name), 120)
    node = coord.spec.node_name
    index = job.world.node_index(node)
    on_node = [r for r, p in job.world.worker_pods(job.ns, job.name).items() if p.spec.node_name == node]
    t = time.monotonic()
    faults.stop_node(index)
    try:
        job.world.wait("a coordinator running on another node", lambda: (c := job.world.coordinator_pod(
            job.ns, job.name)) and c.spec.node_name != node, 180)
        job.fault_at = t
        back = job.wait_contributing()
        v.notes.append(f"coordinator's node {node} lost (replicas {on_node} on it): all contributing in {back:.1f} s")
    finally:
        faults.start_node(index)
    return {"NodeNotReady"} if on_node else set()


def operator_loss(job: ChaosJob, v: Verdict) -> set[str]:
    job.wait_training(30)
    leader = job.world.wait("an operator leader", job.world.operator_leader, 60)
    pod = next(p for p in job.world.operator_pods() if p.metadata.name == leader)
    replica = 1
    victim_pod = job.world.worker_pods(job.ns, job.name)[replica].metadata.name
    job.mark_fault()
    job.world.kubectl("delete", "pod", victim_pod, "-n", job.ns, "--wait=false")
    time.sleep(0.5)  # the leader has seen the deletion and is replacing the replica
    # Killed, and its pod gone with it (as with its node): the standby must take over.
    pids = World.pod_pids(pod.metadata.uid, b"transom")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    job.world.kubectl("delete", "pod", leader, "-n", OPERATOR_NAMESPACE, "--grace-period=0", "--force",
                      "--wait=false", check=False)
    v.notes.append(f"operator leader {leader} SIGKILLed (pids {pids}) and its pod deleted during the "
                   f"replacement of replica {replica}")
    v.recover_s = job.wait_contributing()
    v.detect_s = detected(job, replica)
    new_leader = job.world.wait("an operator leader", job.world.operator_leader, 90)
    v.notes.append(f"leader now {new_leader}")
    if new_leader == leader:
        v.problems.append(f"{leader} still leads")
    status = job.status()
    r = next(x for x in status["replicas"] if x["id"] == replica)
    if (r.get("generation"), r.get("restarts")) != (1, 1) or status.get("totalRestarts") != 1:
        v.problems.append(f"replaced more than once: replica {r}, totalRestarts {status.get('totalRestarts')}")
    replaced = [e for e in job.world.events(job.ns) if e.reason == "ReplicaReplaced"]
    if sum(e.count or 1 for e in replaced) != 1:
        v.problems.append(f"{sum(e.count or 1 for e in replaced)} ReplicaReplaced events, not 1")
    return {"PodDeleted"}


def checkpoint_trouble(job: ChaosJob) -> str | None:
    return (job.status().get("training") or {}).get("checkpointTrouble")


def live_progress(job: ChaosJob) -> tuple[int, int]:
    """(the job's committed step, its newest committed checkpoint's) as the coordinator's
    metrics say them now: status.training's step is written every few seconds, so steps
    counted from it would lag by that much."""
    metrics = job.world.coordinator_metrics(job.ns, job.name) or {}
    return (int(metrics.get("transom_coordinator_step", 0)),
            int(metrics.get("transom_coordinator_last_checkpoint_step", -1)))


def storage_outage(job: ChaosJob, v: Verdict) -> set[str]:
    job.wait_training(CHECKPOINT_INTERVAL + 5)
    # Stop S3 just after a checkpoint began (its persist runs behind the next steps), so that
    # a write fails at once: the live step, as status.training.step lags by seconds.
    before = job.world.wait("a checkpoint step", lambda: (p := live_progress(job))[0] % CHECKPOINT_INTERVAL in
                            range(1, 4) and p, 120, 0.1)[0]
    job.mark_fault()
    cluster.stop_s3()
    try:
        said = job.world.wait("status.training.checkpointTrouble", lambda: checkpoint_trouble(job), 120)
        v.detect_s = job.since_fault()
        v.notes.append(f"status named the outage after {v.detect_s:.1f} s, at step {live_progress(job)[0]}: {said}")
        training_goes_on(job, 2 * CHECKPOINT_INTERVAL, 180)
        v.notes.append(f"S3 down from step {before} to {live_progress(job)[0]} "
                       f"({job.since_fault():.0f} s); last checkpoint {job.watch.now().last_checkpoint}")
    finally:
        cluster.start_s3()
    back = live_progress(job)[0]
    committed = job.world.wait("a checkpoint committed after the outage",
                               lambda: (p := live_progress(job))[1] > before and p, 180, 0.2)
    v.recover_s = job.since_fault()
    # What the newest complete checkpoint lags once S3 is back: within one interval of its
    # return, the checkpoint in flight (or the next due one) lands.
    v.notes.append(f"S3 back at step {back}; checkpoint {committed[1]} committed by step {committed[0]} "
                   f"({committed[0] - back} steps after S3's return; interval {CHECKPOINT_INTERVAL})")
    job.world.wait("status.training.checkpointTrouble removed", lambda: not checkpoint_trouble(job), 120)
    # A whole-job restart restores the newest complete checkpoint.
    return whole_job_restart(job, v)


def whole_job_restart(job: ChaosJob, v: Verdict) -> set[str]:
    """Suspend (every pod deleted), resume: the replicas that restore take the newest
    complete checkpoint. The steps after it are redone by design; the committed step is
    judged again from the first status write after every replica restored."""
    w = job.world
    selector = f"transom.io/job={job.name},transom.io/replica"

    def no_worker_pods():  # Terminating ones too: they train on through their grace period
        return not w.core.list_namespaced_pod(job.ns, label_selector=selector, _request_timeout=5).items
    w.kubectl("patch", "tj", job.name, "-n", job.ns, "--type=merge", "-p", json.dumps({"spec": {"suspend": True}}))
    w.wait("every worker pod gone", no_worker_pods, 180)
    # The newest complete checkpoint is storage's word: status may lag it by the coordinator's
    # last write (a checkpoint committed while the workers stopped, after its last write).
    newest = job.committed_steps()[0]
    suspended_at = (job.status().get("training") or {}).get("step")
    resumed_at = len(job.watch.samples)
    w.kubectl("patch", "tj", job.name, "-n", job.ns, "--type=merge", "-p", json.dumps({"spec": {"suspend": False}}))

    def started():  # every replica's new pod has said how it began: restored, or caught up from a peer
        pods = w.worker_pods(job.ns, job.name)
        logs = {r: w.logs(job.ns, p.metadata.name) for r, p in pods.items()}
        begun = {r: text for r, text in logs.items() if RESUMED.search(text) or "recovering from it" in text}
        return begun if len(begun) == job.replicas else None
    logs = w.wait("every replica restored or caught up after the resume", started, 240)
    restored_at = len(job.watch.samples)
    steps = {r: int(m[1]) for r, text in logs.items() if (m := RESUMED.search(text))}
    if not steps or set(steps.values()) != {newest}:
        v.problems.append(f"replicas restored {steps}, not the newest checkpoint {newest}")
    # The restart ends, for the committed step in status, at the first write after every
    # replica restored. Not at the first change after the resume: status may still show the
    # old lineage's last steps then (the workers train on through their grace period after
    # `suspended_at` was read, and the coordinator writes every few seconds): a run took
    # such a late 158 for the new lineage's first write and judged its 156 a loss.
    showing = next((s.step for s in reversed(job.watch.samples[:restored_at]) if s.step is not None), None)
    w.wait("status written after the restore", lambda: any(
        s.step is not None and s.step != showing for s in job.watch.samples[restored_at:]), 120)
    after = job.watch.samples[restored_at:]
    first = next(i for i, s in enumerate(after) if s.step is not None and s.step != showing)
    job.restart_window = (resumed_at, restored_at + first)
    v.notes.append(f"suspended at step {suspended_at}; replicas restored the newest checkpoint {steps} (the others "
                   f"caught up from them); status then showed step {after[first].step}")
    return {"JobSuspended"}


def containerd_restart(job: ChaosJob, v: Verdict) -> set[str]:
    job.wait_training(30)
    replica, node = victim(job)
    uids = {r: p.metadata.uid for r, p in job.world.worker_pods(job.ns, job.name).items()}
    job.mark_fault()
    faults.restart_containerd(job.world.node_index(node))
    training_goes_on(job, 30, 120)
    after = {r: p.metadata.uid for r, p in job.world.worker_pods(job.ns, job.name).items()}
    status = job.status()
    if after != uids or status.get("totalRestarts"):
        v.problems.append(f"pods replaced after a containerd restart: {uids} -> {after}")
    v.notes.append(f"containerd of {node} restarted (replica {replica}); nothing replaced")
    return set()


def image_pull(job: ChaosJob, v: Verdict) -> set[str]:
    job.wait_training(30)
    w = job.world
    replica = 1
    good = job.manifest["spec"]["template"]["spec"]["containers"][0]["image"]
    patch = [{"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": MISSING_IMAGE},
             {"op": "replace", "path": "/spec/template/spec/containers/0/imagePullPolicy", "value": "IfNotPresent"}]
    w.kubectl("patch", "tj", job.name, "-n", job.ns, "--type=json", "-p", json.dumps(patch))
    old = w.worker_pods(job.ns, job.name)[replica].metadata.name
    job.mark_fault()
    w.kubectl("delete", "pod", old, "-n", job.ns, "--wait=false")

    def pulling():
        pod = w.worker_pods(job.ns, job.name).get(replica)
        waiting = [c.state.waiting.reason for c in (pod.status.container_statuses or []) if c.state.waiting] \
            if pod and pod.metadata.name != old else []
        return pod if any(r in ("ErrImagePull", "ImagePullBackOff") for r in waiting) else None
    stuck = w.wait(f"replica {replica}'s replacement failing to pull", pulling, 120)
    training_goes_on(job, CHECKPOINT_INTERVAL, 120)  # on the other two
    names = {p.metadata.name for p in w.all_pods(job.ns) if p.metadata.labels.get("transom.io/replica") == str(replica)}
    if len(names - {old}) != 1:
        v.problems.append(f"replica {replica} got pods {sorted(names - {old})} while the image could not be pulled")
    v.detect_s = job.since_fault()
    # The user fixes the image; the stuck pod is replaced with it.
    fix = [{"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": good},
           {"op": "replace", "path": "/spec/template/spec/containers/0/imagePullPolicy", "value": "Never"}]
    w.kubectl("patch", "tj", job.name, "-n", job.ns, "--type=json", "-p", json.dumps(fix))
    w.kubectl("delete", "pod", stuck.metadata.name, "-n", job.ns, "--wait=false")  # as the Event tells the user
    v.notes.append("image fixed in spec.template and the stuck pod deleted, as the ImagePullFailed Event says")
    v.recover_s = job.wait_contributing()
    return {"ImagePullFailed"}


SCENARIOS: dict[str, Callable[[ChaosJob, Verdict], set[str]]] = {
    "node_loss": node_loss, "partition": partition, "drain": drain, "coordinator_loss": coordinator_loss,
    "operator_loss": operator_loss, "storage_outage": storage_outage, "image_pull": image_pull,
    "containerd_restart": containerd_restart,
}
