"""FTAR overhead: the failure-free step of Transom against plain DDP and torchft's manual loop.

Purpose
    What does fault tolerance cost when nothing fails? Three systems train the same
    workload (benchmarks/scripts/workload.py) with the same processes (one per replica),
    backend (Gloo on CPU), optimizer, batches and steps, started by benchmarks/_replicas.py:

    - ddp:     one torch.distributed world, the model wrapped in DistributedDataParallel
               (its bucketed all-reduce overlaps the backward pass);
    - torchft: torchft 0.2.0's manual loop (its lighthouse, `manager.allreduce` of every
               gradient, `should_commit`), when torchft is installed (`make bench-deps`);
    - torchft_nightly: the same loop on torchft-nightly (`make bench-deps` puts it in
               .cache/torchft-nightly), a column beside: `ratio_vs_torchft_nightly`;
    - transom: `transom run`, the ordinary loop with `trainer.optimizer` (quorum request
               overlapped with the forward pass, FTAR per bucket during backward, the vote).
               Local mode's coordinator and launchers share the machine with the workers,
               so their CPU time is part of the figure.

    on four models: `tinygpt` (the example's tiny GPT, a compute-light step), `mlp` (the
    ~100 MB MLP of the recovery benchmark, where moving the gradients dominates),
    `small15` (a 4 MB toy MLP whose DDP step takes about 15 ms here: Transom's fixed cost
    per step, the quorum round trip, the vote and the bookkeeping, shows on it), and `null`
    (one 16x16 linear layer: the step is the fixed cost alone).

Figures
    Each worker logs every step's end; a step's time is the time between the ends of two
    consecutive steps (everything the loop does is counted). Per run the median over the
    replicas' steps after the first `--warmup`. The systems alternate, in a rotating order,
    for `--repeats` rounds (default 7), so a slow drift of a shared machine hits all alike;
    per system the median of its run medians (`<system>_step_s`). The ratios are taken per
    round (the runs of a round are back to back: the fairest pairing on a shared machine)
    and reported as the median with its spread, p25-p75 (benchmarks/_rounds.py):
    `ratio_vs_ddp`, `ratio_vs_torchft`, and `ratio_vs_faster` = Transom / min(DDP, torchft)
    of the round, target <= 1.02 by the median. `overhead_vs_ddp` is Transom's extra time
    per step over DDP's in percent (from the median ratio). Transom's replicas must also
    end bit-identical (`transom_bit_identical`). `load_avg`: the 1-minute load average
    before each run, median and spread. `--agree-with OUTPUT` (an earlier run's saved
    stdout) adds `agreement`: per model, shape and ratio, whether the two runs' medians
    lie within each other's spread. With `--cpu`, each run also prints the CPU
    milliseconds per step that its processes and worker threads spent, by kind
    (benchmarks/_cpu.py), over the same steps: where a system's extra time goes.

Shapes
    Every round runs every system in each workload shape (benchmarks/scripts/workload.py):
    `cpu_bound` (the passes compute on the CPU) and `accelerator_shaped` (one-row batches
    and waits that release the CPU in place of the passes' arithmetic, calibrated at the
    start to the CPU-bound passes' time: `waits`), with the same gradients, exchange and
    optimizer. The last line of stdout is one JSON object: a key per shape (`cpu_bound`,
    `accelerator_shaped`), in it a key per model with its figures.

Inner shapes
    `--inner ddp|fsdp`: 2 replicas x 2 ranks with DDP or FSDP2 inside each replica, against
    the same 4 ranks without fault tolerance (DDP over all, or HSDP), accelerator-shaped by
    default (benchmarks/_inner.py); `ratio_vs_flat`, target <= 1.05.

How to run
    .venv/bin/python benchmarks/ftar_overhead.py | tee /tmp/ftar-1.txt           # both models, both shapes
    .venv/bin/python benchmarks/ftar_overhead.py --agree-with /tmp/ftar-1.txt      # the second run
    .venv/bin/python benchmarks/ftar_overhead.py --models tinygpt --repeats 1 --steps 30 --shapes cpu_bound  # quick
    .venv/bin/python benchmarks/ftar_overhead.py --models small15 --replicas 2 --repeats 7 --cpu  # fixed cost
    .venv/bin/python benchmarks/ftar_overhead.py --base 91de83f --systems transom,transom_base  # vs a commit
    .venv/bin/python benchmarks/ftar_overhead.py --inner ddp --models mlp --base 58763dc  # DDP inside the replica
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
from _cpu import CpuSampler  # noqa: E402
from _inner import TARGET_RATIO as INNER_TARGET  # noqa: E402
from _inner import run as run_inner  # noqa: E402
from _replicas import NIGHTLY, RUNNERS, Job, nightly_env, nightly_installed  # noqa: E402
from _rounds import MIN_ROUNDS, SHAPES, agreement, flat, last_json, load_avg, shape_env, spread, step_ends, step_times  # noqa: E402

TARGET_RATIO = 1.02
RATIOS = ("ratio_vs_ddp", "ratio_vs_torchft", "ratio_vs_torchft_nightly", "ratio_vs_faster")
# Default steps per run: ~6-15 s each on the development box.
STEPS = {"tinygpt": 60, "mlp": 30, "small15": 400, "null": 400}


def one_run(args: argparse.Namespace, model: str, system: str, out: Path, env: dict[str, str]) -> tuple[float, bool]:
    """One system's run: the median step time, and whether Transom's replicas ended bit-identical.
    With --cpu, also prints the CPU ms per step of its processes and threads by kind."""
    out.mkdir()
    logs = {BASE: "transom", NIGHTLY: "torchft"}.get(system, system)  # the worker script's name in its logs
    sampler = CpuSampler() if args.cpu else None
    if sampler is not None:
        sampler.start()
    try:
        outcome = RUNNERS[logs](Job(out, model, args.steps or STEPS[model], replicas=args.replicas,
                                    timeout_s=args.run_timeout, env=env))
    finally:
        if sampler is not None:
            sampler.stop()
    times = step_times(out, logs, args.warmup)
    if not outcome.ok or not times:
        raise SystemExit(f"{system} on {model} failed: {outcome.detail}")
    if sampler is not None:
        print("    CPU ms per step: " + ", ".join(f"{k} {v}" for k, v in cpu_per_step(sampler, out, logs,
                                                                                      args.warmup).items()))
    identical = system != "transom" or \
        json.loads((out / "summary.json").read_text()).get("replicas_bit_identical") is True
    return statistics.median(times), identical


def cpu_per_step(sampler: CpuSampler, out: Path, logs: str, warmup: int) -> dict[str, float]:
    """CPU ms per step by kind (_cpu.py) from the end of the warm-up to the first replica's last step."""
    ends = [e for e in step_ends(out, logs) if len(e) > warmup + 1]
    t0, t1 = max(e[warmup] for e in ends), min(e[-1] for e in ends)
    per_step = sampler.per_step(t0, t1, sum(t0 < t <= t1 for t in ends[0]))
    return {**per_step, "total": round(sum(per_step.values()), 3)}


