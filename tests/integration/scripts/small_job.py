"""A small training loop for tests of a job's life cycle (not of what it learns).

    transom run --replicas 2 -- python small_job.py --steps 40 [--child-pid-dir D]

`--child-pid-dir D`: each worker starts a long-running child process of its own (as a
DataLoader worker or a helper tool would) and writes its own and the child's pid under D,
so a test can check that nothing outlives a stop. `--setsid-child-dir D`: the same, but the child leaves the worker's
process group (it calls `os.setsid()`, as a daemon does) and carries D in its command line.
`--second-backward-at N`: at step N, a second backward pass without `trainer.no_sync()`, a
bug of the script (UsageError) that ends the job at once. `--fifos-then-crash R:N`: at step N
of its first attempt, replica R's worker replaces each file it shares with its launcher (its
signals rows, collective counts, waiting byte, stacks, ScriptError record, and a step record
under the stats directory) with a FIFO, then crashes: its launcher must still restart it in
place (issue 43, item 2). (How a script ends a job, early or
in the `with` form: test_completion.py, with replicas as threads.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from transom import contract, ft


def fifos_then_crash(replica_id: int) -> None:
    """Every file of this worker's that its launcher reads becomes a FIFO; then the worker dies."""
    rank, attempt = os.environ["RANK"], os.environ[contract.ENV_ATTEMPT]
    signals, stats = Path(os.environ[contract.ENV_SIGNALS_DIR]), Path(os.environ[contract.ENV_STATS_DIR])
    paths = [*signals.glob(f"*-r{replica_id}-g*-a{attempt}-k{rank}*"), Path(os.environ[contract.ENV_SCRIPT_ERROR_FILE]),
             stats / "steps-r99-g0-a0.jsonl"]  # a replica the run has not: the test reads its own
    for path in paths:
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    print(f"replaced with FIFOs: {sorted(p.name for p in paths)}", flush=True)
    os._exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--child-pid-dir", type=Path, default=None)
    p.add_argument("--setsid-child-dir", type=Path, default=None)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long in every step")
    p.add_argument("--second-backward-at", type=int, default=None, help="a second backward pass at this step")
    p.add_argument("--fifos-then-crash", default=None, metavar="R:N", help="replica R, step N: FIFOs, then a crash")
    args = p.parse_args()
    ctx = ft.init()
    if args.child_pid_dir is not None:
        child = subprocess.Popen(["sleep", "600"])
        (args.child_pid_dir / f"{os.getpid()}-{child.pid}").touch()
    if args.setsid_child_dir is not None:
        child = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)",
                                  str(args.setsid_child_dir)])
        (args.setsid_child_dir / f"{os.getpid()}-{child.pid}").touch()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    trainer = ft.FaultTolerant(model, torch.optim.SGD(model.parameters(), lr=0.1), ctx)
    try:
        for step in trainer.steps(args.steps):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(31 * step + trainer.replica_id))
            model(x).pow(2).mean().backward()
            first_attempt = os.environ[contract.ENV_ATTEMPT] == "0"
            if args.fifos_then_crash == f"{trainer.replica_id}:{trainer.step}" and first_attempt:
                fifos_then_crash(trainer.replica_id)
            if trainer.step == args.second_backward_at:
                model(x).pow(2).mean().backward()  # without trainer.no_sync(): UsageError
            time.sleep(args.step_seconds)
            trainer.finish_step()
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
