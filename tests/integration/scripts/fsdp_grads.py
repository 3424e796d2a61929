"""What a script sees between `loss.backward()` and `optimizer.step()` with FSDP2 inside
each replica: every rank prints a digest of its gradient shard there, after clipping on the
gradients' norm, so that the test can compare replicas. The replicas train on different
batches; only the cross-replica average makes their shards equal, and only clipping that
sees the average clips them alike. `--accumulate K` runs K micro batches a step, all but
the last in `trainer.no_sync()`. `--aside-at S`: replica 0 evaluates in `trainer.aside()`
before step S, until replica 1 has committed 3 steps more (it writes its step to a file),
so that it comes back behind; the root module keeps its parameters unsharded after a
forward pass (torchtitan's setting), so the evaluation leaves them so until the next
backward pass.

    transom run --replicas 2 --nproc-per-replica 2 -- python fsdp_grads.py
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import time
from pathlib import Path

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


PROGRESS = Path("replica-1-step")


def _read_step(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return -1


def wait_for_step(path: Path, step: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _read_step(path) >= step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica 1 did not reach step {step} within {timeout_s}s")
        time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--aside-at", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = ft.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    fully_shard(model[0])
    fully_shard(model, reshard_after_forward=False)
    with ft.FaultTolerant(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ctx) as trainer:
        for step in trainer.steps(args.steps):
            if step == args.aside_at and ctx.replica_id == 0:
                with trainer.aside(), torch.no_grad():  # an evaluation, on one replica
                    model(torch.randn(16, 8))
                    wait_for_step(PROGRESS, step + 3)
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
            if ctx.replica_id == 1 and ctx.rank == 0 and args.aside_at is not None:
                PROGRESS.write_text(str(trainer.step))


if __name__ == "__main__":
    main()
