"""`transom simulate --preset NAME [--json] [--plot FILE]`: every strategy of a preset, side by side.

Prints one line per strategy (effective training time, failures, the largest losses) and,
with `--json`, ends with one JSON object: `<strategy>_goodput` for each, the preset's
figures, and each strategy's lost time by component as fractions of the cluster's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from transom.simulate.engine import simulate
from transom.simulate.model import PRESETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--days", type=float, default=None, help="simulated wall-clock days (default: the preset's)")
    p.add_argument("--gpus", type=int, default=None, help="cluster size (default: the preset's)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--plot", type=Path, help="write goodput against cluster size for every strategy (PNG)")


def main(args: argparse.Namespace) -> int:
    scenario = PRESETS[args.preset]
    if args.gpus is not None:
        if args.gpus < scenario.gpus / scenario.replicas:
            print(f"transom simulate: --gpus must hold at least one replica "
                  f"({round(scenario.gpus / scenario.replicas)} GPUs)", file=sys.stderr)
            return 2
        scenario = scenario.scaled(args.gpus)
    if args.days is not None:
        if not 0 < args.days <= 3650:
            print("transom simulate: --days must be between 0 and 3650", file=sys.stderr)
            return 2
        scenario = dataclasses.replace(scenario, days=args.days)
    print(f"{scenario.name}: {scenario.gpus} GPUs in {scenario.replicas} replicas, a failure every "
          f"{scenario.mtbf_minutes:.1f} min ({scenario.hardware_share:.0%} hardware), {scenario.days:g} days, "
          f"seed {args.seed}")
    out: dict = {"preset": scenario.name, "gpus": scenario.gpus, "replicas": scenario.replicas,
                 "mtbf_minutes": round(scenario.mtbf_minutes, 2), "days": scenario.days, "seed": args.seed}
    for st in scenario.strategies:
        r = simulate(scenario, st, args.seed)
        shares = {k: round(v / r.gpu_hours, 4) for k, v in r.lost_gpu_hours.items() if v > 0}
        top = ", ".join(f"{k} {v:.1%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])[:4])
        print(f"  {st.name:14s} effective {r.effective:.3f}  failures {r.failures}  lost: {top}")
        out[f"{st.name}_goodput"] = round(r.effective, 4)
        out[f"{st.name}_lost"] = shares
    out["headline"] = scenario.headline
    if args.plot is not None:
        from transom.simulate.plot import write_png

        try:
            write_png(args.plot, PRESETS[args.preset], args.seed, min(scenario.days, 10.0))
        except RuntimeError as e:
            print(f"transom simulate: {e}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(out))
    return 0
