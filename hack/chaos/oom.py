"""The OOM scenario: a worker killed by the kernel at its container's memory limit.

Two jobs. The first has replica 1 allocate past its limit once (`TRANSOM_FAULT=oom:...`,
launcher/transom/inject.py): the launcher restarts it in place, status shows `OOMKilled`,
and the job trains to its end as any other scenario's (judged by job.py). The second has
replica 1 run out of memory at every attempt: the job must end Failed, with reason
`OOMKilled` and a message that says what to change, in bounded time (no crash loop).
"""

from __future__ import annotations

import time

from chaos.job import ChaosJob, Verdict, tended
from chaos.scenarios import run
from chaos.world import World

OOM_STEP = 40
REPEATED_TIMEOUT_S = 300


def _once(job: ChaosJob, v: Verdict) -> set[str]:
    job.wait_training(OOM_STEP - 10)
    job.mark_fault()

    def shown():
        r = next((x for x in job.status().get("replicas") or [] if x["id"] == 1), {})
        return r if (r.get("lastFailure") or {}).get("reason") == "OOMKilled" else None
    r = job.world.wait("replica 1's OOM kill in status", shown, 180)
    v.detect_s = job.since_fault()
    v.notes.append(f"status: {r['lastFailure'].get('message')}")
    if r.get("generation") != 0:
        v.problems.append(f"replica 1 was replaced (generation {r.get('generation')}), not restarted in place")
    v.recover_s = job.wait_contributing()
    return {"OOMKilled"}


def oom(world: World, steps: int) -> Verdict:
    fault = f"oom:replica=1,step={OOM_STEP}"
    verdict = run(world, "oom", _once, steps, env={"TRANSOM_FAULT": fault})
    # Repeated: every attempt of replica 1 runs out of memory.
    job = ChaosJob(world, "chaos-oom-repeated", steps, env={"TRANSOM_FAULT": ";".join([fault] * 3)})
    t0 = time.monotonic()
    with tended(job, verdict, "repeated OOM kills"):
        job.start()
        final = job.finish(REPEATED_TIMEOUT_S)
        failed: dict = next((c for c in final.get("conditions") or [] if c["type"] == "Failed"), {})
        message = failed.get("message") or ""
        verdict.notes.append(f"repeated OOM kills: {final.get('state')} after {time.monotonic() - t0:.0f} s: {message}")
        if final.get("state") != "Failed" or failed.get("reason") != "OOMKilled" or "limits.memory" not in message:
            verdict.problems.append(f"repeated OOM kills did not end the job clearly: {final.get('state')}, {failed}")
    verdict.survived = not verdict.problems
    return verdict
