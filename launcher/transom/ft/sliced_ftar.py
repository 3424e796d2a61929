"""The exchange of each bucket in slices, as HSDP does it: DDP over a replica of several ranks.

`ddp_exchange="slices"` (ft/config.py; ft/inner_reduction.py says when it applies). A
reduce-scatter inside the replica gives each rank the replica's sum of one slice of the
bucket; rank k of every replica all-reduces slice k across replicas (over the quorum's group
of shard k, ft/process_group.py), the guard's flags at the end of the last bucket's slice;
an all-gather inside the replica hands every rank every averaged slice. Each rank sends 1.5x
the bucket, as one all-reduce over all the ranks would, and the traffic between replicas is
a slice per rank: the shape for links inside a replica much faster than those between
replicas.

Each group sees the buckets in the same order on every member: the reduce-scatters and the
all-gathers have a group each (ft/process_group.py `ReplicaSlices`), and a bucket moves to
its next collective only after the bucket before it did (`advance`, called from DDP's hook
as backward goes on, and at `finish`). A failed exchange across replicas fails the step, but
the collectives inside the replica all still run: another rank of the replica may have had
its slice exchanged, and waits in the gather for this one's.
"""

from __future__ import annotations

from typing import Any

import torch

from transom.collective_counts import COUNTER
from transom.ft.ftar import NUM_FLAGS, Started, StepAllReduce
from transom.ft.process_group import ReplicaSlices


class SlicedAllReduce(StepAllReduce):
    """`StepAllReduce` with every bucket in three collectives (`slices`: the replica's groups)."""

    def __init__(self, slices: ReplicaSlices, *args: Any, **kwargs: Any):
        """`slices`; the rest as `StepAllReduce`'s."""
        super().__init__(*args, **kwargs)
        self.slices = slices

    def start(self, params: list[torch.nn.Parameter], last: bool = False,
              grads: list[torch.Tensor] | None = None) -> None:
        """Begin one bucket's reduce-scatter inside the replica (asynchronous); its other
        collectives follow in `advance`. A failed step still takes it (above)."""
        grads = self._grads(params, grads)
        slots = NUM_FLAGS if last and self.flags is not None else 0
        n, size = sum(g.numel() for g in grads), self.slices.size
        chunk = -(-n // size)
        key = id(params[0]) if params else 0
        flat = self.buffers.get(("sliced", key), chunk * size, grads[0])
        if self.contribute:  # a member catching up sends zeros
            torch.cat([g.reshape(-1) for g in grads], out=flat[:n])
            flat[n:].zero_()  # the padding
        else:
            flat.zero_()
        part = self.buffers.get(("part", key), chunk + slots, grads[0])
        part[chunk:].zero_()  # the flags' slots, where a member catching up leaves zeros
        started = Started(params, flat, "sliced", part=part, stage=1)
        started.works = self.slices.scatter(part[:chunk], flat)
        self._flags_sent = self._flags_sent or bool(slots)
        self._pending.append(started)
        self.advance()

    def advance(self, block: bool = False) -> None:
        """Issue each sliced bucket's next collectives whose inputs are in (all of them if
        `block`), in bucket order for each kind; a no-op for the other kinds."""
        ahead = 3  # the stage of the bucket before: none can overtake it
        for started in self._pending:
            if started.kind != "sliced":
                continue
            while started.stage < ahead and (block or all(w.is_completed() for w in started.works)):
                self._next_collective(started)
            ahead = started.stage

    def _next_collective(self, started: Started) -> None:
        assert started.part is not None
        chunk = started.flat.numel() // self.slices.size
        mine = started.part[:chunk]
        if started.stage == 1:  # the replica's sum of this slice is in: across replicas with it
            self.slices.wait(started.works)
            mine.div_(self.slices.size)
            if self.contribute:
                self._own_slice(started.part, chunk)
            started.works = [] if self.failed else self._cross(started.part)
        else:  # across replicas (or failed): every rank of the replica gathers the slices
            if started.works and self._waited(started.works) and self.weight is None:
                mine.div_(self.participants)
            started.works = self.slices.gather(started.flat, mine)
        started.stage += 1

    def _own_slice(self, part: torch.Tensor, chunk: int) -> None:
        """A contributor's slice before it leaves: the guard sees it, weighted, the flags behind."""
        if self.own is not None:
            self.own(part[:chunk])
        if self.weight is not None and self.weight != 1.0:
            part[:chunk].mul_(self.weight)
        if part.numel() > chunk and self.flags is not None:
            part[chunk:].copy_(self.flags(part))

    def _cross(self, part: torch.Tensor) -> list:
        try:
            assert self.group is not None
            COUNTER.ftar_entered()
            return self.group.allreduce_sum([part])
        except Exception as e:  # RuntimeError from Gloo/NCCL
            self.fail(f"{type(e).__name__}: {e}")
            return []

    def _waited(self, works: list) -> bool:
        try:
            assert self.group is not None
            self.group.wait(works)
            COUNTER.ftar_completed()
        except Exception as e:  # RuntimeError from Gloo/NCCL, TimeoutError from our wait
            self.fail(f"{type(e).__name__}: {e}")
            return False
        return True

    def finish(self) -> None:
        """Every bucket through its three collectives, then the averages into the gradients."""
        pending = self._pending
        try:
            self.advance(block=True)
            for started in pending:
                self.slices.wait(started.works)
        except Exception as e:  # a rank of this replica is gone (its launcher restarts the replica)
            self.fail(f"inside the replica: {type(e).__name__}: {e}")
        self._pending = []
        if self.failed:
            return
        for started in pending:
            assert started.part is not None
            chunk = started.flat.numel() // self.slices.size
            if started.part.numel() > chunk:
                self.flag_sums = started.part[chunk:]
            offset = 0
            for g in self._grads(started.params, None):  # zeros for a parameter unused this step
                g.copy_(started.flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
