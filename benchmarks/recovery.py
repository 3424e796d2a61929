"""Recovery side by side with torchft 0.2.0: what one replica's death and rejoin cost the others.

Purpose
    torchft's own kind of workload (3 replicas, a ~100 MB MLP with AdamW, one process per
    replica, Gloo across replicas; benchmarks/scripts/workload.py), one replica SIGKILLed in
    the forward pass of step `--kill-step` and restarted, run for Transom (the ordinary loop
    with `trainer.optimizer`), for Transom with one hot spare (`transom run --spares 1`: the
    killed replica is taken over by a process that is already loaded), and for torchft 0.2.0
    (its lighthouse and its manual loop: `manager.allreduce` of every gradient,
    `should_commit`; restarted as its launcher would), alternating in the same run
    (benchmarks/_replicas.py starts them).

    Networks: `--network loopback` (default), or `--network netns`: each replica (and the
    spare) in its own network namespace, joined by a bridge over veth links shaped with tc
    to `--rate-mbit` (benchmarks/netns.py; root), the coordinator or lighthouse on the
    bridge, so the all-reduce and the state transfer cross a link of known speed and the
    300 MB transfer takes several steps.

Figures, per system
    step_s                     median failure-free step of the healthy replicas (before the kill)
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
    With a spare (transom_spare) the process started before the kill, so the clock starts at
    the kill: `joined_after_kill_s` (promoted and registered as the replica, target <= 1 s),
    `first_commit_after_kill_s` (its first step, trained in step with the others, done) and
    `contributing_after_kill_s` (then the catch-up transfer and replay).
    Ratios: `ratio_step_vs_torchft`, `ratio_total_healthy_stall_vs_torchft` (stall at kill
    plus at rejoin). Targets (issue 15): stall at rejoin <= 5% of a step, total healthy
    stall <= 0.5x torchft's, step <= 1.02x. The last line of stdout is one JSON object.

How to run
    make bench-deps                       # torchft 0.2.0 into the venv (optional dependency)
    .venv/bin/python benchmarks/recovery.py
    .venv/bin/python benchmarks/recovery.py --systems transom --repeats 1   # Transom only, once
    .venv/bin/python benchmarks/recovery.py --network netns --rate-mbit 1000  # as root
    .venv/bin/python benchmarks/recovery.py --systems transom --base 91de83f   # beside an older commit

    BENCH_THREADS sets torch's threads per replica (default 1; the replicas share the
    machine). Every process is bounded by `--run-timeout` and killed with its tree.
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
from _replicas import Job, run_torchft, run_transom  # noqa: E402
from netns import Cluster  # noqa: E402

KILLED = 1  # the replica that is killed
SYSTEMS = ("transom", "transom_spare", "torchft", BASE)  # BASE only with --base


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
    step_s = statistics.median(steady)
    t_kill = first["records"][-1]["t"] if first["records"] else first["start"]
    t_join = joined[0]["t"] - joined[0]["seconds"]
    first_commit = next(x["t"] for x in joined if x["committed"])
    first_contrib = next((x["t"] for x in joined if x["contributing"]), None)
    at_kill, at_rejoin, windows = [], [], []
    for r in healthy:
        recs = runs[r][0]["records"]
        before = max(x["t"] for x in recs if x["committed"] and x["t"] <= t_kill)
        after = min(x["t"] for x in recs if x["committed"] and x["t"] > t_kill)
        at_kill.append(after - before - step_s)
        end = (first_contrib or joined[-1]["t"]) + 2 * step_s
        window = [x["seconds"] for x in recs if max(t_join, after) < x["t"] <= end]
        at_rejoin.append(sum(window) - len(window) * step_s)
        windows.append([round(w, 3) for w in window])
    figures = {
        "step_s": round(step_s, 4),
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
    """The flat keys of the last JSON line: each system's figures, and Transom against torchft."""
    flat: dict = {}
    for name in SYSTEMS:
        for key, value in result.get(name, {}).items():
            if key not in ("ok", "runs") and not isinstance(value, (list, dict)):
                flat[f"{name}_{key}"] = value
    t, f = result.get("transom", {}), result.get("torchft", {})
    if "step_s" in t and "step_s" in f:
        total_t = t["healthy_stall_at_kill_s"] + t["healthy_stall_at_rejoin_s"]
        total_f = f["healthy_stall_at_kill_s"] + f["healthy_stall_at_rejoin_s"]
        flat["ratio_step_vs_torchft"] = round(t["step_s"] / f["step_s"], 3)
        flat["ratio_total_healthy_stall_vs_torchft"] = round(total_t / total_f, 3) if total_f > 0 else None
    b = result.get(BASE, {})
    for key in ("step_s", "rejoin_time_s", "contributing_after_s"):  # durations: a ratio
        if t.get(key) and b.get(key):
            flat[f"ratio_{key}_vs_base"] = round(t[key] / b[key], 3)
    for key in ("healthy_stall_at_kill_s", "healthy_stall_at_rejoin_s"):  # near 0, either sign: a difference
        if key in t and key in b:
            flat[f"{key}_minus_base"] = round(t[key] - b[key], 3)
    for name in ("transom", "transom_spare"):
        figs = result.get(name, {})
        if "step_s" in figs:
            flat[f"{name}_rejoin_stall_fraction_of_step"] = round(figs["healthy_stall_at_rejoin_s"] / figs["step_s"], 3)
    return flat


