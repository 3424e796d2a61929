"""Cross-replica process groups, built directly for each quorum.

A group is built from the quorum's store endpoint and a prefix the coordinator never
reuses, so a new quorum never meets a stale key (a reused prefix hangs). We construct the
backend's ProcessGroup class ourselves instead of going through init_process_group: the
replica's own torch.distributed world (DDP/FSDP inside the replica) stays untouched, and a
failed group can be dropped without tearing anything else down.

The backend follows from where the gradients are and whether the members share GPUs
(backend.py): before the backend's group is made, every member puts its device into the
group's store and reads everyone's, so all of them decide alike.

Gloo cannot abort an op in flight; its per-op timeout bounds every wait. But a member that
leaves a group (its step failed, or it steps aside) closes it: the Gloo backend and its
connections go as soon as no Work of it is left, and a peer waiting in a collective of that
group fails at once ("Connection closed by peer") instead of at the timeout. That is what
lets the members of a quorum lease (coordinator/lease.py) leave a leased step together. NCCL
ops are asynchronous on the GPU, so a wait past the deadline aborts the communicator, which
is the only way to free the stream of a collective whose peer died.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from transom import compat
from transom.cuda_wait import wait_for
from transom.ft import backend as placement
from transom.ft.replica import holding

log = logging.getLogger("transom.ft")


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):
        raise ValueError(f"store address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


class CrossReplicaGroup:
    """One cross-replica group: rank `rank` of `size` replicas, for one shard index."""

    def __init__(
        self,
        choice: str,
        store_addr: str,
        prefix: str,
        rank: int,
        size: int,
        timeout_s: float,
        device: torch.device | None = None,
    ):
        self.rank = rank
        self.size = size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        host, port = split_addr(store_addr)
        # The TCPStore client connects to the store hosted by one member's leader; the
        # connect itself is bounded by the same timeout.
        tcp = dist.TCPStore(host, port, is_master=False, timeout=self.timeout, use_libuv=True)
        self._store: dist.TCPStore | None = tcp
        store = dist.PrefixStore(prefix + "/", tcp)
        self.backend = backend = self._decide(store, choice)
        self.pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, size, self.timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")

    def _decide(self, store: dist.Store, choice: str) -> str:
        """The backend every member picks for `choice`, given every member's device."""
        if choice == "gloo":
            return "gloo"
        mine = self.device if self.device is not None else torch.device("cpu")
        gpu = compat.gpu_id(mine.index if mine.index is not None else torch.cuda.current_device()) \
            if mine.type == "cuda" else ""
        store.set(f"device/{self.rank}", f"{mine.type}|{gpu}")
        seen = [store.get(f"device/{r}").decode().split("|", 1) for r in range(self.size)]
        kinds = {kind for kind, _ in seen}
        tensor_device = ("cuda" if kinds == {"cuda"} else "cpu" if kinds == {"cpu"}
                         else "mixed (" + ", ".join(sorted(kinds)) + ")")
        return placement.cross_replica(choice, tensor_device=tensor_device, member_gpus=[g or None for _, g in seen])

    def allreduce_sum(self, tensors: list[torch.Tensor]) -> list[dist.Work]:
        if self.pg is None:
            raise RuntimeError("the cross-replica group was closed")
        works = []
        for t in tensors:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            opts.timeout = self.timeout
            # Gloo and NCCL backends implement allreduce; torch's stubs declare it on ProcessGroup only.
            works.append(self.pg.allreduce([t], opts))  # type: ignore[union-attr]
        return works

    def wait(self, works: list[dist.Work]) -> None:
        for w in works:
            ok = w.wait(self.timeout)
            if ok is False:
                raise TimeoutError(f"cross-replica collective did not finish within {self.timeout.total_seconds()}s")
        if self.backend == "nccl" and self.device is not None:
            # Work.wait only makes the current stream wait; the vote needs the bytes.
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            wait_for(done, self.timeout.total_seconds(), "cross-replica collective")

    def wait_on_stream(self, works: list[dist.Work]) -> None:
        """What reads the result next on the current stream sees it: under NCCL the stream
        waits and the CPU goes on (`wait` later checks the collective completed in time);
        under Gloo the CPU waits, bounded by the group's timeout."""
        if self.backend != "nccl":
            self.wait(works)
            return
        for w in works:
            w.wait()  # no timeout given: only the current stream waits (a timeout would block the CPU)

    def close(self) -> None:
        """Leave the group: NCCL's communicators are aborted (best effort: free those stuck on
        a dead peer), and the backend is dropped, so that its connections close once no Work
        of it is left (a Work holds Gloo's connections: whoever holds one keeps them open)."""
        pg, self.pg = self.pg, None
        if self.backend == "nccl" and pg is not None:
            try:
                pg.abort()
            except Exception as e:  # already torn down: nothing left to free
                log.debug("abort of NCCL group failed: %s", e)
        self._store = None


