"""How the comparison benchmarks make a figure that a second run repeats (not a benchmark itself).

On a shared 2-core machine one system's median against another's, each over its own runs,
swings by tens of percent between two runs of the same benchmark: a slow drift of the
machine (another job, the page cache, thermal limits) hits whichever system ran then.
So the systems alternate, in a rotating order, over at least `MIN_ROUNDS` rounds; a
round's ratio pairs runs made back to back, and the figure is the median of the rounds'
ratios with their spread (p25-p75). The 1-minute load average before every run is
recorded beside it. A target counts when the median meets it and a second run of the
benchmark agrees: its median lies within this run's spread, or this run's median within
its (`agreement`, `--agree-with PREVIOUS_OUTPUT`).

Also here: the environment that gives a run's workers a workload shape
(benchmarks/scripts/workload.py: `cpu_bound` or `accelerator_shaped`), calibrated once per
benchmark by two short runs (`shape_env`), and the step times of a run's logs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from _replicas import Job, run_transom
from netns import Cluster

MIN_ROUNDS = 7
SHAPES = ("cpu_bound", "accelerator_shaped")
WORKLOAD = Path(__file__).resolve().parent / "scripts" / "workload.py"


def spread(values: Sequence[float], digits: int = 4) -> dict[str, float | int]:
    """The median of `values` and their p25-p75 (the inclusive method: exact with few values)."""
    if not values:
        return {"n": 0}
    if len(values) == 1:
        q25 = q75 = values[0]
    else:
        q25, _, q75 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": round(statistics.median(values), digits), "p25": round(q25, digits),
            "p75": round(q75, digits), "n": len(values)}


def flat(name: str, s: dict) -> dict[str, float | int]:
    """`name` (the median), `name_p25`, `name_p75`, `name_rounds`: the keys of a JSON line."""
    if not s.get("n"):
        return {f"{name}_rounds": 0}
    return {name: s["median"], f"{name}_p25": s["p25"], f"{name}_p75": s["p75"], f"{name}_rounds": s["n"]}


def agrees(previous: dict, current: dict, name: str) -> bool | None:
    """Whether two runs' figures `name` agree: either median within the other's p25-p75.
    None when either run lacks it."""
    keys = (name, f"{name}_p25", f"{name}_p75")
    if not all(isinstance(run.get(k), (int, float)) for run in (previous, current) for k in keys):
        return None
    inside = lambda a, b: b[f"{name}_p25"] <= a[name] <= b[f"{name}_p75"]  # noqa: E731
    return inside(previous, current) or inside(current, previous)


def agreement(previous: dict, current: dict, names: Sequence[str], groups: Sequence[str]) -> dict:
    """{group: {name: agrees}} for every figure both runs have in `groups` (e.g. the shapes)."""
    out: dict = {}
    for group in groups:
        found = {n: agrees(previous.get(group, {}), current.get(group, {}), n) for n in names}
        out[group] = {n: v for n, v in found.items() if v is not None}
    return out


def last_json(path: str) -> dict:
    """The last JSON line of a benchmark's saved output."""
    for line in reversed(Path(path).read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"{path}: no JSON line (give the saved stdout of an earlier run of this benchmark)")


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def step_ends(out: Path, system: str) -> list[list[float]]:
    """Per replica's log, the wall times at which its steps ended."""
    return [[json.loads(x)["t"] for x in path.read_text().splitlines()[1:] if x.strip().endswith("}")]
            for path in out.glob(f"{system}-r*-*.jsonl")]


def step_times(out: Path, system: str, warmup: int) -> list[float]:
    """Every replica's step times after `warmup` steps (end to end of the logged steps)."""
    return [b - a for ends in step_ends(out, system) for a, b in zip(ends[warmup:], ends[warmup + 1:])]


def solo_waits(shape: str, model: str) -> dict[str, str]:
    """BENCH_SHAPE and the waits of `shape` as one process's passes split them (workload.py --env)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "1")}
    solo = subprocess.run([sys.executable, str(WORKLOAD), "--env", shape, "--model", model],
                          capture_output=True, text=True, timeout=300, env=env)
    if solo.returncode != 0:
        raise SystemExit(f"calibrating {shape} for {model} failed:\n{solo.stderr[-2000:]}")
    return json.loads(solo.stdout.strip().splitlines()[-1])


def shape_env(shape: str, model: str, replicas: int, net: Cluster | None = None, steps: int = 25) -> dict[str, str]:
    """BENCH_SHAPE (and the calibrated waits) for the workers of `model` in `shape`.

    The accelerator-shaped step is calibrated to the CPU-bound step's time as the replicas
    run it here: two short runs of Transom's replicas (no fault), one CPU-bound and one
    accelerator-shaped without waits, and the waits make up the difference, split between
    forward and backward as the passes split their time in one process alone
    (workload.py --env). What both shapes share (the exchange, the vote, the optimizer
    step) is thereby measured, not estimated; the benchmark itself never imports torch."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    if shape == "cpu_bound":
        return {"BENCH_SHAPE": shape}
    split = solo_waits(shape, model)
    fwd, bwd = float(split["BENCH_WAIT_FWD_S"]), float(split["BENCH_WAIT_BWD_S"])
    step = {}
    for name, run_env in (("cpu", {"BENCH_SHAPE": "cpu_bound"}),
                          ("light", {"BENCH_SHAPE": shape, "BENCH_WAIT_FWD_S": "0", "BENCH_WAIT_BWD_S": "0"})):
        with tempfile.TemporaryDirectory(prefix="transom-calibrate-") as tmp:
            outcome = run_transom(Job(Path(tmp), model, steps, replicas=replicas, timeout_s=300, net=net, env=run_env))
            times = step_times(Path(tmp), "transom", 5)
            if not outcome.ok or not times:
                raise SystemExit(f"calibrating {shape} for {model}: the {name} run failed: {outcome.detail}")
            step[name] = statistics.median(times)
    wait = max(0.0, step["cpu"] - step["light"])
    share = fwd / (fwd + bwd) if fwd + bwd > 0 else 1 / 3
    print(f"calibrated {shape} for {model}: CPU-bound step {step['cpu']:.4f} s, without waits {step['light']:.4f} s;"
          f" waits {wait:.4f} s per step ({share:.0%} in the forward pass)", flush=True)
    return {"BENCH_SHAPE": shape, "BENCH_WAIT_FWD_S": f"{wait * share:.6f}",
            "BENCH_WAIT_BWD_S": f"{wait * (1 - share):.6f}"}