# --- running --------------------------------------------------------------------------------------
def run_once(args: argparse.Namespace, system: str, work: Path, net: Cluster | None,
             base: dict[str, str] | None = None) -> dict:
    out = work / system
    out.mkdir()
    job = Job(out, "mlp", args.steps, timeout_s=args.run_timeout, kill=(KILLED, args.kill_step),
              spares=1 if system == "transom_spare" else 0, net=net, env=(base or {}) if system == BASE else {})
    outcome = run_torchft(job) if system == "torchft" else run_transom(job)
    figures = analyse(load(out, "transom" if system.startswith("transom") else system), args.kill_step)
    if outcome.bit_identical is not None:
        figures["replicas_bit_identical"] = outcome.bit_identical
    figures["ok"] = outcome.ok and "error" not in figures
    if not figures["ok"]:
        print(outcome.detail, file=sys.stderr)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--systems", default=",".join(s for s in SYSTEMS if s != BASE))
    p.add_argument("--base", metavar="REV", help=f"also run commit REV's Transom ({BASE}; benchmarks/_base.py)")
    p.add_argument("--run-timeout", type=float, default=400)
    p.add_argument("--repeats", type=int, default=3, help="runs per system; figures are medians")
    p.add_argument("--network", choices=["loopback", "netns"], default="loopback",
                   help="netns: each replica in its own network namespace over shaped links (root)")
    p.add_argument("--rate-mbit", type=float, default=1000, help="netns: each link's rate")
    args = p.parse_args()
    systems = args.systems.split(",")
    if args.base and BASE not in systems:
        systems.append(BASE)
    if BASE in systems and not args.base:
        p.error(f"{BASE} needs --base REV")
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if "torchft" in systems and importlib.util.find_spec("torchft") is None:
        sys.exit("torchft is not installed: run `make bench-deps` (pip install torchft==0.2.0 into the venv)")
    net = Cluster(4, args.rate_mbit) if args.network == "netns" else None  # 3 replicas and a spare
    result: dict = {"benchmark": "recovery", "network": args.network, "model_mb": 100.7, "replicas": 3,
                    "threads_per_replica": int(os.environ.get("BENCH_THREADS", "1")), "cpus": os.cpu_count()}
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    if net is not None:
        result["rate_mbit"] = args.rate_mbit
        net.up()
    if args.base:
        result["base"] = args.base
    try:
        with base_env(args.base) as base:
            for rep in range(args.repeats):  # the systems alternate, so all see the same machine
                for system in systems:
                    with tempfile.TemporaryDirectory(prefix="transom-recovery-") as tmp:
                        figures = run_once(args, system, Path(tmp), net, base)
                    print(f"run {rep} {system:13s} " + "  ".join(f"{k} {v}" for k, v in figures.items()),
                          flush=True)
                    runs[system].append(figures)
    finally:
        if net is not None:
            net.down()
    for system, figs in runs.items():
        result[system] = medians(figs)
        print(f"median of {args.repeats}: {system:13s} " + "  ".join(f"{k} {v}" for k, v in result[system].items()))
    result.update(comparison(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