class ReplicaSlices:
    """The two groups inside a replica of several ranks that the sliced exchange uses
    (ft/sliced.py): one for the reduce-scatters, one for the all-gathers. Each keeps its
    own order of collectives, the same on every rank, whatever order the two kinds
    interleave in on each rank. Made once, by every rank of the replica's world together."""

    def __init__(self, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout = timeout
        self.scatter_group = holding(dist.new_group(timeout=timeout))
        self.gather_group = holding(dist.new_group(timeout=timeout))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def scatter(self, out: torch.Tensor, flat: torch.Tensor) -> list[dist.Work]:
        """Slice `rank` of the replica's sum of `flat` into `out` (asynchronous)."""
        work = dist.reduce_scatter_tensor(out, flat, group=self.scatter_group, async_op=True)
        assert work is not None  # async_op: always a Work
        return [work]

    def gather(self, flat: torch.Tensor, part: torch.Tensor) -> list[dist.Work]:
        """Every rank's `part`, in rank order, into `flat` (asynchronous)."""
        work = dist.all_gather_into_tensor(flat, part, group=self.gather_group, async_op=True)
        assert work is not None
        return [work]

    def wait(self, works: list[dist.Work]) -> None:
        for w in works:
            if w.wait(self.timeout) is False:
                raise TimeoutError(f"a collective inside the replica did not finish within "
                                   f"{self.timeout.total_seconds()}s")


class QuorumGroups:
    """The group of the current quorum, for one rank: rebuilt when the quorum changes (a new
    store prefix), dropped after a failed exchange; a dropped group is never reused, even for
    the same quorum."""

    def __init__(self, backend: str, shard: int, timeout_s: float, device: torch.device,
                 slices: ReplicaSlices | None = None, width: int = 1):
        """Under DDP inside the replica (ft/inner_reduction.py): `slices`, the replica's own
        groups where buckets are exchanged in slices; `width` > 1, the replica's ranks, where
        one group holds every rank of every member (rank `shard` of member m is m * width +
        shard) and the exchange reduces inside the replicas too."""
        self.backend, self.shard, self.timeout_s, self.device = backend, shard, timeout_s, device
        self.slices, self.width = slices, width
        self.group: CrossReplicaGroup | None = None
        self._prefix = ""
        self._left = ""  # the prefix of the group dropped last: its store keys are spent

    def changed(self, store_prefix: str) -> bool:
        return store_prefix != self._prefix

    def rebuild(self, store_addr: str, store_prefix: str, rank: int, size: int, quorum_id: int) -> str | None:
        """The group of a new quorum; an error message if it could not be built (the step
        fails and runs again under the next quorum)."""
        self.drop()
        if store_prefix == self._left:
            # Built again on the same keys it would meet the peers' stale addresses and hang;
            # failing the step makes the next round name a new quorum.
            return f"the group of quorum {quorum_id} was left here and cannot be built again"
        self._prefix = store_prefix
        name = f"{store_prefix}/shard{self.shard}"
        if self.width > 1:
            name, rank, size = f"{store_prefix}/wide", rank * self.width + self.shard, size * self.width
        try:
            self.group = CrossReplicaGroup(self.backend, store_addr, name, rank, size, self.timeout_s, self.device)
        except placement.BackendError:
            raise  # a configuration that cannot work: no retry makes it work
        except Exception as e:
            return f"building the group of quorum {quorum_id}: {e}"
        return None

    def drop(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
            self._left = self._prefix
        self._prefix = ""

