"""Kill and hang recovery: how long the surviving replicas stall when one replica fails.

Purpose
    Transom's promise is that one replica's death costs the others seconds at most. This
    runs the tiny GPT example under `transom run` with 3 replicas and injects one fault
    into replica 1 at step `--fault-step`, just before the cross-replica all-reduce (the
    other replicas are already waiting in it):

    - kill: SIGKILL (a crash). Target: the survivors lose <= 1 s in all.
    - hang: SIGSTOP (the process exists but does nothing). The survivors can only
            notice by timing out, so the target is <= collective timeout + 1 s.

    The figure is `healthy_stall_seconds` from the run's summary JSON: for each replica
    that never failed, the excess over its normal step time of every step disrupted by
    the failure (the failed step, its retry under the new quorum, and the step where the
    restarted replica rejoins), the largest over those replicas (launch/summary.py). The
    killed or stopped replica is restarted by its launcher and must rejoin before the end
    (`--steps` must leave time for a restart, ~4-10 s on a small machine), so the rejoin
    cost is included.

How to run
    .venv/bin/python benchmarks/kill_recovery.py                       # 3 runs of each kind
    .venv/bin/python benchmarks/kill_recovery.py --repeats 1 --kinds kill # quick check

    Each run is bounded by `transom run --timeout` and by a hard deadline here (after
    which the run's whole process tree is killed); a failed or timed-out run is reported
    with the tail of its output and counts as not ok.

Figures
    Per run: stall seconds, restarts, whether the restarted replica rejoined (all 3
    replicas finished), whether all replicas ended bit-identical. Per kind: median and
    max stall over the runs, against the target. `ok` holds when every run of every kind
    completed, rejoined and ended bit-identical, and the max stall of each kind meets its
    target. The last line of stdout is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import REPO, run_bounded  # noqa: E402

KINDS = {"kill": "kill", "hang": "stop"}  # kind -> transom.inject action
KILL_TARGET_S = 1.0
HANG_MARGIN_S = 1.0


def one_run(args: argparse.Namespace, kind: str, index: int, workdir: Path) -> dict:
    summary_path = workdir / f"{kind}-{index}-summary.json"
    log_path = workdir / f"{kind}-{index}.log"
    cmd = [
        sys.executable, "-m", "transom", "run", "--replicas", str(args.replicas),
        "--collective-timeout", str(args.collective_timeout),
        "--inject", f"{KINDS[kind]}:replica={args.fault_replica},step={args.fault_step}",
        "--timeout", str(args.run_timeout), "--summary-json", str(summary_path),
        "--stats-dir", str(workdir / f"{kind}-{index}-stats"),
        "--", sys.executable, str(REPO / "examples" / "train_tiny_gpt.py"), "--steps", str(args.steps),
        *shlex.split(args.model_args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = run_bounded(cmd, args.run_timeout + 30, log_path, env)
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    run = {
        "kind": kind,
        "index": index,
        "exit_code": res.returncode,  # None: killed at the hard deadline
        "timed_out": res.timed_out,
        "seconds": round(res.seconds, 2),
        "stall_s": summary.get("healthy_stall_seconds"),
        "steps_committed": summary.get("steps_committed"),
        "replica_restarts": summary.get("replica_restarts"),
        "failures_injected": summary.get("failures_injected"),
        "replicas_finished": summary.get("replicas_finished"),
        "replicas_bit_identical": summary.get("replicas_bit_identical"),
        "leftover_processes_killed": res.leftovers_killed,
        "step_s": healthy_step_seconds(workdir / f"{kind}-{index}-stats", args.fault_replica),
    }
    run["rejoined"] = summary.get("replicas_finished") == args.replicas
    run["completed"] = (
        res.returncode == 0
        and summary.get("exit_code") == 0
        and summary.get("steps_committed") == args.steps
        and summary.get("failures_injected") == 1
        and run["stall_s"] is not None
    )
    if not run["completed"] or not run["rejoined"] or not run["replicas_bit_identical"]:
        run["output_tail"] = res.tail(args.tail_chars)
    return run


def healthy_step_seconds(stats_dir: Path, faulty: int) -> float | None:
    """Median seconds of a committed, undisturbed step (same quorum as the step before) of
    the replicas that never failed: the failure-free step time of this workload."""
    seconds = []
    for path in stats_dir.glob("steps-r*-g0-a0.jsonl"):
        if path.name.startswith(f"steps-r{faulty}-"):
            continue
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("committed") and not r.get("quorum_changed") and not r.get("recovering"):
                seconds.append(r["seconds"])
    return round(statistics.median(seconds[5:] if len(seconds) > 10 else seconds), 4) if seconds else None


def describe(run: dict) -> str:
    stall = f"{run['stall_s']:.3f} s" if run["stall_s"] is not None else "-"
    failed = "TIMED OUT" if run["timed_out"] else f"FAILED (exit {run['exit_code']})"
    state = "completed" if run["completed"] else failed
    return (
        f"{run['kind']:4s} run {run['index']}: stall {stall:>9s}  {state}  restarts {run['replica_restarts']}  "
        f"rejoined {run['rejoined']}  bit-identical {run['replicas_bit_identical']}  "
        f"committed {run['steps_committed']}  step {run['step_s']} s  wall {run['seconds']:.1f} s"
    )


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The arguments, and the kinds of fault to run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=100, help="steps per run; leave room for the restart and rejoin")
    p.add_argument("--fault-step", type=int, default=20, help="step at which the fault fires")
    p.add_argument("--fault-replica", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind")
    p.add_argument("--kinds", default="kill,hang", help="comma-separated subset of kill,hang")
    p.add_argument("--collective-timeout", type=float, default=3.0,
                   help="transom run --collective-timeout (both kinds)")
    p.add_argument("--run-timeout", type=float, default=180.0, help="transom run --timeout; hard kill 30 s later")
    p.add_argument("--model-args", default="",
                   help='extra arguments of examples/train_tiny_gpt.py, e.g. "--device ctx --dim 512 --layers 8" '
                        "(a ~100 MB model on this process's GPU)")
    p.add_argument("--tail-chars", type=int, default=2000, help="output kept from a failed run")
    args = p.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        p.error(f"--kinds must be a subset of {sorted(KINDS)}")
    if not 0 <= args.fault_replica < args.replicas or not 0 < args.fault_step < args.steps:
        p.error("--fault-replica must name a replica and --fault-step must lie inside the run")
    return args, kinds


def summarize(kind: str, runs: list[dict], kinds: list[str], target_s: float, result: dict) -> bool:
    """One kind's figures into `result`, its line printed: whether it met its target."""
    mine = [r for r in runs if r["kind"] == kind]
    stalls = [r["stall_s"] for r in mine if r["completed"]]
    med = round(statistics.median(stalls), 3) if stalls else None
    mx = max(stalls) if stalls else None
    good = kind not in kinds or (
        len(stalls) == len(mine)
        and all(r["rejoined"] and r["replicas_bit_identical"] for r in mine)
        and mx is not None
        and mx <= target_s
    )
    result[f"{kind}_stall_s"] = med
    result[f"{kind}_stall_max_s"] = mx
    result[f"{kind}_runs_completed"] = f"{len(stalls)}/{len(mine)}"
    result[f"{kind}_bit_identical"] = [r["replicas_bit_identical"] for r in mine]
    result[f"{kind}_rejoined"] = [r["rejoined"] for r in mine]
    result[f"{kind}_ok"] = good
    if kind in kinds:
        fig = f"median {med:.3f} s, max {mx:.3f} s" if stalls else "no completed run"
        print(
            f"{kind}: stall {fig} over {len(stalls)}/{len(mine)} completed runs "
            f"(target <= {target_s:.1f} s): {'OK' if good else 'NOT MET'}",
            flush=True,
        )
    return good


