"""The workload of benchmarks/rebalance.py: an ordinary DataLoader loop (a small MLP on
synthetic data, SGD) on a modelled device whose step takes `--sample-seconds` per sample,
and `--slow-factor` times that on replica `--slow-replica` from step `--slow-from` (a
degraded device). The device time is a sleep: on this 2-core machine real compute would
make the replicas compete for the cores, and how long a step takes would depend on what
the other replica does, which it does not on a real accelerator.

    transom run --replicas 2 -- python benchmarks/scripts/rebalance_worker.py --steps 150 \
        [--slow-replica 1 --slow-from 20 --slow-factor 2]

Each rank appends `{"step", "samples", "t"}` per committed step to
$BENCH_OUT/r<replica>-k<rank>.jsonl (the end of the step, wall clock).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from transom import ft

DIM, LAYERS = 256, 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=64, help="nominal samples per rank and step")
    p.add_argument("--sample-seconds", type=float, default=0.001, help="the modelled device's time per sample")
    p.add_argument("--slow-replica", type=int, default=None)
    p.add_argument("--slow-from", type=int, default=20)
    p.add_argument("--slow-factor", type=float, default=2.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = ft.init()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8192, DIM, generator=g), torch.randn(8192, 1, generator=g))
    loader = DataLoader(data, batch_size=args.batch_size, sampler=ft.ReplicaSampler(data, ctx, seed=1))
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(DIM, 1))
    out = open(Path(os.environ["BENCH_OUT"]) / f"r{ctx.replica_id}-k{ctx.rank}.jsonl", "a")
    with ft.FaultTolerant(model, torch.optim.SGD(model.parameters(), lr=1e-3), ctx) as trainer:
        for step, (x, y) in trainer.batches(loader, args.steps):
            torch.nn.functional.mse_loss(model(x), y).backward()
            slow = ctx.replica_id == args.slow_replica and step >= args.slow_from
            time.sleep(args.sample_seconds * len(x) * (args.slow_factor if slow else 1.0))
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            if trainer.last_step_committed:
                out.write(json.dumps({"step": step, "samples": len(x), "t": time.time()}) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
