"""The collective check: can the replica's local ranks all-reduce, right and fast enough?

`nproc` child processes (`python -m transom.check.collective_worker`, one per local rank:
Gloo on the CPU, NCCL across GPUs 0 .. nproc-1) meet on a free loopback port and sum a
tensor of BYTES several times; each reports, as a JSON line, how many elements of its sums
were wrong and the bus bandwidth of its fastest all-reduce. The value is the slowest
rank's bus bandwidth. It fails on any wrong element, a rank that fails, a bandwidth below
the device's floor, or time spent: then every rank still running is killed and reaped, so
no process of the check outlives it (the runner tells it through `Budget.stop`).

A replica of one process has no collective inside it: the check is skipped. Links between
replicas are the link check's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import transom
from transom.check.context import Budget, CheckContext
from transom.check.result import CheckResult, failed, measured, skipped, timed_out

NAME = "collective"
BYTES = 32 << 20  # large enough that bandwidth, not latency, sets the time; small enough to take ms
# The lowest bus bandwidth that passes. On GPUs, 2 GB/s is far below any PCIe or NVLink path
# between local devices: NCCL slower than that is going through something broken (no P2P,
# a socket fallback, a throttled link). Gloo over loopback on shared CPU cores says little
# about the node's training links: there only the sums are checked.
MIN_BUS_GBPS = {"cpu": 0.0, "cuda": 2.0}
POLL_S = 0.05
REAP_S = 5.0  # a killed rank is gone at once; this bounds the wait for the kernel to say so


def check(context: CheckContext, budget: Budget) -> CheckResult:
    if context.nproc < 2:
        return skipped(NAME, "a replica of one process has no collective inside it")
    with tempfile.TemporaryDirectory(prefix="transom-collective-") as tmp:
        ranks = _start(context, budget, Path(tmp))
        try:
            failure = _wait(ranks, budget)
            if failure is not None:
                return failure
            reports = [json.loads(out.read_text().strip().splitlines()[-1]) for _, out, _ in ranks]
        finally:
            _kill(ranks)
    bad = sum(int(r["bad_elements"]) for r in reports)
    gbps = min(float(r["bus_gbps"]) for r in reports)
    floor = MIN_BUS_GBPS[context.device]
    expected = "every sum right" + (f", >= {floor:g} GB/s" if floor else "")
    what = f"bus bandwidth {gbps:.2f} GB/s, {bad} wrong elements, {context.nproc} ranks, {BYTES >> 20} MiB"
    return measured(NAME, gbps, bad == 0 and gbps >= floor, expected, what)


Rank = tuple[subprocess.Popen, Path, Path]  # the process, its stdout file, its stderr file


def _start(context: CheckContext, budget: Budget, tmp: Path) -> list[Rank]:
    port = _free_port()
    env = dict(os.environ)
    # The ranks import transom from wherever this process did (a pod's image, a checkout).
    root = str(Path(transom.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # the ranks share the node's cores
    ranks: list[Rank] = []
    try:
        for rank in range(context.nproc):
            out, err = tmp / f"rank-{rank}.out", tmp / f"rank-{rank}.err"
            with open(out, "wb") as o, open(err, "wb") as e:
                command = [sys.executable, "-m", "transom.check.collective_worker", "--rank", str(rank),
                           "--world", str(context.nproc), "--port", str(port), "--device", context.device,
                           "--bytes", str(BYTES), "--timeout", f"{max(1.0, budget.left()):.1f}"]
                ranks.append((subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=o, stderr=e, env=env),
                              out, err))
    except BaseException:
        _kill(ranks)
        raise
    return ranks


def _wait(ranks: list[Rank], budget: Budget) -> CheckResult | None:
    """None once every rank exited 0; a failure for the first that did not, or for time spent."""
    while True:
        codes = [p.poll() for p, _, _ in ranks]
        for (_, _, err), code in zip(ranks, codes):
            if code not in (None, 0):
                return failed(NAME, f"a rank exited with {code}: {_last_line(err)}")
        if all(code == 0 for code in codes):
            return None
        if budget.over():
            return timed_out(NAME, budget.given)
        time.sleep(POLL_S)


def _kill(ranks: list[Rank]) -> None:
    """Every rank still running killed, and every rank reaped."""
    for p, _, _ in ranks:
        if p.poll() is None:
            p.kill()
    for p, _, _ in ranks:
        try:
            p.wait(REAP_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel (uninterruptible I/O): nothing more to do
            pass


def _free_port() -> int:
    """A port free on loopback now (rank 0's TCPStore binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1][:300] if lines else "(no output)"


