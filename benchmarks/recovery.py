"""Recovery side by side with torchft 0.2.0: what one replica's death and rejoin cost the others.

Purpose
    torchft's own kind of workload (3 replicas, a ~100 MB MLP with AdamW, one process per
    replica, Gloo across replicas; benchmarks/scripts/workload.py), one replica SIGKILLed in
    the forward pass of step `--kill-step` and restarted, run for Transom (the ordinary loop
    with `trainer.optimizer`), for Transom with one hot spare (`transom run --spares 1`: the
    killed replica is taken over by a process that is already loaded), and for torchft 0.2.0
    (its lighthouse and its manual loop: `manager.allreduce` of every gradient,
    `should_commit`; restarted as its launcher would), and the same loop on torchft-nightly
    where `make bench-deps` installed it (a column beside; the targets are against 0.2.0),
    alternating in the same run (benchmarks/_replicas.py starts them).

    Networks: `--network loopback` (default), or `--network netns`: each replica (and the
    spare) in its own network namespace, joined by a bridge over veth links shaped with tc
    to `--rate-mbit` (benchmarks/netns.py; root), the coordinator or lighthouse on the
    bridge, so the all-reduce and the state transfer cross a link of known speed and the
    300 MB transfer takes several steps.

Figures, per system
    step_s                     median failure-free step of the healthy replicas: their steps before
                               the kill and after the rejoin window (`step_before_kill_s`,
                               `step_after_rejoin_s`), so a drift of the machine's load over
                               the run does not pass for a stall
    healthy_stall_at_kill_s    the healthy replicas' lost time at the kill: from their last
                               commit before it to their first commit after it, less one step
                               (the larger of the two healthy replicas)
    healthy_stall_at_rejoin_s  their lost time while the new incarnation joins: the sum of
                               (step time - step_s) over their steps from its first step until
                               two steps after it contributes again
    rejoin_time_s              restarted process start -> its first committed step
    contributing_after_s       restarted process start -> its first step that trains its own batch
    restart_*_s                where a restart's time goes: kill -> the new process starts
                               (spawn), its imports, the model's build, join (FaultTolerant /
                               Manager: registration), -> first commit, -> contributing (catch_up)
    transom_fresh is Transom with every worker started as a new process (TRANSOM_WARM_START=0),
    for `ratio_rejoin_time_s_vs_fresh`: what the warm interpreter takes off a restart.
    With a spare (transom_spare) the process started before the kill, so the clock starts at
    the kill: `joined_after_kill_s` (promoted and registered as the replica, target <= 1 s),
    `first_commit_after_kill_s` (its first step, trained in step with the others, done) and
    `contributing_after_kill_s` (then the catch-up transfer and replay).
    Per system, the median of each figure over the rounds. Ratios, per round (Transom's run
    against torchft's run of the same round, back to back), reported as the median and
    p25-p75 of the rounds' ratios (benchmarks/_rounds.py): `ratio_step_vs_torchft`,
    `ratio_total_healthy_stall_vs_torchft` (stall at kill plus at rejoin), and
    `rejoin_stall_fraction_of_step` (Transom's stall at rejoin over its own step). Targets
    (`targets_met`, by the medians): stall at rejoin <= 5% of a step, total healthy stall
    <= 0.5x torchft's, step <= 1.02x.

Shapes
    Every round runs each system in both workload shapes (benchmarks/scripts/workload.py):
    `cpu_bound`, the MLP's forward and backward computed on the CPU, and
    `accelerator_shaped`, the same model, exchange, vote and optimizer with one-row batches
    and waits that release the CPU in place of the passes' arithmetic (calibrated at the
    start: `waits`). The last line of stdout is one JSON object with a key per shape
    (`cpu_bound`, `accelerator_shaped`), each holding Transom's `step_s`,
    `healthy_stall_at_kill_s`, `healthy_stall_at_rejoin_s`, `rejoin_time_s`, the ratios,
    every system's medians, the load averages and `targets_met`. `--agree-with OUTPUT` (the
    saved stdout of an earlier run) adds `agreement`: per shape and ratio, whether the two
    runs' medians lie within each other's spread.

How to run
    make bench-deps                       # torchft 0.2.0 into the venv (optional dependency)
    .venv/bin/python benchmarks/recovery.py | tee /tmp/recovery-1.txt        # 7 rounds, both shapes
    .venv/bin/python benchmarks/recovery.py --agree-with /tmp/recovery-1.txt  # the second run
    .venv/bin/python benchmarks/recovery.py --systems transom --repeats 1 --shapes cpu_bound   # quick
    .venv/bin/python benchmarks/recovery.py --systems transom,transom_spare,torchft         # with a spare
    .venv/bin/python benchmarks/recovery.py --systems transom,transom_fresh --shapes cpu_bound  # warm starts
    .venv/bin/python benchmarks/recovery.py --network netns --rate-mbit 1000  # as root
    .venv/bin/python benchmarks/recovery.py --systems transom --base 91de83f   # beside an older commit

    BENCH_THREADS sets torch's threads per replica (default 1; the replicas share the
    machine). BENCH_DEVICE=cuda puts every replica's model on the GPU (they share it; Gloo
    across them). Every process is bounded by `--run-timeout` and killed with its tree.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _base import BASE, base_env  # noqa: E402
from _replicas import NIGHTLY, Job, nightly_env, nightly_installed, run_torchft, run_transom  # noqa: E402
from _rounds import MIN_ROUNDS, SHAPES, agreement, flat, last_json, load_avg, shape_env, spread  # noqa: E402
from netns import Cluster  # noqa: E402

KILLED = 1  # the replica that is killed
# transom_fresh: Transom with TRANSOM_WARM_START=0, every worker (the restarted one too) a new
# process that imports torch itself (launch/warm_start.py)
SYSTEMS = ("transom", "transom_fresh", "transom_spare", "torchft", NIGHTLY, BASE)  # BASE only with --base
FRESH = {"TRANSOM_WARM_START": "0"}
RIVALS = ("torchft", NIGHTLY)  # the targets are against torchft 0.2.0; the nightly is a column beside
ROUND_RATIOS = ("ratio_step_vs_torchft", "ratio_total_healthy_stall_vs_torchft", "rejoin_stall_fraction_of_step",
                f"ratio_step_vs_{NIGHTLY}", f"ratio_total_healthy_stall_vs_{NIGHTLY}")
TARGETS = {"rejoin_stall_fraction_of_step": 0.05, "ratio_total_healthy_stall_vs_torchft": 0.5,
           "ratio_step_vs_torchft": 1.02}


# --- analysis (pure) ------------------------------------------------------------------------------
def load(out: Path, system: str) -> dict[int, list[dict]]:
    """replica -> its incarnations in start order, each {"start": t, <start-up milestones>,
    "records": [...]}."""
    runs: dict[int, list[dict]] = {}
    for path in sorted(out.glob(f"{system}-r*-*.jsonl")):
        replica = int(path.name.split("-r", 1)[1].split("-", 1)[0])
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
        if lines and "start" in lines[0]:
            runs.setdefault(replica, []).append({**lines[0], "records": lines[1:]})
    for incarnations in runs.values():
        incarnations.sort(key=lambda i: i["records"][0]["t"] if i["records"] else i["start"])
    return runs


def analyse(runs: dict[int, list[dict]], kill_step: int) -> dict:
    healthy = [r for r in runs if r != KILLED and len(runs[r]) == 1]
    if len(runs.get(KILLED, [])) < 2 or not healthy:
        return {"error": f"incarnations per replica: { {r: len(v) for r, v in runs.items()} }"}
    first, second = runs[KILLED][0], runs[KILLED][1]
    joined = second["records"]
    if not any(x["committed"] for x in joined):
        return {"error": "the new incarnation of the killed replica never committed a step"}
    steady = [x["seconds"] for r in healthy for x in runs[r][0]["records"]
              if x["committed"] and x["contributing"] and 5 <= x["step"] <= kill_step]
    t_kill = first["records"][-1]["t"] if first["records"] else first["start"]
    t_join = joined[0]["t"] - joined[0]["seconds"]
    first_commit = next(x["t"] for x in joined if x["committed"])
    first_contrib = next((x["t"] for x in joined if x["contributing"]), None)
    end = (first_contrib or joined[-1]["t"]) + 2 * statistics.median(steady)
    # The failure-free step brackets the fault: the steps before the kill and those after the
    # rejoin window, all replicas back. On a shared machine the load drifts over a run, and a
    # baseline taken on one side only moved the stall at rejoin by up to a second either way.
    later = [x["seconds"] for r in healthy for x in runs[r][0]["records"]
             if x["committed"] and x["contributing"] and x["t"] > end]
    step_s = statistics.median(steady + later)
    at_kill, at_rejoin, windows = [], [], []
    for r in healthy:
        recs = runs[r][0]["records"]
        before = max(x["t"] for x in recs if x["committed"] and x["t"] <= t_kill)
        after = min(x["t"] for x in recs if x["committed"] and x["t"] > t_kill)
        at_kill.append(after - before - step_s)
        window = [x["seconds"] for x in recs if max(t_join, after) < x["t"] <= end]
        at_rejoin.append(sum(window) - len(window) * step_s)
        windows.append([round(w, 3) for w in window])
    figures = {
        "step_s": round(step_s, 4),
        "step_before_kill_s": round(statistics.median(steady), 4),
        "step_after_rejoin_s": round(statistics.median(later), 4) if later else None,
        "healthy_stall_at_kill_s": round(max(at_kill), 3),
        "healthy_stall_at_rejoin_s": round(max(at_rejoin), 3),
        "steps_catching_up": sum(1 for x in joined if x["committed"] and not x["contributing"]),
        "rejoin_window_steps_s": windows[at_rejoin.index(max(at_rejoin))],
    }
    if second["start"] < t_kill:  # a hot spare: its process was running before the kill
        if "joined" in second:
            figures["joined_after_kill_s"] = round(second["joined"] - t_kill, 3)
        figures["first_commit_after_kill_s"] = round(first_commit - t_kill, 3)
        if first_contrib:
            figures["contributing_after_kill_s"] = round(first_contrib - t_kill, 3)
    else:
        figures["rejoin_time_s"] = round(first_commit - second["start"], 3)
        figures["contributing_after_s"] = round(first_contrib - second["start"], 3) if first_contrib else None
        figures.update(restart_phases(second, t_kill, first_commit, first_contrib))
    return figures


def restart_phases(inc: dict, t_kill: float, first_commit: float, first_contrib: float | None) -> dict:
    """Where a restart's time goes: kill -> new process, its imports, model build, joining
    (Transom's FaultTolerant, torchft's Manager), -> first commit, -> contributing."""
    if not {"imported", "built", "joined"} <= inc.keys():
        return {}
    phases = {"restart_spawn_s": inc["start"] - t_kill, "restart_imports_s": inc["imported"] - inc["start"],
              "restart_build_s": inc["built"] - inc["imported"], "restart_join_s": inc["joined"] - inc["built"],
              "restart_first_commit_s": first_commit - inc["joined"]}
    if first_contrib:
        phases["restart_catch_up_s"] = first_contrib - first_commit
    return {k: round(v, 3) for k, v in phases.items()}


def medians(runs: list[dict]) -> dict:
    """Per figure, the median over the runs that completed (`ok`); `ok` only if all did."""
    good = [r for r in runs if r.get("ok")]
    out: dict = {"ok": bool(runs) and len(good) == len(runs), "runs": len(runs)}
    for key in (good[0] if good else {}):
        values = [r[key] for r in good if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if values:
            out[key] = round(statistics.median(values), 4)
    if good and all("replicas_bit_identical" in r for r in good):
        out["replicas_bit_identical"] = all(r["replicas_bit_identical"] for r in good)
    return out


def comparison(result: dict) -> dict:
    """Flat keys of one shape: each system's median figures, and the medians compared."""
    flat_keys: dict = {}
    for name in SYSTEMS:
        for key, value in result.get(name, {}).items():
            if key not in ("ok", "runs") and not isinstance(value, (list, dict)):
                flat_keys[f"{name}_{key}"] = value
    t, b, fresh = result.get("transom", {}), result.get(BASE, {}), result.get("transom_fresh", {})
    for key in ("step_s", "rejoin_time_s", "contributing_after_s"):  # durations: a ratio
        if t.get(key) and b.get(key):
            flat_keys[f"ratio_{key}_vs_base"] = round(t[key] / b[key], 3)
        if t.get(key) and fresh.get(key):
            flat_keys[f"ratio_{key}_vs_fresh"] = round(t[key] / fresh[key], 3)
    for key in ("healthy_stall_at_kill_s", "healthy_stall_at_rejoin_s"):  # near 0, either sign: a difference
        if key in t and key in b:
            flat_keys[f"{key}_minus_base"] = round(t[key] - b[key], 3)
    for key in ("step_s", "healthy_stall_at_kill_s", "healthy_stall_at_rejoin_s", "rejoin_time_s"):
        if key in t:  # the keys: Transom's own figures, unprefixed
            flat_keys[key] = t[key]
    return flat_keys


