"""What a script sees between `loss.backward()` and `optimizer.step()` with FSDP2 inside
each replica: every rank prints a digest of its gradient shard there, after clipping on the
gradients' norm, so that the test can compare replicas. The replicas train on different
batches; only the cross-replica average makes their shards equal, and only clipping that
sees the average clips them alike. `--accumulate K` runs K micro batches a step, all but
the last in `trainer.no_sync()`.

    transom run --replicas 2 --nproc-per-replica 2 -- python fsdp_grads.py
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib

import torch
from torch.distributed.fsdp import fully_shard

from transom import ft


def shard_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        assert p.grad is not None
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        h.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulate", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = ft.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    fully_shard(model)
    with ft.FaultTolerant(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ctx) as trainer:
        for step in trainer.steps(args.steps):
            for micro in range(args.accumulate):
                g = trainer.generator(micro)  # different on every rank of every replica
                x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
                last = micro == args.accumulate - 1
                with contextlib.nullcontext() if last else trainer.no_sync():
                    (torch.nn.functional.mse_loss(model(x), y) * 100 / args.accumulate).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            print(f"grads replica {ctx.replica_id} rank {ctx.rank} step {step}: {shard_digest(model)}", flush=True)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()


if __name__ == "__main__":
    main()