def main() -> None:
    args, kinds = parse_args()
    targets = {"kill": KILL_TARGET_S, "hang": args.collective_timeout + HANG_MARGIN_S}
    print(
        f"kill_recovery: {args.replicas} replicas, fault in replica {args.fault_replica} at step {args.fault_step} "
        f"of {args.steps}, collective timeout {args.collective_timeout} s, {args.repeats} run(s) of {', '.join(kinds)}",
        flush=True,
    )
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="transom-bench-") as tmp:
        for i in range(args.repeats):
            for kind in kinds:  # interleaved, so both kinds see the same machine
                run = one_run(args, kind, i, Path(tmp))
                runs.append(run)
                print(describe(run), flush=True)
                if "output_tail" in run:
                    print(f"---- output tail of {kind} run {i} ----\n{run['output_tail'].rstrip()}\n----", flush=True)

    result: dict = {"benchmark": "kill_recovery"}
    ok = True
    for kind in ("kill", "hang"):
        ok = summarize(kind, runs, kinds, targets[kind], result) and ok
    result.update(
        {
            "step_s": statistics.median(steps) if (steps := [r["step_s"] for r in runs if r["step_s"]]) else None,
            "model_args": args.model_args,
            "collective_timeout_s": args.collective_timeout,
            "targets": {"kill_stall_s": targets["kill"], "hang_stall_s": targets["hang"]},
            "replicas": args.replicas,
            "steps": args.steps,
            "fault_step": args.fault_step,
            "repeats": args.repeats,
            "kinds": kinds,
            "runs": runs,
            "ok": ok,
        }
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
