"""A worker's view of its replica: identity from the environment and the replica's own world.

`init()` is the first call of a training script. With several processes per replica it
joins the replica's own torch.distributed world (MASTER_ADDR/PORT given by the launcher),
so the script can wrap its model in DDP or FSDP2 *inside* the replica; FTAR then runs
across replicas on groups of its own. Which backend serves the replica's world follows from
where its processes and tensors are (backend.py). It also creates a small Gloo group for the
replica's control traffic (quorum broadcast, commit vote), so that traffic never queues
behind NCCL kernels.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from transom import script_errors
from transom.collective_counts import COUNTER
from transom.contract import ENV_LOG_LEVEL, ReplicaEnv
from transom.ft import backend as placement


@dataclass
class ReplicaContext:
    env: ReplicaEnv
    rank: int  # rank inside the replica = shard index across replicas
    local_rank: int
    world_size: int  # processes in this replica
    backend: str  # requested for the cross-replica groups: "auto", "gloo" or "nccl" (backend.py)
    device: torch.device
    ctrl_group: dist.ProcessGroup | None  # Gloo group of the replica, None with one process

    @property
    def replica_id(self) -> int:
        return self.env.replica_id

    @property
    def num_replicas(self) -> int:
        return self.env.num_replicas

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def bind_host(self) -> str:
        """Where this rank's servers listen: every interface, unless the replica advertises
        loopback (a local run)."""
        return "0.0.0.0" if self.env.advertise_addr != "127.0.0.1" else "127.0.0.1"

    # Agreements between the ranks of the replica, over its control group. Every rank must
    # call them in the same order; with one process they return their argument. Each is
    # counted (entered, completed: transom/collective_counts.py): a rank that never arrives
    # at one is named by its count (detect/hangs.py).
    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order."""
        if self.ctrl_group is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        COUNTER.group_entered()
        dist.all_gather_object(out, value, group=self.ctrl_group)
        COUNTER.group_completed()
        return out

    def from_leader(self, value: Any) -> Any:
        """Rank 0's `value` on every rank, as JSON gives it back (a tuple comes as a list).
        JSON, not pickle: nothing a rank receives is executed."""
        if self.ctrl_group is None:
            return value
        data = json.dumps(value).encode() if self.is_leader else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        COUNTER.group_entered()
        dist.broadcast(size, src=0, group=self.ctrl_group)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_leader \
            else torch.zeros(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.ctrl_group)
        COUNTER.group_completed()
        return json.loads(data if self.is_leader else payload.numpy().tobytes())

    def wait_for_promotion(self) -> None:
        """A hot spare's workers wait here, with everything the script built before
        FaultTolerant loaded, until the pod's labels name a replica (launch/spare.py); from
        then on this context is that replica's. There is no deadline: a spare may wait for
        days, and its launcher stops it. Every rank takes the leader's reading."""
        if not self.env.is_spare:
            return
        from transom.launch import spare

        found = spare.wait_for_assignment(spare.podinfo_dir(), lambda: False)
        assert found is not None  # never stopped: the wait ends with a promotion
        replica_id, generation = self.from_leader((found.replica_id, found.generation))
        self.env = self.env.promoted(replica_id, generation)

    def all_ok(self, ok: bool) -> bool:
        """True on every rank if `ok` was true on every rank."""
        return self.all_ok_each(ok)[0]

    def all_ok_each(self, *oks: bool) -> tuple[bool, ...]:
        """For each of `oks`, whether it was true on every rank: in one collective, since
        each is a wait for the replica's slowest rank."""
        if self.ctrl_group is None:
            return oks
        flags = torch.tensor([1 if ok else 0 for ok in oks], dtype=torch.int32)
        COUNTER.group_entered()
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.ctrl_group)
        COUNTER.group_completed()
        return tuple(bool(f) for f in flags.tolist())


def holding(group: object) -> dist.ProcessGroup:
    """`group` (the default group, or a new one of every rank), which torch types loosely:
    None before init_process_group, NON_GROUP_MEMBER on a rank outside a new group."""
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"expected a process group that holds this rank, got {group!r}")
    return group


def init(backend: str | None = None, timeout_s: float = 300.0) -> ReplicaContext:
    """Read the pod environment and join the replica's own world if it has several processes.

    `backend`: "auto" (default, or TRANSOM_BACKEND), "gloo" or "nccl"; it decides the replica's
    own world here and is the default of the cross-replica groups (backend.py says how).
    `ctx.device` is this process's GPU where there is one (shared round-robin when the
    processes outnumber the GPUs), else the CPU; the script moves its model there.
    From here on a ScriptError that escapes the script ends the job (script_errors.py).
    """
    script_errors.install_hook()
    env = ReplicaEnv.from_environ()
    rank = int(os.environ.get("RANK", "0"))
    _log_to_stderr(os.environ.get(ENV_LOG_LEVEL), rank)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    choice = placement.requested(backend)
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world_backend = placement.replica_world(choice, cuda_devices=cuda_devices, local_world_size=local_world_size)
    index = placement.local_device_index(local_rank, cuda_devices)
    if index is not None:
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    ctrl: dist.ProcessGroup | None = None
    if world_size > 1:
        if not dist.is_initialized():
            dist.init_process_group(
                backend=world_backend,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        ctrl = holding(dist.group.WORLD if world_backend == "gloo"
                      else dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
    return ReplicaContext(
        env=env,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        backend=choice,
        device=device,
        ctrl_group=ctrl,
    )


def _log_to_stderr(level: str | None, rank: int) -> None:
    """With TRANSOM_LOG_LEVEL set (as for the CLI), the worker's `transom` logs go to stderr
    too, each line saying which pid and rank wrote it; the script's own logging (and the
    root logger) is left alone."""
    logger = logging.getLogger("transom")
    if not level or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [pid %(process)d rank {rank}] %(name)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