def run_model(args: argparse.Namespace, model: str, systems: list[str], work: Path,
              envs: dict[str, dict[str, str]], base: dict[str, str]) -> dict[str, dict]:
    """Every round runs every system in every shape; per shape, the figures of `model`."""
    medians: dict[str, dict[str, list[float]]] = {shape: {s: [] for s in systems} for shape in envs}
    loads: dict[str, list[float]] = {shape: [] for shape in envs}
    identical: list[bool] = []  # Transom's replicas ended bit-identical, per run
    for rnd in range(args.repeats):
        order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
        for shape, env in envs.items():
            for system in order:
                loads[shape].append(load_avg())
                extra = base if system == BASE else nightly_env() if system == NIGHTLY else {}
                median, same = one_run(args, model, system, work / f"{model}-{shape}-{system}-{rnd}",
                                       {**env, **extra})
                identical.append(same)
                medians[shape][system].append(median)
                print(f"{model} {shape:18s} round {rnd} {system:12s} median step {median * 1e3:8.2f} ms "
                      f"(load {loads[shape][-1]})", flush=True)
    out = {}
    for shape in envs:
        figures = summarise(medians[shape], loads[shape])
        figures.update(steps=args.steps or STEPS[model], transom_bit_identical=all(identical))
        print(f"{model} {shape}: " + ", ".join(f"{k} {v}" for k, v in figures.items() if not isinstance(v, dict)),
              flush=True)
        out[shape] = figures
    return out


