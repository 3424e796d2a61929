"""A model trained from a `Dataset` through an ordinary `DataLoader`, made fault tolerant.

    transom run --replicas 3 --inject kill:replica=1,step=30 -- python examples/train_dataloader.py

The loop is a plain PyTorch one: a `DataLoader` with worker processes (its sampler an
`ft.ReplicaSampler`, so each replica and rank reads its own share of every global batch),
`loss.backward(); optimizer.step(); optimizer.zero_grad()` with AdamW, a cosine
learning-rate schedule, gradient clipping (on the gradients averaged across replicas) and
AMP's `GradScaler` where a GPU is present (disabled on the CPU). Transom's part:
`ft.init()`, the sampler, `with ft.FaultTolerant(...)`, `trainer.optimizer` and
`trainer.batches(...)`.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from transom import ft


class Spirals(Dataset):
    """Two interleaved spirals in 2-D, labelled by spiral (generated: no download)."""

    def __init__(self, n: int = 4096, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        t = torch.rand(n, generator=g) * 3 * math.pi
        label = torch.randint(0, 2, (n,), generator=g)
        angle = t + label * math.pi
        self.x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], 1) / 10
        self.x += 0.02 * torch.randn(n, 2, generator=g)
        self.y = label

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()

    torch.set_num_threads(1)
    ctx = ft.init()
    dataset = Spirals()
    sampler = ft.ReplicaSampler(dataset, ctx, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)

    torch.manual_seed(0)  # every replica starts from the same weights
    model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)).to(ctx.device)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    use_amp = ctx.device.type == "cuda"
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=use_amp)

    # The scaler's scale and the schedule's position are replica state: they travel with
    # peer recovery and checkpoints, like the model and the optimizer.
    with ft.FaultTolerant(model, optimizer, ctx, scaler=scaler, extra_state=scheduler) as trainer:
        optimizer = trainer.optimizer  # steps only committed steps
        for _step, (x, y) in trainer.batches(loader, args.steps):
            with torch.autocast(ctx.device.type, enabled=use_amp):
                loss = nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
            scaler.scale(loss).backward()  # the gradients come back averaged across replicas
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            trainer.report(loss)  # optional: the loss in the job's status and metrics
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if trainer.last_step_committed:
                scheduler.step()  # the schedule follows committed steps only
            if ctx.rank == 0 and trainer.log_due(20):  # committed, and trained on the job's weights
                print(f"replica {trainer.replica_id}: step {trainer.step} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.5f}", flush=True)


if __name__ == "__main__":
    main()
