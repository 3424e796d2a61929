"""Rebalance: the step time of a job with one slow replica, reported only against rebalanced.

Purpose
    With one replica slowed down by a factor F (a throttled device), every step of the job
    takes F times as long, since the replicas train in lockstep. `slowAction: Rebalance`
    gives the slow replica a smaller share of each global batch and the others more, so that
    all finish together: ideally a step then takes R*F / (1 + (R-1)*F) times the
    failure-free one (R replicas; 1.33x instead of 2x for R=2, F=2; F here is the slowdown the
    job's step shows with slowAction Report, measured in the same run). This measures it side
    by side on one machine, in one run, three ways that alternate:

    - clean:     no slowdown (the failure-free step);
    - report:    replica 1's device F times slower from step `--slow-step`, slowAction Report;
    - rebalance: the same slowdown, slowAction Rebalance.

    The workload (benchmarks/scripts/rebalance_worker.py) is an ordinary DataLoader loop
    training a small MLP, one torch thread per replica, on a modelled device whose time is
    proportional to the batch (`--sample-seconds` per sample, a sleep: real compute on this
    2-core machine would make the replicas compete for the cores, which devices of their own
    do not).

How to run
    .venv/bin/python benchmarks/rebalance.py                 # 3 rounds, 2 replicas, F=2
    .venv/bin/python benchmarks/rebalance.py --repeats 1     # quick check

Figures
    Per run: the median time between consecutive committed steps over the last `--window`
    steps (`step_s`; by then the rebalance is in force), replica 1's samples per step at the
    end, whether the replicas ended bit-identical, and, for rebalance, the step from which
    the shares applied. Per mode: the median over the rounds. Ratios: report/clean (the cost
    of the slowdown), rebalance/clean, and rebalance/report against the ideal. Target:
    rebalance/report <= 1.15x its ideal, every run bit-identical. The last line of stdout is
    one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import run_bounded  # noqa: E402

WORKER = HERE / "scripts" / "rebalance_worker.py"
MODES = ("clean", "report", "rebalance")
TARGET_VS_IDEAL = 1.15


def one_run(args: argparse.Namespace, mode: str, index: int, tmp: Path) -> dict:
    out = tmp / f"{mode}-{index}"
    out.mkdir()
    detection = {"warmupSteps": 10, "slowSteps": 6, "slowFactorPercent": 130,
                 "slowAction": "Rebalance" if mode == "rebalance" else "Report"}
    cmd = [sys.executable, "-m", "transom", "run", "--replicas", str(args.replicas),
           "--detection", json.dumps(detection), "--timeout", str(args.run_timeout),
           "--summary-json", str(out / "summary.json"), "--stats-dir", str(out / "stats")]
    cmd += ["--", sys.executable, str(WORKER), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--sample-seconds", str(args.sample_seconds)]
    if mode != "clean":
        cmd += ["--slow-replica", "1", "--slow-from", str(args.slow_step), "--slow-factor", str(args.factor)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_OUT": str(out)}
    res = run_bounded(cmd, args.run_timeout + 30, out / "log.txt", env)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    rows = {r: [json.loads(line) for line in (out / f"r{r}-k0.jsonl").read_text().splitlines()]
            for r in range(args.replicas) if (out / f"r{r}-k0.jsonl").exists()}
    times = [x["t"] for x in sorted(rows.get(0, []), key=lambda x: x["step"])][-args.window - 1:]
    gaps = [b - a for a, b in zip(times, times[1:])]
    shares_from = [int(m.group(1)) for e in summary.get("events", [])
                   if (m := re.match(r"rebalance: from step (\d+): shares", e))]
    run = {
        "mode": mode, "index": index, "exit_code": res.returncode, "seconds": round(res.seconds, 1),
        "step_s": round(statistics.median(gaps), 4) if gaps else None,
        "slow_replica_samples_at_end": rows[1][-1]["samples"] if rows.get(1) else None,
        "shares_from_step": shares_from[0] if shares_from else None,
        "bit_identical": summary.get("replicas_bit_identical"),
        "completed": res.returncode == 0 and summary.get("steps_committed", 0) >= args.steps,
    }
    if not run["completed"] or not run["bit_identical"] or run["step_s"] is None:
        run["output_tail"] = res.tail(2000)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--factor", type=float, default=2.0, help="the slow replica's slowdown")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--slow-step", type=int, default=20)
    p.add_argument("--window", type=int, default=50, help="the last steps the step time is taken over")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--sample-seconds", type=float, default=0.001, help="the modelled device's time per sample")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three modes")
    p.add_argument("--run-timeout", type=float, default=300.0)
    args = p.parse_args()
    if args.replicas < 2 or args.factor <= 1 or args.window >= args.steps - args.slow_step:
        p.error("--replicas >= 2, --factor > 1, and a --window inside the slowed part of the run")
    r, f = args.replicas, args.factor
    print(f"rebalance: {r} replicas, replica 1 slowed {f}x from step {args.slow_step} of {args.steps}, "
          f"batch {args.batch_size} per rank, {args.repeats} round(s)", flush=True)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="transom-bench-") as tmp:
        for i in range(args.repeats):
            for k in range(len(MODES)):  # a rotating order: no mode always runs first
                mode = MODES[(i + k) % len(MODES)]
                run = one_run(args, mode, i, Path(tmp))
                runs.append(run)
                print(f"round {i} {mode:9s} step {run['step_s']} s"
                      f"  slow replica's samples {run['slow_replica_samples_at_end']}"
                      f"  shares from step {run['shares_from_step']}  bit-identical {run['bit_identical']}"
                      f"  completed {run['completed']}  wall {run['seconds']} s", flush=True)
                if "output_tail" in run:
                    print(f"---- output tail ----\n{run['output_tail'].rstrip()}\n----", flush=True)

    step = {m: statistics.median(x) if (x := [q["step_s"] for q in runs if q["mode"] == m and q["step_s"]]) else None
            for m in MODES}

    def ratio(a: str, b: str) -> float | None:
        return round(x / y, 3) if (x := step[a]) and (y := step[b]) else None

    # The slowdown the job's step actually shows (the injected one applies to the busy time
    # only, not to the exchange), and what a perfect rebalance would make of it.
    shown = ratio("report", "clean") or f
    ideal_vs_clean = r * shown / (1 + (r - 1) * shown)
    result = {
        "benchmark": "rebalance", "replicas": r, "factor": f, "steps": args.steps, "repeats": args.repeats,
        "clean_step_s": step["clean"], "report_step_s": step["report"], "rebalance_step_s": step["rebalance"],
        "report_vs_clean": ratio("report", "clean"), "rebalance_vs_clean": ratio("rebalance", "clean"),
        "rebalance_vs_report": ratio("rebalance", "report"),
        "ideal_rebalance_vs_clean": round(ideal_vs_clean, 3),
        "ideal_rebalance_vs_report": round(ideal_vs_clean / shown, 3),
        "target_vs_ideal": TARGET_VS_IDEAL,
    }
    result["ok"] = bool(all(q["completed"] and q["bit_identical"] for q in runs) and result["rebalance_vs_report"]
                        and result["rebalance_vs_report"] <= result["ideal_rebalance_vs_report"] * TARGET_VS_IDEAL)
    print(f"step: clean {step['clean']} s, report {step['report']} s, rebalance {step['rebalance']} s; "
          f"report/clean {result['report_vs_clean']}, rebalance/clean {result['rebalance_vs_clean']} "
          f"(ideal {result['ideal_rebalance_vs_clean']}), rebalance/report {result['rebalance_vs_report']} "
          f"(ideal {result['ideal_rebalance_vs_report']}, target <= {TARGET_VS_IDEAL}x it): "
          f"{'OK' if result['ok'] else 'NOT MET'}", flush=True)
    print(json.dumps({**result, "runs": runs}))


if __name__ == "__main__":
    main()
