"""The OOM kills the launchers report, per replica: what `status.training.oomKills` says.

A launcher whose worker the kernel OOM-killed restarts it in place, in the same pod: the
operator sees the pod running on, so nothing of it reaches the job's status except through
the coordinator, which the launcher reports the failure to (`OOMKilled: worker rank 0 was
OOMKilled (memory limit 3Gi)`, launch/supervisor.py). The coordinator keeps, per replica,
how many such reports came since it started (every generation's, each incarnation counted
once however often its report was retried) and the last one, and writes them with the rest
of status.training; the operator shows the last one as the replica's lastFailure and posts
an `OOMKilled` Event (reconcile/oom.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from transom import contract
from transom.coordinator.models import FailureReport

MAX_MESSAGE = 256  # one line; a status of 4,096 replicas must stay far below etcd's 1.5 MB


@dataclass
class _Kills:
    generation: int
    attempt: int
    count: int
    time: float  # wall clock, unix seconds
    message: str


class OomKills:
    """Per replica id: its reported OOM kills."""

    def __init__(self) -> None:
        self._by_replica: dict[int, _Kills] = {}

    def record(self, report: FailureReport, wall: float) -> bool:
        """Count `report` if it says OOMKilled and is news: not a retry of the last one, nor
        about an older incarnation than that. Returns whether it counted."""
        if not report.reason.startswith(contract.OOM_KILLED + ":"):
            return False
        who = report.identity
        last = self._by_replica.get(who.replica_id)
        if last is not None and (who.generation, who.attempt) <= (last.generation, last.attempt):
            return False
        message = report.reason.removeprefix(contract.OOM_KILLED + ":").strip()[:MAX_MESSAGE]
        self._by_replica[who.replica_id] = _Kills(who.generation, who.attempt,
                                                  (last.count if last else 0) + 1, wall, message)
        return True

    def status(self) -> list[dict]:
        """`status.training.oomKills`, in replica order (camelCase, as the CRD has it)."""
        return [{"replica": r, "generation": k.generation, "count": k.count,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(k.time)), "message": k.message}
                for r, k in sorted(self._by_replica.items())]
