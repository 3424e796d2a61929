"""What the pre-flight checks add to a replacement: the launcher's wait before its workers start.

    .venv/bin/python benchmarks/preflight.py [--rounds 7] [--nproc 1]

Purpose: issue 33 asks that the default pre-flight (every check, `spec.preflight`'s defaults)
slows a replacement by no more than a few seconds on a CPU node. A launcher with
TRANSOM_PREFLIGHT runs `transom check --json` in a child process and starts its workers only
once it answered (launch/preflight.py), so the time of `preflight.run` is exactly what a
new pod adds before its first worker starts. It is measured here with the code a pod runs:
every check, a checkpoint location (a local directory), `--nproc` local processes (1: the
collective check is skipped, as in a one-process pod), no coordinator and no peer (the link
check and the clock skipped). Each round also times `python -c "import torch"` in a fresh
process, the part of the wait any worker start pays anyway, so the checks' own share is
visible: their time minus one torch import. The per-check seconds are from the child's
own answer. Rounds alternate the two; medians with p25/p75 and the load average are
printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launcher"))

from transom import contract  # noqa: E402
from transom.launch import preflight  # noqa: E402


def _env(nproc: int, checkpoint: str) -> contract.ReplicaEnv:
    return contract.ReplicaEnv(job="bench", replica_id=0, num_replicas=1, generation=0, attempt=0, node_rank=0,
                               nnodes=1, nproc_per_node=nproc, coordinator_url="", coordinator_token="",
                               checkpoint_uri=checkpoint, advertise_addr="127.0.0.1")


def _checks_once(nproc: int, checkpoint: str) -> tuple[float, dict[str, float]]:
    """Wall seconds of one pre-flight as a launcher waits for it, and each check's own seconds."""
    spec = preflight.PreflightSpec(contract.PREFLIGHT_CHECKS)
    environ = {k: v for k, v in os.environ.items() if k != contract.ENV_FAULT}
    environ["PYTHONPATH"] = str(ROOT / "launcher")
    t0 = time.monotonic()
    check = preflight.Check(spec, _env(nproc, checkpoint), environ, 0)
    while True:
        if check.proc.poll() is not None:
            break
        time.sleep(0.01)
    wall = time.monotonic() - t0
    assert check.proc.stdout is not None
    answer = json.loads(check.proc.stdout.read().decode().strip().splitlines()[-1])
    check.stop()
    if not answer["passed"]:
        raise SystemExit(f"a check failed on this machine: {answer}")
    return wall, {c["name"]: c["seconds"] for c in answer["checks"]}


def _torch_import_once() -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - t0


def _spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{statistics.median(xs):.2f} s (p25 {q[0]:.2f}, p75 {q[2]:.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--nproc", type=int, default=1)
    args = p.parse_args()
    walls: list[float] = []
    imports: list[float] = []
    loads: list[float] = []
    per_check: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="transom-preflight-bench-") as checkpoint:
        for _ in range(args.rounds):
            imports.append(_torch_import_once())
            wall, checks = _checks_once(args.nproc, checkpoint)
            walls.append(wall)
            for name, seconds in checks.items():
                per_check.setdefault(name, []).append(seconds)
            loads.append(os.getloadavg()[0])
    own = [w - i for w, i in zip(walls, imports)]
    print(f"pre-flight, every check, nproc {args.nproc}, {args.rounds} rounds, load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print(f"  the launcher's wait (transom check --json, start to answer): {_spread(walls)}")
    print(f"  a fresh `import torch` alone:                              {_spread(imports)}")
    print(f"  the wait less one torch import:                            {_spread(own)}")
    for name in contract.PREFLIGHT_CHECKS:
        print(f"  {name:<11} {_spread(per_check.get(name, [0.0]))}")
    print(json.dumps({"benchmark": "preflight", "nproc": args.nproc, "rounds": args.rounds,
                      "wait_s": round(statistics.median(walls), 3),
                      "torch_import_s": round(statistics.median(imports), 3),
                      "wait_less_import_s": round(statistics.median(own), 3),
                      "checks_s": {k: round(statistics.median(v), 3) for k, v in per_check.items()},
                      "load": [round(min(loads), 1), round(max(loads), 1)]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
