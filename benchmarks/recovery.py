"""Recovery side by side with torchft 0.2.0: what one replica's death and rejoin cost the others.

Purpose
    torchft's own kind of workload (3 replicas, a ~100 MB MLP with AdamW, one process per
    replica, Gloo across replicas), one replica SIGKILLed in the forward pass of step
    `--kill-step` and restarted, run for Transom (`transom run`, the ordinary loop with
    `trainer.optimizer`, benchmarks/scripts/mlp_transom.py) and for torchft 0.2.0 (its
    lighthouse and its manual loop: `manager.allreduce` of every gradient, `should_commit`,
    benchmarks/scripts/mlp_torchft.py; restarted by this script as its launcher would) in
    the same run, on loopback. Both workers write the same per-step log
    (benchmarks/scripts/mlp_workload.py).

Figures, per system
    step_s                     median failure-free step of the healthy replicas (before the kill)
    healthy_stall_at_kill_s    the healthy replicas' lost time at the kill: from their last
                               commit before it to their first commit after it, less one step
                               (the larger of the two healthy replicas)
    healthy_stall_at_rejoin_s  their lost time while the restarted replica joins: the sum of
                               (step time - step_s) over their steps from the joiner's first step
                               until two steps after it contributes again
    rejoin_time_s              restarted process start -> its first committed step
    contributing_after_s       restarted process start -> its first step that trains its own batch
    Ratios: `ratio_step_vs_torchft`, `ratio_total_healthy_stall_vs_torchft` (stall at kill
    plus at rejoin). Targets (issue 15): stall at rejoin <= 5% of a step, total healthy
    stall <= 0.5x torchft's, step <= 1.02x. The last line of stdout is one JSON object.

How to run
    make bench-deps                       # torchft 0.2.0 into the venv (optional dependency)
    .venv/bin/python benchmarks/recovery.py
    .venv/bin/python benchmarks/recovery.py --systems transom --repeats 1   # Transom only, once

    BENCH_THREADS sets torch's threads per replica (default 1; the three replicas share
    the machine). Every process is bounded by `--run-timeout` and killed with its tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import REPO, descendants, kill_known, run_bounded  # noqa: E402

SCRIPTS = HERE / "scripts"
KILLED = 1  # the replica that is killed


# --- analysis (pure) ------------------------------------------------------------------------------
def load(out: Path, system: str) -> dict[int, list[dict]]:
    """replica -> its incarnations in start order, each {"start": t, "records": [...]}."""
    runs: dict[int, list[dict]] = {}
    for path in sorted(out.glob(f"{system}-r*-*.jsonl")):
        replica = int(path.name.split("-r", 1)[1].split("-", 1)[0])
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
        if lines and "start" in lines[0]:
            runs.setdefault(replica, []).append({"start": lines[0]["start"], "records": lines[1:]})
    for incarnations in runs.values():
        incarnations.sort(key=lambda i: i["start"])
    return runs


def analyse(runs: dict[int, list[dict]], kill_step: int) -> dict:
    healthy = [r for r in runs if r != KILLED and len(runs[r]) == 1]
    if len(runs.get(KILLED, [])) < 2 or not healthy:
        return {"error": f"incarnations per replica: { {r: len(v) for r, v in runs.items()} }"}
    first, second = runs[KILLED][0], runs[KILLED][1]
    steady = [x["seconds"] for r in healthy for x in runs[r][0]["records"]
              if x["committed"] and x["contributing"] and 5 <= x["step"] <= kill_step]
    step_s = statistics.median(steady)
    t_kill = first["records"][-1]["t"] if first["records"] else first["start"]
    joined = second["records"]
    t_join = joined[0]["t"] - joined[0]["seconds"]
    first_commit = next(x["t"] for x in joined if x["committed"])
    first_contrib = next((x["t"] for x in joined if x["contributing"]), None)
    at_kill, at_rejoin, windows = [], [], []
    for r in healthy:
        recs = [x for x in runs[r][0]["records"]]
        before = max(x["t"] for x in recs if x["committed"] and x["t"] <= t_kill)
        after = min(x["t"] for x in recs if x["committed"] and x["t"] > t_kill)
        at_kill.append(after - before - step_s)
        end = (first_contrib or joined[-1]["t"]) + 2 * step_s
        window = [x["seconds"] for x in recs if t_join <= x["t"] <= end]
        at_rejoin.append(sum(window) - len(window) * step_s)
        windows.append([round(w, 3) for w in window])
    return {
        "step_s": round(step_s, 4),
        "healthy_stall_at_kill_s": round(max(at_kill), 3),
        "healthy_stall_at_rejoin_s": round(max(at_rejoin), 3),
        "rejoin_time_s": round(first_commit - second["start"], 3),
        "contributing_after_s": round(first_contrib - second["start"], 3) if first_contrib else None,
        "steps_catching_up": sum(1 for x in joined if x["committed"] and not x["contributing"]),
        "rejoin_window_steps_s": windows[at_rejoin.index(max(at_rejoin))],
    }


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


# --- running --------------------------------------------------------------------------------------
def run_transom(args: argparse.Namespace, work: Path) -> dict:
    out = work / "transom"
    out.mkdir()
    cmd = [sys.executable, "-m", "transom", "run", "--replicas", "3",
           "--inject", f"kill:replica={KILLED},step={args.kill_step},phase=forward",
           "--timeout", str(args.run_timeout), "--summary-json", str(out / "summary.json"),
           "--", sys.executable, str(SCRIPTS / "mlp_transom.py"), "--steps", str(args.steps)]
    env = {**os.environ, "BENCH_OUT": str(out), "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "1")}
    res = run_bounded(cmd, args.run_timeout + 30, out / "run.log", env)
    figures = analyse(load(out, "transom"), args.kill_step)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    figures["replicas_bit_identical"] = summary.get("replicas_bit_identical")
    figures["ok"] = res.returncode == 0 and "error" not in figures
    if not figures["ok"]:
        figures["output_tail"] = res.tail(2000)
    return figures


def _lighthouse(log) -> tuple[subprocess.Popen, str]:
    code = ("from torchft.coordination import LighthouseServer; import time; "
            "s = LighthouseServer(bind='127.0.0.1:0', min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100); "
            "print(s.address(), flush=True); time.sleep(3600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    address = proc.stdout.readline().strip()  # the server prints it once it listens
    if not address:
        proc.kill()
        raise RuntimeError("the torchft lighthouse did not start (see its log)")
    return proc, address


def run_torchft(args: argparse.Namespace, work: Path) -> dict:
    """Three torchft replicas; this function restarts the killed one, as a launcher would."""
    out = work / "torchft"
    out.mkdir()
    seen: dict[int, int] = {}
    deadline = time.monotonic() + args.run_timeout
    with open(out / "run.log", "w") as log:
        lighthouse, address = _lighthouse(log)
        env = {**os.environ, "BENCH_OUT": str(out), "TORCHFT_LIGHTHOUSE": address,
               "BENCH_KILL_STEP": str(args.kill_step), "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "1")}

        def start(replica: int, attempt: int) -> subprocess.Popen:
            e = {**env, "REPLICA_ID": str(replica), "BENCH_ATTEMPT": str(attempt if replica == KILLED else 1)}
            return subprocess.Popen([sys.executable, str(SCRIPTS / "mlp_torchft.py"), "--steps", str(args.steps)],
                                    env=e, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

        procs = {r: start(r, 0) for r in range(3)}
        codes: dict[int, int] = {}
        restarted = False
        try:
            while len(codes) < 3 and time.monotonic() < deadline:
                for r, p in list(procs.items()):
                    seen.update(descendants(p.pid))
                    seen[p.pid] = p.pid
                    code = p.poll()
                    if code is None or r in codes:
                        continue
                    if code == -signal.SIGKILL and r == KILLED and not restarted:
                        procs[r], restarted = start(r, 1), True
                    else:
                        codes[r] = code
                time.sleep(0.1)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
            lighthouse.kill()
            lighthouse.wait()
            kill_known(seen)
    figures = analyse(load(out, "torchft"), args.kill_step)
    figures["ok"] = codes == {0: 0, 1: 0, 2: 0} and "error" not in figures
    if not figures["ok"]:
        figures["exit_codes"] = codes
        figures["output_tail"] = (out / "run.log").read_text(errors="replace")[-2000:]
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--systems", default="transom,torchft")
    p.add_argument("--run-timeout", type=float, default=400)
    p.add_argument("--repeats", type=int, default=3, help="runs per system; figures are medians")
    args = p.parse_args()
    systems = args.systems.split(",")
    if "torchft" in systems:
        if importlib.util.find_spec("torchft") is None:
            sys.exit("torchft is not installed: run `make bench-deps` (pip install torchft==0.2.0 into the venv)")
    result: dict = {"benchmark": "recovery", "network": "loopback", "model_mb": 100.7, "replicas": 3,
                    "threads_per_replica": int(os.environ.get("BENCH_THREADS", "1")), "cpus": os.cpu_count()}
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    for rep in range(args.repeats):  # the systems alternate, so both see the same machine
        for system in systems:
            with tempfile.TemporaryDirectory(prefix="transom-recovery-") as tmp:
                figures = (run_transom if system == "transom" else run_torchft)(args, Path(tmp))
            tail = figures.pop("output_tail", None)
            print(f"run {rep} {system:8s} " + "  ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
            if tail:
                print(tail, file=sys.stderr)
            runs[system].append(figures)
    for system, figs in runs.items():
        result[system] = medians(figs)
        print(f"median of {args.repeats}: {system:8s} " + "  ".join(f"{k} {v}" for k, v in result[system].items()))
    t, f = result.get("transom", {}), result.get("torchft", {})
    for key in ("step_s", "healthy_stall_at_kill_s", "healthy_stall_at_rejoin_s", "rejoin_time_s"):
        for name, figs in (("transom", t), ("torchft", f)):
            if key in figs:
                result[f"{name}_{key}"] = figs[key]
    if "step_s" in t and "step_s" in f:
        total_t = t["healthy_stall_at_kill_s"] + t["healthy_stall_at_rejoin_s"]
        total_f = f["healthy_stall_at_kill_s"] + f["healthy_stall_at_rejoin_s"]
        result["ratio_step_vs_torchft"] = round(t["step_s"] / f["step_s"], 3)
        result["ratio_total_healthy_stall_vs_torchft"] = round(total_t / total_f, 3) if total_f > 0 else None
    if "step_s" in t:
        result["rejoin_stall_fraction_of_step"] = round(t["healthy_stall_at_rejoin_s"] / t["step_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
