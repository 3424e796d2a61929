"""The inner-shape benchmark's worker: a replica of two ranks with DDP or FSDP2 inside it.

`--system flat`: no fault tolerance, one torch.distributed world over every rank of every
replica (started by torchrun): DDP over all of them (`--inner ddp`), or HSDP (`--inner
fsdp`: FSDP2 on a 2-D mesh, replicated across replicas, sharded inside one), the way a
job runs without Transom. `--system transom`: `transom run --nproc-per-replica 2`, the
same model wrapped in DDP or FSDP2 over the replica's own world, and the ordinary loop
with `trainer.optimizer`. Every rank trains its replica's batch of each step (the
workload's), so both systems compute and exchange the same.
"""

import time

STARTED = time.time()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import MODELS, StepLog, Workload  # noqa: E402

RANKS = 2  # per replica


def wrap(work: Workload, inner: str, mesh=None) -> torch.nn.Module:
    """The workload's model under DDP or FSDP2 (every module that holds parameters sharded)."""
    if inner == "ddp":
        return torch.nn.parallel.DistributedDataParallel(work.model)
    for m in work.model.modules():
        if m is not work.model and any(True for _ in m.parameters(recurse=False)):
            fully_shard(m, mesh=mesh)
    fully_shard(work.model, mesh=mesh)
    return work.model


def flat(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    replica = rank // RANKS
    work = Workload(args.model)
    mesh = None
    if args.inner == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size() // RANKS, RANKS), mesh_dim_names=("replicate", "shard"))
    model = wrap(work, args.inner, mesh)
    opt = work.optimizer(model)
    log = StepLog("flat", replica, STARTED)
    last = time.time()
    for step in range(args.steps):
        work.loss(replica, step, model).backward()
        opt.step()
        opt.zero_grad()
        now = time.time()
        log.step(step + 1, now, now - last, True, True)
        last = now
    log.close()
    dist.destroy_process_group()


def transom(args: argparse.Namespace) -> None:
    from transom import ft

    ctx = ft.init()
    work = Workload(args.model)
    model = wrap(work, args.inner)
    opt = work.optimizer(model)
    with ft.FaultTolerant(model, opt, ctx) as trainer:
        log = StepLog("transom", trainer.replica_id, STARTED)
        optimizer = trainer.optimizer
        last = time.time()
        for step in trainer.steps(args.steps):
            work.loss(trainer.replica_id, step, model).backward()
            optimizer.step()
            optimizer.zero_grad()
            now = time.time()
            log.step(trainer.step, now, now - last, trainer.last_step_committed, trainer.last_batch_trained)
            last = now
    log.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=("flat", "transom"), required=True)
    p.add_argument("--inner", choices=("ddp", "fsdp"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--model", choices=MODELS, default="mlp")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    (flat if a.system == "flat" else transom)(a)
