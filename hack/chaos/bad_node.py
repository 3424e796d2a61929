"""The bad-node scenario: a node whose device computes wrong, found before anything trains on it.

A real node is made bad for the job's replica 0 by the pre-flight fault of inject.py
(`corrupt:phase=preflight,node=NODE`: the compute check's result on that node is wrong, as
on a device that miscalculates), at every check, for as long as the job runs. Replica 0's
first pod is steered there (a preferred node affinity in the job's template, which a user
may write), so the fault is met at the job's very first start. The pod's launcher runs the
checks before its workers (spec.preflight, all of them by default), exits 6 with
`PreflightFailed: compute: ...`, and the operator excludes the node and places replica 0
elsewhere; nothing of replica 0 ever trained on the bad node. Then the job is judged as any
other scenario's (job.py): Succeeded at its step, nothing lost, bit-identical.
"""

from __future__ import annotations

from chaos.job import ChaosJob, Verdict, tended
from chaos.scenarios import environment_problems
from chaos.world import World

REASON = "PreflightFailed"


def bad_node(world: World, steps: int) -> Verdict:
    node = world.real_nodes()[0]
    fault = f"corrupt:replica=0,step=0,count=1000,phase=preflight,node={node}"
    job = ChaosJob(world, "chaos-bad-node", steps, env={"TRANSOM_FAULT": fault})
    job.manifest["spec"]["template"]["spec"]["affinity"] = {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
            "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}}]}}
    verdict = Verdict("bad_node")
    try:
        with tended(job, verdict):
            job.start()
            job.mark_fault()

            def excluded():
                found = [e for e in job.status().get("excludedNodes") or [] if e.get("name") == node]
                return found[0] if found else None
            entry = world.wait(f"node {node} excluded", excluded, 180)
            verdict.detect_s = job.since_fault()
            if entry.get("reason") != REASON:
                verdict.problems.append(f"node {node} excluded for {entry.get('reason')}, not {REASON}")
            r0: dict = next((r for r in job.status().get("replicas") or [] if r["id"] == 0), {})
            message = (r0.get("lastFailure") or {}).get("message", "")
            verdict.notes.append(f"node {node} excluded {verdict.detect_s:.1f} s after the job was created: {message}")
            if "compute: " not in message:
                verdict.problems.append(f"replica 0's failure does not name the compute check: {message!r}")
            job.wait_training(10)
            verdict.recover_s = job.since_fault()
            where = job.world.worker_pods(job.ns, job.name)[0].spec.node_name
            verdict.notes.append(f"replica 0 trains on {where}")
            if where == node:
                verdict.problems.append(f"replica 0 runs on the excluded node {node}")
            job.end_after()
            final = job.finish()
            job.judge(verdict, final, {REASON})
    finally:
        verdict.problems += environment_problems(world)
    verdict.survived = not verdict.problems
    return verdict
