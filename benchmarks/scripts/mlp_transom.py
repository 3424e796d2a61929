"""The recovery benchmark's Transom worker: the ordinary loop with `trainer.optimizer`.

Run by `transom run` (benchmarks/recovery.py); faults come from `--inject`.
"""

import time

STARTED = time.time()  # before the imports: the restart cost includes them

import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from transom import ft  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlp_workload import StepLog, batch, build_model, setup  # noqa: E402


def main() -> None:
    args = setup()
    ctx = ft.init()
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    log = StepLog("transom", ctx.replica_id, STARTED)
    with ft.FaultTolerant(model, opt, ctx) as trainer:
        optimizer = trainer.optimizer
        for step in trainer.steps(args.steps):
            t0 = time.time()
            x, y = batch(ctx.replica_id, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            t1 = time.time()
            log.step(trainer.step, t1, t1 - t0, trainer.last_step_committed, trainer.last_batch_trained)
    log.close()


if __name__ == "__main__":
    main()
