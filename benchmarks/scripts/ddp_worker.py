"""The comparison benchmarks' plain DDP worker: the same workload, processes and backend as
the fault-tolerant ones, as torch.distributed would run it without fault tolerance (one
process per replica, `init_process_group("gloo")` from MASTER_ADDR/PORT, RANK, WORLD_SIZE,
the model wrapped in DistributedDataParallel, whose all-reduce overlaps backward).
"""

import time

STARTED = time.time()

import os  # noqa: E402
import sys  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import StepLog, Workload, setup  # noqa: E402


def main() -> None:
    args = setup()
    work = Workload(args.model)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(work.model)
    opt = work.optimizer(model)
    log = StepLog("ddp", rank, STARTED)
    last = time.time()
    for step in range(args.steps):
        work.loss(rank, step, model).backward()
        opt.step()
        opt.zero_grad()
        now = time.time()
        log.step(step + 1, now, now - last, True, True)
        last = now
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
