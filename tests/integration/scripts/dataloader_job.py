"""A loop over an ordinary DataLoader (worker processes) through ft.ReplicaSampler and
trainer.batches, in the ordinary optimizer idiom with AMP's GradScaler (enabled on the CPU
too, so its skip path runs), logging which samples each committed step trained on.

    transom run --replicas 3 -- python dataloader_job.py --steps 30 --log-dir D [--workers 2]
        [--inf-at REPLICA:STEP] [--sample-seconds S]

Every rank appends one JSON line per step to D/<replica>-<rank>-<pid>.jsonl:
{"replica", "rank", "step", "committed", "updated", "scale", "indices", "params"} ("updated":
the optimizer stepped; "params": the parameters after the step), and at the end
D/final-<replica>-<rank>.json with the model's parameters; the test checks them.
`--inf-at` makes that replica's loss infinite at that step (an AMP overflow);
`--sample-seconds` makes a step's compute proportional to its batch (a sleep per sample).
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

SAMPLES = 120
BATCH = 4


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    return TensorDataset(torch.arange(SAMPLES), x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sample-seconds", type=float, default=0.0, help="sleep this long per sample of the batch")
    p.add_argument("--inf-at", default=None, help="REPLICA:STEP whose loss overflows")
    args = p.parse_args()
    inf_at = tuple(int(v) for v in args.inf_at.split(":")) if args.inf_at else None
    torch.set_num_threads(1)
    ctx = ft.init()
    data = dataset()
    loader = DataLoader(data, batch_size=BATCH, sampler=ft.ReplicaSampler(data, ctx, seed=5), num_workers=args.workers)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    log = open(args.log_dir / f"{ctx.replica_id}-{ctx.rank}-{os.getpid()}.jsonl", "a")
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    stepped: list[bool] = []  # the update was applied: the optimizer stepped (not only "the weights moved")
    sgd.register_step_post_hook(lambda *_: stepped.append(True))
    with ft.FaultTolerant(model, sgd, ctx, scaler=scaler) as trainer:
        optimizer = trainer.optimizer
        for step, (index, x, y) in trainer.batches(loader, args.steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            if inf_at == (ctx.replica_id, step):
                loss = loss * float("inf")
            stepped.clear()
            time.sleep(args.sample_seconds * len(index))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            committed = trainer.last_batch_trained  # this replica's batch went into a committed step
            log.write(json.dumps({"replica": ctx.replica_id, "rank": ctx.rank, "step": step, "committed": committed,
                                  "updated": bool(stepped), "scale": scaler.get_scale(),
                                  "indices": index.tolist(),
                                  "params": model.weight.detach().flatten().tolist() + model.bias.detach().tolist()})
                      + "\n")
            log.flush()
    final = {"weight": model.weight.detach().flatten().tolist(), "bias": model.bias.detach().tolist()}
    (args.log_dir / f"final-{ctx.replica_id}-{ctx.rank}.json").write_text(json.dumps(final))


if __name__ == "__main__":
    main()
