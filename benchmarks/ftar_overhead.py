"""FTAR overhead: failure-free step time of Transom vs plain DDP, same model, same backend.

Purpose
    What does fault tolerance cost when nothing fails? Both sides train the TinyGPT of
    examples/train_tiny_gpt.py on CPU with Gloo, one process per replica, the same batch
    per process (each process reads the batch `train_tiny_gpt.batch` gives its rank or
    replica id), the same optimizer and the same number of steps:

    - ddp:     N processes started by this script, `init_process_group("gloo")` through
               MASTER_ADDR/MASTER_PORT, the model wrapped in DistributedDataParallel.
    - transom: `transom run --replicas N -- python benchmarks/ftar_overhead.py --worker
               transom ...`: coordinator, one launcher per replica, the model wrapped in
               `transom.ft.FaultTolerant` (quorum request per step, FTAR across
               replicas, commit vote). Local mode's coordinator and launchers share the
               machine with the workers, so their CPU time is part of the figure.

    Every worker runs with OMP_NUM_THREADS=1 and torch.set_num_threads(1), times each
    iteration of its training loop (end of one iteration to the end of the next, so
    everything the loop does is counted: quorum wait, all-reduce, optimizer step) and
    appends its per-step seconds as one JSON line to a file.

How to run
    .venv/bin/python benchmarks/ftar_overhead.py                       # default sizes
    .venv/bin/python benchmarks/ftar_overhead.py --steps 30 --repeats 1   # quick check

Figures
    Per run: median step seconds after the first `--warmup` steps (pooled over ranks);
    for Transom also the median time inside `finish_step` (quorum wait, FTAR, vote,
    optimizer step), as a hint of where time goes. Runs alternate in ABBA order (ddp,
    transom, transom, ddp, ...) for `--repeats` rounds so a slow drift of a shared
    machine hits both sides alike. `ddp_step_s` and `transom_step_s` are the medians of
    the per-run medians of each side (robust to one disturbed run);
    `ratio` = transom_step_s / ddp_step_s (target <= 1.05: `ok`, which also requires the
    Transom replicas to end bit-identical). `round_ratios` are the per-round ratios of
    per-run medians (paired runs, next to each other in time) and
    `ratio_median_of_rounds` their median: when they disagree much, the machine was too
    busy for the figure to mean anything (`load_avg` holds the 1-minute load average
    before each run and at the end; on a machine with fewer cores than replicas the
    workers already compete with each other); `ratio_p10` compares the fastest decile of steps,
    which other load on a shared machine disturbs less than the median. The last line of stdout is
    one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import REPO, run_bounded  # noqa: E402

TARGET_RATIO = 1.05


# --- workers -------------------------------------------------------------------------------
def _model_and_data(args: argparse.Namespace):
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    import train_tiny_gpt as tg

    torch.set_num_threads(1)
    text = tg.make_corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    torch.manual_seed(0)
    model = tg.TinyGPT(len(chars), dim=args.dim, layers=args.layers, context=args.context)
    return tg, model, data


def _write(out: str, record: dict) -> None:
    with open(out, "a") as f:  # one short line per process, appended
        f.write(json.dumps(record) + "\n")


def worker_ddp(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    tg, model, data = _model_and_data(args)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank = dist.get_rank()
    model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    times = []
    last = time.perf_counter()
    for step in range(args.steps):
        x, y = tg.batch(data, step, rank, 0, 1, args.batch_size, args.context)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # what FaultTolerant.finish_step does with the loss
        now = time.perf_counter()
        times.append(now - last)
        last = now
    _write(args.out, {"mode": "ddp", "rank": rank, "times": times})
    dist.destroy_process_group()


def worker_transom(args: argparse.Namespace) -> None:
    import torch
    from transom import ft

    tg, model, data = _model_and_data(args)
    ctx = ft.init()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    trainer = ft.FaultTolerant(model, optimizer, ctx)
    times, finish = [], []
    last = time.perf_counter()
    for step in trainer.steps(args.steps):  # begin_step (quorum request) runs in here
        x, y = tg.batch(data, step, trainer.replica_id, ctx.rank, ctx.world_size, args.batch_size, args.context)
        loss = model(x, y)
        loss.backward()
        t_finish = time.perf_counter()
        trainer.finish_step(loss)  # quorum wait, FTAR, vote, optimizer step
        now = time.perf_counter()
        times.append(now - last)
        finish.append(now - t_finish)
        last = now
    trainer.close()
    _write(args.out, {"mode": "transom", "rank": trainer.replica_id, "times": times, "finish": finish})


# --- driver --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_args(args: argparse.Namespace, mode: str, out: Path) -> list[str]:
    return [
        str(Path(__file__).resolve()), "--worker", mode, "--out", str(out),
        "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--context", str(args.context),
        "--dim", str(args.dim), "--layers", str(args.layers), "--lr", str(args.lr),
    ]


def _run_ddp(args: argparse.Namespace, workdir: Path, tag: str) -> tuple[list[dict], str]:
    """Start the N DDP workers under one small parent so run_bounded can time them out."""
    out = workdir / f"{tag}.jsonl"
    spawn = (
        "import os, subprocess, sys\n"
        "cmd, n = sys.argv[2:], int(sys.argv[1])\n"
        "ps = [subprocess.Popen(cmd, env={**os.environ, 'RANK': str(r), 'LOCAL_RANK': str(r)}) for r in range(n)]\n"
        "codes = [p.wait() for p in ps]\n"
        "sys.exit(max(abs(c) for c in codes))\n"
    )
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(args.replicas),
    }
    cmd = [sys.executable, "-c", spawn, str(args.replicas), sys.executable, *_worker_args(args, "ddp", out)]
    res = run_bounded(cmd, args.run_timeout, workdir / f"{tag}.log", env)
    return _collect(out, res, args), ""


def _run_transom(args: argparse.Namespace, workdir: Path, tag: str) -> tuple[list[dict], dict]:
    out = workdir / f"{tag}.jsonl"
    summary = workdir / f"{tag}-summary.json"
    cmd = [
        sys.executable, "-m", "transom", "run", "--replicas", str(args.replicas), "--quiet",
        "--timeout", str(args.run_timeout), "--summary-json", str(summary),
        "--", sys.executable, *_worker_args(args, "transom", out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = run_bounded(cmd, args.run_timeout + 30, workdir / f"{tag}.log", env)
    records = _collect(out, res, args)
    return records, json.loads(summary.read_text()) if summary.exists() else {}


class RunFailed(RuntimeError):
    pass


def _collect(out: Path, res, args: argparse.Namespace) -> list[dict]:
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if res.timed_out or res.returncode != 0 or len(records) != args.replicas:
        state = "timed out" if res.timed_out else f"exit {res.returncode}"
        raise RunFailed(f"{state}, {len(records)}/{args.replicas} workers reported; output tail:\n{res.tail()}")
    return records


def _post_warmup(records: list[dict], warmup: int) -> list[float]:
    return [t for r in records for t in r["times"][warmup:]]


def _rounds(
    args: argparse.Namespace,
    pooled: dict[str, list[float]],
    run_medians: dict[str, list[float]],
    round_ratios: list[float],
    load_avg: list[float],
    bit_identical: list[bool],
) -> None:
    """Run the alternating rounds, filling the lists and dicts passed in."""
    with tempfile.TemporaryDirectory(prefix="transom-bench-") as tmp:
        workdir = Path(tmp)
        for rnd in range(args.repeats):
            order = ("ddp", "transom") if rnd % 2 == 0 else ("transom", "ddp")
            medians: dict[str, float] = {}
            for mode in order:
                tag = f"r{rnd}-{mode}"
                load_avg.append(round(os.getloadavg()[0], 2))
                t0 = time.monotonic()
                if mode == "ddp":
                    records, _ = _run_ddp(args, workdir, tag)
                    extra = ""
                else:
                    records, summary = _run_transom(args, workdir, tag)
                    bit_identical.append(bool(summary.get("replicas_bit_identical")))
                    fin = statistics.median(t for r in records for t in r["finish"][args.warmup:])
                    extra = (
                        f"  (finish_step {fin * 1e3:.2f} ms)  committed {summary.get('steps_committed')}"
                        f"  bit-identical {summary.get('replicas_bit_identical')}"
                    )
                times = _post_warmup(records, args.warmup)
                pooled[mode] += times
                medians[mode] = statistics.median(times)
                run_medians[mode].append(medians[mode])
                print(
                    f"round {rnd} {mode:7s}: median step {medians[mode] * 1e3:7.2f} ms  "
                    f"(p10 {statistics.quantiles(times, n=10)[0] * 1e3:6.2f}, "
                    f"p90 {statistics.quantiles(times, n=10)[-1] * 1e3:6.2f}; "
                    f"{len(times)} steps; run {time.monotonic() - t0:5.1f} s; load {load_avg[-1]:.1f}){extra}",
                    flush=True,
                )
            round_ratios.append(medians["transom"] / medians["ddp"])
            print(f"round {rnd} ratio transom/ddp: {round_ratios[-1]:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3, help="processes (one per replica)")
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs both sides once (ABBA order)")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds before a run is killed")
    p.add_argument("--worker", choices=["ddp", "transom"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker == "ddp":
        return worker_ddp(args)
    if args.worker == "transom":
        return worker_transom(args)
    if args.steps <= args.warmup + 1:
        p.error("--steps must exceed --warmup by at least 2")

    print(
        f"ftar_overhead: {args.replicas} replicas x 1 process, gloo on CPU, TinyGPT dim {args.dim} "
        f"layers {args.layers}, batch {args.batch_size}x{args.context} per process, {args.steps} steps "
        f"(first {args.warmup} left out), {args.repeats} round(s)",
        flush=True,
    )
    pooled: dict[str, list[float]] = {"ddp": [], "transom": []}
    run_medians: dict[str, list[float]] = {"ddp": [], "transom": []}
    round_ratios: list[float] = []
    load_avg: list[float] = []
    bit_identical: list[bool] = []
    try:
        _rounds(args, pooled, run_medians, round_ratios, load_avg, bit_identical)
    except RunFailed as e:
        print(f"run failed: {e}", flush=True)
        failure = {
            "benchmark": "ftar_overhead", "ok": False, "error": str(e)[-2000:],
            "target_ratio": TARGET_RATIO, "replicas": args.replicas, "steps": args.steps,
        }
        print(json.dumps(failure), flush=True)
        sys.exit(1)

    ddp_s = statistics.median(run_medians["ddp"])
    transom_s = statistics.median(run_medians["transom"])
    ratio = transom_s / ddp_s
    load_avg.append(round(os.getloadavg()[0], 2))
    ddp_p10 = statistics.quantiles(pooled["ddp"], n=10)[0]
    transom_p10 = statistics.quantiles(pooled["transom"], n=10)[0]
    ok = ratio <= TARGET_RATIO and all(bit_identical)
    print(
        f"median of run medians: ddp {ddp_s * 1e3:.2f} ms/step, transom {transom_s * 1e3:.2f} ms/step, ratio {ratio:.3f} "
        f"(target <= {TARGET_RATIO}): {'OK' if ok else 'NOT MET'}",
        flush=True,
    )
    print(
        f"per-round ratios {', '.join(f'{r:.3f}' for r in round_ratios)} "
        f"(median {statistics.median(round_ratios):.3f}); 1-min load average per run {load_avg} on {os.cpu_count()} CPUs",
        flush=True,
    )
    print(
        f"fastest decile (p10, less sensitive to other load): ddp {ddp_p10 * 1e3:.2f} ms, "
        f"transom {transom_p10 * 1e3:.2f} ms, ratio {transom_p10 / ddp_p10:.3f}",
        flush=True,
    )
    print(
        json.dumps(
            {
                "benchmark": "ftar_overhead",
                "ddp_step_s": round(ddp_s, 6),
                "transom_step_s": round(transom_s, 6),
                "ratio": round(ratio, 4),
                "round_ratios": [round(r, 4) for r in round_ratios],
                "ratio_median_of_rounds": round(statistics.median(round_ratios), 4),
                "ddp_step_p10_s": round(ddp_p10, 6),
                "transom_step_p10_s": round(transom_p10, 6),
                "ratio_p10": round(transom_p10 / ddp_p10, 4),
                "replicas": args.replicas,
                "steps": args.steps,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "batch_size": args.batch_size,
                "dim": args.dim,
                "layers": args.layers,
                "backend": "gloo",
                "cpus": os.cpu_count(),
                "load_avg": load_avg,
                "transom_bit_identical": all(bit_identical),
                "target_ratio": TARGET_RATIO,
                "ok": ok,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
