"""Gradient accumulation inside a replica of DDP processes, switched off for all but the
last micro step by `--switch`: DDP's own `model.require_backward_grad_sync` (nanoGPT's
idiom), DDP's `model.no_sync()`, or `trainer.no_sync()`. All three must train alike.

    transom run --replicas 2 --nproc-per-replica 2 -- python ddp_accumulate.py --switch ddp-attribute
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from transom import ft

MICRO_STEPS = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switch", choices=["ddp-attribute", "ddp-no-sync", "trainer-no-sync"], required=True)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = ft.init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    with ft.FaultTolerant(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ctx) as trainer:
        for _ in trainer.steps(args.steps):
            for micro in range(MICRO_STEPS):
                g = trainer.generator(micro)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
                last = micro == MICRO_STEPS - 1
                quiet: contextlib.AbstractContextManager
                if args.switch == "ddp-attribute":
                    model.require_backward_grad_sync = last
                    quiet = contextlib.nullcontext()
                else:
                    quiet = contextlib.nullcontext() if last else \
                        model.no_sync() if args.switch == "ddp-no-sync" else trainer.no_sync()
                with quiet:
                    (torch.nn.functional.mse_loss(model(x), y) / MICRO_STEPS).backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()


if __name__ == "__main__":
    main()
