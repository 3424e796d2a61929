"""CPU time of every process a benchmark run started, by what it is, from /proc (not a
benchmark itself).

On the 2-core development box the workers of a failure-free step fill both cores, so CPU
that anything else spends (the coordinator, the launchers, a worker's own threads) comes out
of the step: `CpuSampler` reads every thread of every descendant of this process every
`period` seconds, and `per_step` turns two wall times of the step logs into CPU
milliseconds per step by kind. Kinds: `coordinator` (the `transom run` process: the
coordinator thread, its display), `launchers`, and per worker thread `worker main` (the
training loop), `worker gloo` (Gloo's transport and work threads), `worker other` (the
rest: Transom's quorum, heartbeat and state-server threads, the TCPStore's).
"""

from __future__ import annotations

import bisect
import os
import threading
import time

from _common import descendants

TICK = os.sysconf("SC_CLK_TCK")


def kind(cmdline: str, pid: int, tid: int, comm: str) -> str:
    if "transom run" in cmdline:
        return "coordinator"
    if "transom launch" in cmdline:
        return "launchers"
    if "_worker.py" not in cmdline:
        return "other"
    if tid == pid:
        return "worker main"
    return "worker gloo" if "gloo" in comm else "worker other"


class CpuSampler(threading.Thread):
    def __init__(self, period: float = 0.1):
        super().__init__(name="cpu-sampler", daemon=True)
        self.period = period
        self._series: dict[tuple[int, int], list[tuple[float, float]]] = {}  # (pid, tid) -> (wall, cpu s)
        self._kind: dict[tuple[int, int], str] = {}
        self._cmdline: dict[int, str] = {}  # the last one read: a forked child has its parent's until exec
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.period):
            now = time.time()
            for pid in descendants(os.getpid()):
                self._sample(pid, now)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def _sample(self, pid: int, now: float) -> None:
        try:
            cmdline = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return
        self._cmdline[pid] = cmdline or self._cmdline.get(pid, "")
        for t in tids:
            try:
                stat = open(f"/proc/{pid}/task/{t}/stat").read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            key = (pid, int(t))
            self._kind[key] = kind(self._cmdline[pid], pid, int(t), comm)
            self._series.setdefault(key, []).append((now, (int(fields[11]) + int(fields[12])) / TICK))

    def per_step(self, t0: float, t1: float, steps: int) -> dict[str, float]:
        """CPU milliseconds per step by kind between wall times t0 and t1 (`steps` steps);
        a thread counts from its first sample after t0 to its last before t1."""
        out: dict[str, float] = {}
        for key, series in self._series.items():
            walls = [w for w, _ in series]
            i, j = bisect.bisect_left(walls, t0), bisect.bisect_right(walls, t1) - 1
            if i < len(series) and j > i:
                k = self._kind[key]
                out[k] = out.get(k, 0.0) + (series[j][1] - series[i][1]) * 1e3 / max(1, steps)
        return {k: round(v, 3) for k, v in sorted(out.items()) if k != "other"}