def total_stall(figures: dict) -> float:
    return figures["healthy_stall_at_kill_s"] + figures["healthy_stall_at_rejoin_s"]


def round_ratios(runs: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Per round, Transom's figures against torchft's run of the same round (both completed),
    and Transom's stall at rejoin as a fraction of its own step."""
    ratios: dict[str, list[float]] = {name: [] for name in ROUND_RATIOS}
    for rnd, t in enumerate(runs.get("transom", [])):
        if not t.get("ok"):
            continue
        ratios["rejoin_stall_fraction_of_step"].append(t["healthy_stall_at_rejoin_s"] / t["step_s"])
        for rival in RIVALS:
            f = runs[rival][rnd] if len(runs.get(rival, [])) > rnd else {}
            if f.get("ok"):
                ratios[f"ratio_step_vs_{rival}"].append(t["step_s"] / f["step_s"])
                if total_stall(f) > 0:
                    ratios[f"ratio_total_healthy_stall_vs_{rival}"].append(total_stall(t) / total_stall(f))
    return ratios


def summarise(runs: dict[str, list[dict]], loads: list[float], env: dict[str, str]) -> dict:
    """One shape's result: every system's medians, the flat keys, the rounds' ratios with their
    spread, the load averages and whether the targets are met (by the ratios' medians)."""
    out: dict = {system: medians(figs) for system, figs in runs.items()}
    out.update(comparison(out))
    for name, values in round_ratios(runs).items():
        out.update(flat(name, spread(values, 3)))
    out["waits"] = {k: float(v) for k, v in env.items() if k.startswith("BENCH_WAIT")}
    out["load_avg"] = spread(loads, 2)
    out["targets_met"] = {name: out[name] <= limit for name, limit in TARGETS.items() if name in out}
    return out


# --- running --------------------------------------------------------------------------------------
def run_once(args: argparse.Namespace, system: str, work: Path, net: Cluster | None, env: dict[str, str]) -> dict:
    out = work / system
    out.mkdir()
    job = Job(out, "mlp", args.steps, timeout_s=args.run_timeout, kill=(KILLED, args.kill_step),
              spares=1 if system == "transom_spare" else 0, net=net, env=env)
    outcome = run_torchft(job) if system in RIVALS else run_transom(job)
    figures = analyse(load(out, "transom" if system.startswith("transom") else "torchft"), args.kill_step)
    if outcome.bit_identical is not None:
        figures["replicas_bit_identical"] = outcome.bit_identical
    figures["ok"] = outcome.ok and "error" not in figures
    if not figures["ok"]:
        print(outcome.detail, file=sys.stderr)
    return figures


@contextlib.contextmanager
def run_dir(keep: str | None, name: str) -> Iterator[Path]:
    """Where a run writes its logs: under --keep (kept, to analyse again), else a temporary one."""
    if keep:
        (Path(keep) / name).mkdir(parents=True, exist_ok=True)
        yield Path(keep) / name
        return
    with tempfile.TemporaryDirectory(prefix="transom-recovery-") as tmp:
        yield Path(tmp)


def parse_args() -> tuple[argparse.Namespace, list[str], list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--systems", default="transom,torchft" + (f",{NIGHTLY}" if nightly_installed() else ""),
                   help=f"a subset of {','.join(SYSTEMS)}")
    p.add_argument("--shapes", default=",".join(SHAPES), help="workload shapes (benchmarks/scripts/workload.py)")
    p.add_argument("--base", metavar="REV", help=f"also run commit REV's Transom ({BASE}; benchmarks/_base.py)")
    p.add_argument("--run-timeout", type=float, default=400)
    p.add_argument("--repeats", type=int, default=MIN_ROUNDS,
                   help=f"rounds; each runs every system once per shape (>= {MIN_ROUNDS} for a figure that counts)")
    p.add_argument("--agree-with", metavar="OUTPUT", help="an earlier run's saved stdout: do the figures agree?")
    p.add_argument("--keep", metavar="DIR", help="keep every run's logs under DIR/<shape>-<round>/<system>")
    p.add_argument("--network", choices=["loopback", "netns"], default="loopback",
                   help="netns: each replica in its own network namespace over shaped links (root)")
    p.add_argument("--rate-mbit", type=float, default=1000, help="netns: each link's rate")
    args = p.parse_args()
    systems, shapes = args.systems.split(","), args.shapes.split(",")
    if args.base and BASE not in systems:
        systems.append(BASE)
    if BASE in systems and not args.base:
        p.error(f"{BASE} needs --base REV")
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if unknown := set(shapes) - set(SHAPES):
        p.error(f"unknown shapes {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    if "torchft" in systems and importlib.util.find_spec("torchft") is None:
        sys.exit("torchft is not installed: run `make bench-deps` (pip install torchft==0.2.0 into the venv)")
    return args, systems, shapes


def main() -> None:
    args, systems, shapes = parse_args()
    net = Cluster(4, args.rate_mbit) if args.network == "netns" else None  # 3 replicas and a spare
    result: dict = {"benchmark": "recovery", "network": args.network, "model_mb": 100.7, "replicas": 3,
                    "threads_per_replica": int(os.environ.get("BENCH_THREADS", "1")), "cpus": os.cpu_count(),
                    "device": os.environ.get("BENCH_DEVICE", "cpu"), "rounds": args.repeats, "shapes": shapes}
    runs: dict[str, dict[str, list[dict]]] = {shape: {system: [] for system in systems} for shape in shapes}
    loads: dict[str, list[float]] = {shape: [] for shape in shapes}
    if net is not None:
        result["rate_mbit"] = args.rate_mbit
        net.up()
    if args.base:
        result["base"] = args.base
    try:
        envs = {shape: shape_env(shape, "mlp", 3, net) for shape in shapes}
        with base_env(args.base) as base:
            for rnd in range(args.repeats):  # the systems alternate, in a rotating order
                order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                for shape in shapes:
                    for system in order:
                        extra = base if system == BASE else nightly_env() if system == NIGHTLY else \
                            FRESH if system == "transom_fresh" else {}
                        env = {**envs[shape], **extra}
                        loads[shape].append(load_avg())
                        with run_dir(args.keep, f"{shape}-{rnd}") as work:
                            figures = run_once(args, system, work, net, env)
                        print(f"round {rnd} {shape:18s} {system:13s} load {loads[shape][-1]}  "
                              + "  ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
                        runs[shape][system].append(figures)
    finally:
        if net is not None:
            net.down()
    for shape in shapes:
        result[shape] = summarise(runs[shape], loads[shape], envs[shape])
        print(f"{shape}: " + ", ".join(f"{k} {v}" for k, v in result[shape].items()
                                        if not isinstance(v, (dict, list))), flush=True)
    if args.agree_with:
        result["agreement"] = agreement(last_json(args.agree_with), result, ROUND_RATIOS, shapes)
        print(f"agreement with {args.agree_with}: {result['agreement']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
