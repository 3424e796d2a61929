"""`transom simulate --preset NAME [--json] [--plot FILE]`: every strategy of a preset, side by side.

Prints one line per strategy (effective training time, failures, the largest losses) and,
with `--json`, ends with one JSON object: `<strategy>_goodput` for each, the preset's
figures, and each strategy's lost time by component as fractions of the cluster's time.

Inputs are bounded so that a run ends in about a minute at most: the simulation's work is
its number of failures (GPUs x days x the per-GPU failure rate), capped at MAX_FAILURES per
strategy; `--plot`'s file must be writable before any of it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from transom.arguments import between
from transom.simulate.engine import simulate
from transom.simulate.model import PRESETS, Scenario

MAX_GPUS = 10_000_000  # 100x the largest preset
MAX_DAYS = 3650.0
MAX_FAILURES = 1_000_000  # expected per strategy: ~16 us each, about a minute for the four strategies


def days(text: str) -> float:
    """An argparse type: simulated days, above 0 and up to MAX_DAYS."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of days") from None
    if not 0 < value <= MAX_DAYS:  # also no nan, no inf
        raise argparse.ArgumentTypeError(f"must be above 0 and at most {MAX_DAYS:g}, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--seed", type=between(0, 2**63 - 1), default=0)
    p.add_argument("--days", type=days, default=None, help="simulated wall-clock days (default: the preset's)")
    p.add_argument("--gpus", type=between(1, MAX_GPUS), default=None, help="cluster size (default: the preset's)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--plot", type=Path, help="write goodput against cluster size for every strategy (PNG)")


def scenario_of(args: argparse.Namespace) -> Scenario:
    """The preset with --gpus and --days; ValueError says what is out of bounds."""
    scenario = PRESETS[args.preset]
    if args.gpus is not None:
        if args.gpus < scenario.gpus / scenario.replicas:
            raise ValueError(f"--gpus must hold at least one replica ({round(scenario.gpus / scenario.replicas)} GPUs)")
        scenario = scenario.scaled(args.gpus)
    if args.days is not None:
        scenario = dataclasses.replace(scenario, days=args.days)
    failures = scenario.failures_per_gpu_hour * scenario.gpus * scenario.days * 24
    if failures > MAX_FAILURES:
        raise ValueError(f"{scenario.gpus} GPUs over {scenario.days:g} days is about {failures:,.0f} failures per "
                         f"strategy; at most {MAX_FAILURES:,} are simulated (fewer --gpus or --days)")
    return scenario


def main(args: argparse.Namespace) -> int:
    try:
        scenario = scenario_of(args)
        if args.plot is not None:
            from transom.simulate.plot import check_writable

            check_writable(args.plot)
    except ValueError as e:
        print(f"transom simulate: {e}", file=sys.stderr)
        return 2
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
        except (RuntimeError, OSError) as e:  # checked before, but the disk can still fill
            print(f"transom simulate: {e}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(out))
    return 0
