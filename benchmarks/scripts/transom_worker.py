"""The comparison benchmarks' Transom worker: the ordinary loop with `trainer.optimizer`.

Run by `transom run` or `transom launch` (benchmarks/_replicas.py); faults come from
`--inject` / TRANSOM_FAULT. In a hot spare the constructor of FaultTolerant waits until
the spare takes over a replica, so the log is opened after it, under that replica's id.
"""

import time

STARTED = time.time()  # before the imports: the restart cost includes them

import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402, F401  (imported here so that the figure says what the import costs)

from transom import ft  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import StepLog, Workload, setup  # noqa: E402

IMPORTED = time.time()


def main() -> None:
    args = setup()
    ctx = ft.init()
    work = Workload(args.model)
    model, opt = work.model, work.optimizer()
    built = time.time()
    with ft.FaultTolerant(model, opt, ctx) as trainer:
        log = StepLog("transom", trainer.replica_id, STARTED, imported=IMPORTED, built=built, joined=time.time())
        optimizer = trainer.optimizer
        last = time.time()
        for step in trainer.steps(args.steps):
            work.loss(trainer.replica_id, step).backward()
            optimizer.step()
            optimizer.zero_grad()
            now = time.time()
            log.step(trainer.step, now, now - last, trainer.last_step_committed, trainer.last_batch_trained)
            last = now
    log.close()


if __name__ == "__main__":
    main()