def summarise(medians: dict[str, list[float]], loads: list[float]) -> dict:
    """Per system the median of its runs' medians; per other system the rounds' ratios (runs
    of one round are back to back: the fairest pairing on a shared machine), median and p25-p75."""
    figures: dict = {f"{s}_step_s": round(statistics.median(v), 6) for s, v in medians.items()}
    transom = medians["transom"]
    others = [s for s in medians if s != "transom"]
    for s in others:
        figures.update(flat(f"ratio_vs_{s}", spread([t / o for t, o in zip(transom, medians[s])])))
    if "ddp" in others:
        figures["overhead_vs_ddp"] = round(100 * (figures["ratio_vs_ddp"] - 1), 2)
    rivals = [s for s in others if s in ("ddp", "torchft")]  # the target's; the nightly is a column beside
    if rivals:
        faster = [min(medians[s][i] for s in rivals) for i in range(len(transom))]
        figures.update(flat("ratio_vs_faster", spread([t / f for t, f in zip(transom, faster)])))
    figures["load_avg"] = spread(loads, 2)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tinygpt,mlp")
    p.add_argument("--shapes", default=",".join(SHAPES), help="workload shapes (benchmarks/scripts/workload.py)")
    p.add_argument("--replicas", type=int, default=3, help="processes (one per replica)")
    p.add_argument("--steps", type=int, default=0,
                   help="steps per run (default: 60 tinygpt, 30 mlp, 400 small15 and null)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out")
    p.add_argument("--repeats", type=int, default=MIN_ROUNDS,
                   help=f"rounds; each runs every system once per shape (>= {MIN_ROUNDS} for a figure that counts)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds before a run is killed")
    p.add_argument("--base", metavar="REV", help=f"also run commit REV's Transom ({BASE}; benchmarks/_base.py)")
    p.add_argument("--systems", help=f"a subset of ddp,transom,torchft,{NIGHTLY} (and {BASE} with --base); "
                   "with --inner: flat,transom and transom_slices (benchmarks/_inner.py)")
    p.add_argument("--agree-with", metavar="OUTPUT", help="an earlier run's saved stdout: do the figures agree?")
    p.add_argument("--cpu", action="store_true", help="also the CPU ms per step of every process and worker "
                   "thread, by kind (benchmarks/_cpu.py)")
    p.add_argument("--inner", choices=("ddp", "fsdp"), help="2 replicas x 2 ranks with DDP or FSDP2 inside "
                   "(benchmarks/_inner.py); shapes default to accelerator_shaped")
    args = p.parse_args()
    if args.inner:
        return inner_main(args)
    systems = ["ddp", "transom"] + (["torchft"] if importlib.util.find_spec("torchft") else [])
    systems += [NIGHTLY] if nightly_installed() else []
    if "torchft" not in systems:
        print("torchft is not installed (make bench-deps): comparing with DDP only", flush=True)
    systems += [BASE] if args.base else []
    if args.systems:
        systems = [s for s in systems if s in args.systems.split(",")]
    if "transom" not in systems:
        p.error("--systems must include transom")
    models, shapes = args.models.split(","), args.shapes.split(",")
    result: dict = {"benchmark": "ftar_overhead", "replicas": args.replicas, "backend": "gloo", "cpus": os.cpu_count(),
                    "device": os.environ.get("BENCH_DEVICE", "cpu"), "rounds": args.repeats, "warmup": args.warmup,
                    "target_ratio": TARGET_RATIO, "models": models, "shapes": shapes}
    if args.base:
        result["base"] = args.base
    result.update({shape: {} for shape in shapes})
    with tempfile.TemporaryDirectory(prefix="transom-ftar-") as tmp, base_env(args.base) as base:
        for model in models:
            envs = {shape: shape_env(shape, model, args.replicas, steps=min(args.steps or STEPS[model], 60))
                    for shape in shapes}
            for shape, figures in run_model(args, model, systems, Path(tmp), envs, base).items():
                result[shape][model] = {**figures, "waits": {k: float(v) for k, v in envs[shape].items()
                                                              if k.startswith("BENCH_WAIT")}}
    # The target holds against the other systems; a run with --systems transom,transom_base has
    # none, and then only says whether the replicas ended bit-identical.
    result["ok"] = all(f.get("ratio_vs_faster", 0) <= TARGET_RATIO and f["transom_bit_identical"]
                       for shape in shapes for f in result[shape].values())
    if args.agree_with:
        previous = last_json(args.agree_with)
        result["agreement"] = {model: agreement({s: previous.get(s, {}).get(model, {}) for s in shapes},
                                                {s: result[s][model] for s in shapes}, RATIOS, shapes)
                               for model in models}
        print(f"agreement with {args.agree_with}: {result['agreement']}")
    print(json.dumps(result), flush=True)




def inner_main(args: argparse.Namespace) -> None:
    """--inner: replicas of two ranks with DDP or FSDP2 inside, against the same ranks without Transom."""
    shapes = args.shapes.split(",") if args.shapes != ",".join(SHAPES) else ["accelerator_shaped"]
    result: dict = {"benchmark": "ftar_overhead", "inner": args.inner, "replicas": 2, "ranks_per_replica": 2,
                    "backend": "gloo", "cpus": os.cpu_count(), "rounds": args.repeats, "warmup": args.warmup,
                    "target_ratio": INNER_TARGET}
    with tempfile.TemporaryDirectory(prefix="transom-inner-") as tmp, base_env(args.base) as base:
        for model in args.models.split(","):
            result[model] = run_inner(args.inner, model, shapes, args.steps or STEPS[model], args.repeats,
                                      args.warmup, args.run_timeout, Path(tmp), base,
                                      args.systems.split(",") if args.systems else None)
    result["ok"] = all(f.get("ratio_vs_flat", 9) <= INNER_TARGET and f["transom_bit_identical"]
                       for shapes_ in result.values() if isinstance(shapes_, dict) for f in shapes_.values()
                       if isinstance(f, dict) and "ratio_vs_flat" in f)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
