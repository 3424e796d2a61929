"""Cross-replica process groups, built directly for each quorum.

A group is built from the quorum's store endpoint and a prefix the coordinator never
reuses, so a new quorum never meets a stale key (a reused prefix hangs). We construct the
backend's ProcessGroup class ourselves instead of going through init_process_group: the
replica's own torch.distributed world (DDP/FSDP inside the replica) stays untouched, and a
failed group can be dropped without tearing anything else down.

Gloo cannot abort an op in flight; its per-op timeout bounds every wait. NCCL ops are
asynchronous on the GPU, so a wait past the deadline aborts the communicator, which is the
only way to free the stream of a collective whose peer died.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

log = logging.getLogger("transom.ft")


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


class CrossReplicaGroup:
    """One cross-replica group: rank `rank` of `size` replicas, for one shard index."""

    def __init__(
        self,
        backend: str,
        store_addr: str,
        prefix: str,
        rank: int,
        size: int,
        timeout_s: float,
        device: torch.device | None = None,
    ):
        self.backend = backend
        self.rank = rank
        self.size = size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        host, port = split_addr(store_addr)
        # The TCPStore client connects to the store hosted by one member's leader; the
        # connect itself is bounded by the same timeout.
        self._store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout, use_libuv=True)
        store = dist.PrefixStore(prefix + "/", self._store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, size, self.timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")

    def allreduce_sum(self, tensors: list[torch.Tensor]) -> list[dist.Work]:
        works = []
        for t in tensors:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            opts.timeout = self.timeout
            works.append(self.pg.allreduce([t], opts))
        return works

    def wait(self, works: list[dist.Work]) -> None:
        for w in works:
            ok = w.wait(self.timeout)
            if ok is False:
                raise TimeoutError(f"cross-replica collective did not finish within {self.timeout.total_seconds()}s")
        if self.backend == "nccl" and self.device is not None:
            # Work.wait only makes the current stream wait; the vote needs the bytes.
            torch.cuda.current_stream(self.device).synchronize()

    def abort(self) -> None:
        """Best effort: free NCCL communicators stuck on a dead peer. Gloo has no abort."""
        if self.backend == "nccl":
            try:
                self.pg.abort()
            except Exception as e:  # already torn down: nothing left to free
                log.debug("abort of NCCL group failed: %s", e)
