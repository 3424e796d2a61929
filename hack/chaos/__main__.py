"""`make chaos`: a TrainingJob on real pods through every fault of the issue's list, one
after another, each judged the same way (job.py); a table, then one JSON line.

    .venv/bin/python hack/chaos [--scenarios node_loss,partition,...] [--steps N] [--trainer-image built|host-venv]

It starts (or reuses) the test environment with three real nodes, installs the operator
with its chart as two replicas (leader election), and runs each scenario in a namespace of
its own, its pods on the trainer image built from images/trainer.Dockerfile
(`--trainer-image host-venv`: the test image that mounts the host's venv, as the test suite's
chaos subset runs). Exit status 0 when every scenario survived.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HACK = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HACK))

from chaos.catalog import NAMES, run_named  # noqa: E402
from chaos.scenarios import STEPS  # noqa: E402
from chaos.world import World  # noqa: E402
from e2e_demo import BUILT, TRAINER_IMAGES  # noqa: E402
from testenv import cluster  # noqa: E402

ORDER = ["node_loss", "partition", "drain", "coordinator_loss", "operator_loss", "storage_outage", "oom",
         "image_pull", "containerd_restart", "bad_node"]
REAL_NODES = 3
COLUMNS = ("scenario", "detected after", "contributing again after", "steps lost", "replicas identical", "reason")


def table(rows: list[dict]) -> str:
    def seconds(x):
        return "-" if x is None else f"{x:.1f} s"
    lines = [[r["name"], seconds(r["detect_s"]), seconds(r["recover_s"]), str(r["steps_lost"]),
              "yes" if r["bit_identical"] else "NO", r["reason"] + ("" if r["survived"] else "  (FAILED)")]
             for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(COLUMNS)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*COLUMNS), fmt.format(*("-" * w for w in widths)),
                      *(fmt.format(*line) for line in lines)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(ORDER), help=f"comma-separated, of {', '.join(ORDER)}")
    p.add_argument("--steps", type=int, default=STEPS, help="the job's step cap (each scenario ends it sooner)")
    p.add_argument("--trainer-image", choices=TRAINER_IMAGES, default=BUILT,
                   help="the jobs' pods run the trainer image built from images/trainer.Dockerfile (default), "
                        "or the test image that mounts the host's venv")
    args = p.parse_args()
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in ORDER]
    if unknown:
        p.error(f"unknown scenarios {unknown}: choose from {', '.join(ORDER)}")
    assert set(ORDER) == set(NAMES)
    with cluster.session_lock(60):
        env = cluster.current()
        if env is None or len(env.real_nodes) < REAL_NODES:
            t0 = time.monotonic()
            env = cluster.up(num_nodes=0, real_nodes=REAL_NODES)
            print(f"test environment up with real nodes {', '.join(env.real_nodes)} in {time.monotonic() - t0:.1f}s",
                  flush=True)
        world = World(env, log=lambda line: print(line, flush=True), trainer=args.trainer_image)
        try:
            world.install_operator(replicas=2)
            rows = []
            for name in names:
                print(f"=== {name}", flush=True)
                verdict = run_named(world, name, args.steps)
                for note in verdict.notes:
                    print(f"    {note}", flush=True)
                for problem in verdict.problems:
                    print(f"    PROBLEM: {problem}", flush=True)
                rows.append(verdict.row())
                print(f"    {json.dumps(verdict.row())}", flush=True)
        finally:
            world.uninstall_operator()
            world.close()
    print(table(rows))
    print(json.dumps({"scenarios": rows, "all_survived": all(r["survived"] for r in rows)}))
    return 0 if all(r["survived"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
