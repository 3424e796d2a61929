"""Out of memory: how the operator tells an OOM kill, shows it, and ends a job that keeps running out.

An incarnation of a replica ended OOMKilled when one of its pods failed with
- the container's terminated reason `OOMKilled`: the kubelet's word that the kernel's OOM
  killer struck in the container (on cgroup v2 nodes it kills the whole container,
  launcher included; on v1 containerd's CRI marks a container that way once any of its
  processes was killed, so a pod whose launcher later exited for another cause shows it too),
- the launcher's exit code `EXIT_OOM_KILLED` (5): its workers were OOMKilled
  `defaults.OOM_KILL_LIMIT` times, each restarted in place (launch/supervisor.py), or
- a termination message that begins `OOMKilled:` (a launcher that gave up on its restarts
  with an OOM kill as the last failure).
That is the script's memory at the template's limit, not the node's fault: no node is
excluded for it, and it never counts as a second failure on a node (RepeatedFailures).

Repeated OOMs end the job with reason OOMKilled instead of a replacement that would run
out of memory the same way (`ends_job`):
- a pod that exited 5 ends it at once: its launcher already saw OOM_KILL_LIMIT kills;
- so does the OOM_KILL_LIMIT-th incarnation of one replica within restartWindowSeconds that
  ended OOMKilled (`status.restartHistory` keeps each replacement's reason).
Its message: "replica 1 was OOMKilled 3 times at memory limit 3Gi: raise
resources.limits.memory or lower the batch size".

A kill the launcher restarted in place leaves the pod running: the operator learns of it
from the coordinator, which the launcher reported it to (`status.training.oomKills`), and
shows the last one of the replica's current incarnation as its lastFailure, with an
`OOMKilled` Event (`in_place`). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from transom import contract, defaults
from transom_operator import api, reasons
from transom_operator.reconcile.observe import ObservedPod, PodPhase

MAX_QUOTED = 1024  # of a termination message quoted in a failure's message
PREFIX = contract.OOM_KILLED + ":"


def is_oom_killed(pod: ObservedPod) -> bool:
    """Whether the pod (Failed, not deleted: the caller checks) ended by an OOM kill."""
    return (pod.reason == reasons.OOM_KILLED or pod.exit_code == contract.EXIT_OOM_KILLED
            or (pod.message or "").startswith(PREFIX))


def pod_message(pod: ObservedPod, where: str) -> str:
    """lastFailure's message: the pod, its limit, and what its launcher said about it."""
    limit = f"memory limit {pod.memory_limit}" if pod.memory_limit else "no memory limit"
    said = (pod.message or "").removeprefix(PREFIX).strip()[:MAX_QUOTED]
    return f"pod {pod.name}{where} was {reasons.OOM_KILLED} ({limit})" + (f": {said}" if said else "")


def ends_job(replica: int, generation: int, pods: Iterable[ObservedPod], history: Iterable[api.RestartRecord],
             limit: int = defaults.OOM_KILL_LIMIT) -> str | None:
    """The Failed condition's message if the OOMKilled end of `replica`'s incarnation
    `generation` (its pods: `pods`) ends the job; None if it is replaced as usual.
    `history`: the replacements within the restart window, before this one."""
    killed = [p for p in pods if p.phase == PodPhase.FAILED and not p.deleting and is_oom_killed(p)]
    if not killed:
        return None
    earlier = len({h.generation for h in history
                   if h.replica == replica and h.generation != generation and h.reason == reasons.OOM_KILLED})
    gave_up = any(p.exit_code == contract.EXIT_OOM_KILLED for p in killed)
    times = earlier + (limit if gave_up else 1)  # each kill restarted in place counted by the launcher
    if times < limit:
        return None
    memory = next((p.memory_limit for p in killed if p.memory_limit), None)
    return contract.oom_advice(f"replica {replica}", times, memory)


def in_place(record: api.OomKills | None, generation: int, shown: api.Failure | None) -> api.Failure | None:
    """The lastFailure that the coordinator's `record` of the replica's OOM kills makes, if
    it is news: a kill in the replica's current incarnation `generation`, not `shown` yet."""
    if record is None or record.generation != generation or record.time is None:
        return None
    if shown is not None and shown.reason == reasons.OOM_KILLED and shown.time == record.time:
        return None
    kills = f"{record.count} OOM kill{'s' if record.count != 1 else ''} of this replica reported"
    return api.Failure(reason=reasons.OOM_KILLED, time=record.time,
                       message=f"{record.message or 'a worker was OOMKilled'}; restarted in place ({kills})")


def records(training: api.TrainingProgress) -> Mapping[int, api.OomKills]:
    """status.training.oomKills by replica id."""
    return {k.replica: k for k in training.oom_kills}
