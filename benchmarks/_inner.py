"""`ftar_overhead.py --inner ddp|fsdp`: the failure-free step of replicas with ranks of their own.

Where large models train, a replica is several processes with DDP or FSDP2 inside it. Here:
2 replicas x 2 ranks (benchmarks/scripts/inner_worker.py), each rank on one core's worth
of the machine, in the accelerator-shaped form by default (the compute's time as waits that
release the CPU, per module, so that communication can hide behind it; workload.py), the
waits calibrated from the passes of one process alone (`workload.py --env`). Systems:

- `flat`: no fault tolerance, one world over the 4 ranks started by torchrun: DDP over all
  of them (`--inner ddp`), or HSDP (`--inner fsdp`: FSDP2 on a (replica, shard) mesh);
- `transom`: `transom run --replicas 2 --nproc-per-replica 2`, DDP or FSDP2 over each
  replica's own ranks, the exchange across replicas overlapped with backward by their own
  hooks (ft/inner_reduction.py);
- `transom_slices` (asked for with `--systems`): Transom under DDP with every bucket
  exchanged in slices, as HSDP (TRANSOM_DDP_EXCHANGE=slices), not in one group over every
  rank of every replica (the default);
- `transom_base` with `--base REV`: REV's Transom on the same worker.

torchft 0.2.0 is not run in these shapes: its DDP wrapper replaces the in-replica
reduction of a replica of one process, and its HSDP needs its own managed device mesh,
which this worker does not build. Figures as the rest of ftar_overhead.py: alternating
rounds, per system the median of its runs' medians, per-round ratios with p25-p75.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
from pathlib import Path

from _base import BASE
from _common import run_bounded
from _rounds import flat, solo_waits, spread, step_times

WORKER = Path(__file__).resolve().parent / "scripts" / "inner_worker.py"
REPLICAS, RANKS = 2, 2
TARGET_RATIO = 1.05  # the step against the same ranks without fault tolerance
SLICED = "transom_slices"


def shape_env(shape: str, model: str) -> dict[str, str]:
    """BENCH_SHAPE and, accelerator-shaped, the waits of one process's passes (workload.py --env)."""
    return {"BENCH_SHAPE": shape} if shape == "cpu_bound" else solo_waits(shape, model)


def one_run(system: str, inner: str, model: str, steps: int, out: Path, env: dict[str, str],
            timeout_s: float, warmup: int) -> tuple[float, bool | None]:
    """One run's median step time over every rank's steps after `warmup`, and (Transom)
    whether its replicas ended bit-identical."""
    out.mkdir()
    worker = [str(WORKER), "--system", "flat" if system == "flat" else "transom", "--inner", inner,
              "--steps", str(steps), "--model", model]
    if system == "flat":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
               str(REPLICAS * RANKS), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *worker]
    else:
        cmd = [sys.executable, "-m", "transom", "run", "--replicas", str(REPLICAS), "--nproc-per-replica",
               str(RANKS), "--quiet", "--timeout", str(timeout_s), "--summary-json", str(out / "summary.json"),
               "--", sys.executable, *worker]
    run_env = {**os.environ, "BENCH_OUT": str(out), "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "1"), **env}
    res = run_bounded(cmd, timeout_s + 30, out / "run.log", run_env)
    times = step_times(out, "flat" if system == "flat" else "transom", warmup)
    if res.returncode != 0 or not times:
        tail = (out / "run.log").read_text(errors="replace")[-2500:]
        raise SystemExit(f"{system} ({inner} inside) on {model} failed with {res.returncode}:\n{tail}")
    identical = None
    if system != "flat":
        identical = json.loads((out / "summary.json").read_text()).get("replicas_bit_identical") is True
    return statistics.median(times), identical


def run(inner: str, model: str, shapes: list[str], steps: int, repeats: int, warmup: int, timeout_s: float,
        work: Path, base: dict[str, str], asked: list[str] | None = None) -> dict:
    """Every round runs every system (`asked`, default flat, transom and the base if given) in
    each shape; per shape the figures (and the JSON's part)."""
    systems = ["flat", "transom"] + [s for s in (asked or []) if s == SLICED] + ([BASE] if base else [])
    result: dict = {}
    for shape in shapes:
        env = shape_env(shape, model)
        medians: dict[str, list[float]] = {s: [] for s in systems}
        identical: list[bool | None] = []
        for rnd in range(repeats):
            for system in systems[rnd % len(systems):] + systems[:rnd % len(systems)]:
                extra = base if system == BASE else {"TRANSOM_DDP_EXCHANGE": "slices"} if system == SLICED else {}
                median, same = one_run(system, inner, model, steps, work / f"{inner}-{model}-{shape}-{system}-{rnd}",
                                       {**env, **extra}, timeout_s, warmup)
                medians[system].append(median)
                identical.append(same)
                print(f"{inner} inside {model} {shape:18s} round {rnd} {system:12s} median step "
                      f"{median * 1e3:8.2f} ms", flush=True)
        figures: dict = {f"{s}_step_s": round(statistics.median(v), 6) for s, v in medians.items()}
        for other in [s for s in systems if s != "transom"]:
            figures.update(flat(f"ratio_vs_{other}", spread([t / o for t, o in zip(medians["transom"],
                                                                                     medians[other])])))
        figures["transom_bit_identical"] = all(x is not False for x in identical)
        figures["waits"] = {k: float(v) for k, v in env.items() if k.startswith("BENCH_WAIT")}
        print(f"{inner} inside {model} {shape}: " + ", ".join(f"{k} {v}" for k, v in figures.items()
                                                             if not isinstance(v, dict)), flush=True)
        result[shape] = figures
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
