"""FTAR overhead: the failure-free step of Transom against plain DDP and torchft's manual loop.

Purpose
    What does fault tolerance cost when nothing fails? Three systems train the same
    workload (benchmarks/scripts/workload.py) with the same processes (one per replica),
    backend (Gloo on CPU), optimizer, batches and steps, started by benchmarks/_replicas.py:

    - ddp:     one torch.distributed world, the model wrapped in DistributedDataParallel
               (its bucketed all-reduce overlaps the backward pass);
    - torchft: torchft 0.2.0's manual loop (its lighthouse, `manager.allreduce` of every
               gradient, `should_commit`), when torchft is installed (`make bench-deps`);
    - transom: `transom run`, the ordinary loop with `trainer.optimizer` (quorum request
               overlapped with the forward pass, FTAR per bucket during backward, the vote).
               Local mode's coordinator and launchers share the machine with the workers,
               so their CPU time is part of the figure.

    on three models: `tinygpt` (the example's tiny GPT, a compute-light step), `mlp` (the
    ~100 MB MLP of the recovery benchmark, where moving the gradients dominates) and
    `small15` (a 4 MB toy MLP whose DDP step takes about 15 ms here: Transom's fixed cost
    per step, the quorum round trip, the vote and the bookkeeping, shows on it).

Figures
    Each worker logs every step's end; a step's time is the time between the ends of two
    consecutive steps (everything the loop does is counted). Per run the median over the
    replicas' steps after the first `--warmup`. The systems alternate, in a rotating order,
    for `--repeats` rounds, so a slow drift of a shared machine hits all alike; per system
    the median of its run medians; Transom's replicas must also end bit-identical
    (`transom_bit_identical`). `ratio_vs_faster` = Transom / min(DDP, torchft), target
    <= 1.02; `ratio_vs_ddp`, `ratio_vs_torchft` beside it; `overhead_vs_ddp` is Transom's
    extra time per step over DDP's in percent, by the medians, and `round_overhead_vs_ddp`
    the median of the rounds' own (the runs of a round are back to back, so a round's ratio
    is the fairest pairing on a shared machine). `load_avg` is the 1-minute load
    average before each run. The last line of stdout is one JSON object with every model's
    figures.

How to run
    .venv/bin/python benchmarks/ftar_overhead.py                                  # both models
    .venv/bin/python benchmarks/ftar_overhead.py --models tinygpt --repeats 1 --steps 30   # quick
    .venv/bin/python benchmarks/ftar_overhead.py --models small15 --replicas 2 --repeats 5  # fixed cost
    .venv/bin/python benchmarks/ftar_overhead.py --base 91de83f --systems transom,transom_base  # vs a commit
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _base import BASE, base_env  # noqa: E402
from _replicas import RUNNERS, Job  # noqa: E402

TARGET_RATIO = 1.02
STEPS = {"tinygpt": 60, "mlp": 30, "small15": 400}  # default steps per run: ~6-15 s each on the development box


def step_times(out: Path, system: str, warmup: int) -> list[float]:
    """Every replica's step times after `warmup` steps (end to end of committed steps)."""
    times: list[float] = []
    for path in out.glob(f"{system}-r*-*.jsonl"):
        ends = [json.loads(x)["t"] for x in path.read_text().splitlines()[1:] if x.strip().endswith("}")]
        times += [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]
    return times


def run_model(args: argparse.Namespace, model: str, systems: list[str], work: Path,
              base: dict[str, str] | None = None) -> dict:
    steps = args.steps or STEPS[model]
    medians: dict[str, list[float]] = {s: [] for s in systems}
    load_avg: list[float] = []
    identical: list[bool] = []  # Transom's replicas ended bit-identical, per run
    for rnd in range(args.repeats):
        order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
        for system in order:
            out = work / f"{model}-{system}-{rnd}"
            out.mkdir()
            load_avg.append(round(os.getloadavg()[0], 2))
            runner, logs = (RUNNERS["transom"], "transom") if system == BASE else (RUNNERS[system], system)
            outcome = runner(Job(out, model, steps, replicas=args.replicas, timeout_s=args.run_timeout,
                                 env=(base or {}) if system == BASE else {}))
            times = step_times(out, logs, args.warmup)
            if not outcome.ok or not times:
                raise SystemExit(f"{system} on {model} failed: {outcome.detail}")
            if system == "transom":
                identical.append(json.loads((out / "summary.json").read_text()).get("replicas_bit_identical") is True)
            medians[system].append(statistics.median(times))
            print(f"{model} round {rnd} {system:8s} median step {medians[system][-1] * 1e3:8.2f} ms "
                  f"(p10 {statistics.quantiles(times, n=10)[0] * 1e3:8.2f}; {len(times)} steps; load {load_avg[-1]})",
                  flush=True)
    figures: dict = {f"{s}_step_s": round(statistics.median(v), 6) for s, v in medians.items()}
    transom = figures["transom_step_s"]
    others = {s: figures[f"{s}_step_s"] for s in systems if s != "transom"}
    for s, v in others.items():
        figures[f"ratio_vs_{s}"] = round(transom / v, 4)
    if "ddp" in others:
        figures["overhead_vs_ddp"] = round(100 * (transom / others["ddp"] - 1), 2)
        rounds = [t / d - 1 for t, d in zip(medians["transom"], medians["ddp"])]
        figures["round_overhead_vs_ddp"] = round(100 * statistics.median(rounds), 2)
    others.pop(BASE, None)  # an older Transom is no other system
    if others:
        figures["ratio_vs_faster"] = round(transom / min(others.values()), 4)
    figures.update(steps=steps, transom_bit_identical=all(identical), load_avg=load_avg)
    print(f"{model}: " + ", ".join(f"{k} {v}" for k, v in figures.items() if k != "load_avg"), flush=True)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tinygpt,mlp")
    p.add_argument("--replicas", type=int, default=3, help="processes (one per replica)")
    p.add_argument("--steps", type=int, default=0, help="steps per run (default: 60 tinygpt, 30 mlp, 400 small15)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every system once")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds before a run is killed")
    p.add_argument("--base", metavar="REV", help=f"also run commit REV's Transom ({BASE}; benchmarks/_base.py)")
    p.add_argument("--systems", help="a subset of ddp,transom,torchft (and transom_base with --base)")
    args = p.parse_args()
    systems = ["ddp", "transom"] + (["torchft"] if importlib.util.find_spec("torchft") else [])
    if "torchft" not in systems:
        print("torchft is not installed (make bench-deps): comparing with DDP only", flush=True)
    systems += [BASE] if args.base else []
    if args.systems:
        systems = [s for s in systems if s in args.systems.split(",")]
    if "transom" not in systems:
        p.error("--systems must include transom")
    result: dict = {"benchmark": "ftar_overhead", "replicas": args.replicas, "backend": "gloo", "cpus": os.cpu_count(),
                    "repeats": args.repeats, "warmup": args.warmup, "target_ratio": TARGET_RATIO}
    if args.base:
        result["base"] = args.base
    with tempfile.TemporaryDirectory(prefix="transom-ftar-") as tmp, base_env(args.base) as base:
        for model in args.models.split(","):
            result[model] = run_model(args, model, systems, Path(tmp), base)
    # The target holds against the other systems; a run with --systems transom,transom_base has
    # none, and then only says whether the replicas ended bit-identical.
    result["ok"] = all(result[m].get("ratio_vs_faster", 0) <= TARGET_RATIO and result[m]["transom_bit_identical"]
                       for m in args.models.split(","))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
