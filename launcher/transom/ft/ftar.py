"""Fault-tolerant all-reduce (FTAR) of gradients across replicas for one step.

Gradients are packed into flat buckets (one per dtype and device, capped in size), summed
across the quorum's members and divided by the number of *participants*: a recovering
replica sends zeros and is not counted, so it changes nothing in the average. Under
Rebalance (replicas with batches of different sizes, transom/detect/rebalance.py) each
contributor scales its gradients by its share of the step's samples instead, and the sum
is the average. Each bucket
is started as soon as its gradients are ready (`start`, asynchronous; the trainer calls it
from the backward pass, ft/backward.py) and `finish` waits for them all, so the exchange
overlaps the rest of the backward pass as DDP's does.

With DDP or FSDP2 inside the replica, the gradients are reduced inside the replica too
(ft/inner_reduction.py): under DDP a bucket is started from DDP's own buckets
(`start(..., grads=)`), in one group over every rank of every replica, in slices
(ft/sliced_ftar.py), or averaged inside the replica by DDP; under FSDP2 each reduce-scattered shard is
summed across replicas in place by FSDP2's all-reduce hook (`reduce_in_place`), which
returns once the shard holds the average on the stream FSDP2 reads it from. The guard's
flags then travel on their own at `finish`.

The error model is one flag per step (as in torchft): the first error or timeout marks
the step failed, drops the group (every reference, at once: that is what makes the other
survivors fail fast too) and turns later collectives of the step into no-ops. The Manager
reads the flag in its commit vote.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Literal

import torch

from transom.collective_counts import COUNTER
from transom.ft.process_group import CrossReplicaGroup

log = logging.getLogger("transom.ft")
DEFAULT_BUCKET_BYTES = 25 << 20  # as DDP: several buckets, so the first can leave early
# As DDP's first bucket: the last layers' gradients, ready first, leave as soon as they
# are, without waiting for 25 MiB more (on a small model, the whole model).
FIRST_BUCKET_BYTES = 1 << 20
NUM_FLAGS = 2  # the step guard's, at the end of the last bucket (ft/guard.py: BAD, LATE)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 gradients), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def plan_buckets(grads: list[torch.Tensor], bucket_bytes: int,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Group gradient indices into buckets of one dtype/device; a bucket is closed once it holds
    `bucket_bytes` (the first of each kind `first_bucket_bytes`), as DDP's are: the tensor
    that reaches the cap goes in. So the first bucket holds at least the gradients of the last
    layer, which leave while backward goes on, rather than only the small bias before it."""
    buckets: list[list[int]] = []
    open_by_kind: dict[tuple, tuple[list[int], int]] = {}  # kind -> (its open bucket, its bytes)
    caps: dict[tuple, int] = {}  # kind -> the cap of its next bucket
    for i, g in enumerate(grads):
        kind = (g.dtype, g.device)
        current = open_by_kind.get(kind)
        if current is None:
            current = ([], 0)
            buckets.append(current[0])
        cap = caps.setdefault(kind, min(first_bucket_bytes, bucket_bytes))
        current[0].append(i)
        size = current[1] + g.numel() * g.element_size()
        if size >= cap:
            open_by_kind.pop(kind, None)
            caps[kind] = bucket_bytes
        else:
            open_by_kind[kind] = (current[0], size)
    return buckets


class FlatBuffers:
    """The flat tensors buckets are packed into, kept from one step to the next. A fresh
    tensor every step costs a page fault at the first write to each of its pages on the CPU
    (for a 100 MB model, more than the copy into it); a kept one costs the copy alone."""

    def __init__(self) -> None:
        self._kept: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer `key` of `numel` elements of `like`'s dtype and device (contents undefined)."""
        kept = self._kept.get(key)
        if kept is None or kept.numel() != numel or kept.dtype != like.dtype or kept.device != like.device:
            kept = self._kept[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return kept

    def drop(self) -> None:
        """Forget every buffer: after a failed step a collective that never completed may
        still write into its tensor (Gloo cannot abort one), so the next step takes new ones."""
        self._kept = {}


@dataclasses.dataclass
class Started:
    """One exchange of a step: a bucket (its average goes into `params`' gradients), a
    shard reduced in place (FSDP2), the guard's flags on their own, or a bucket exchanged in
    slices (`sliced`: ft/sliced_ftar.py)."""

    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    kind: Literal["bucket", "shard", "flags", "sliced"]
    works: list = dataclasses.field(default_factory=list)
    part: torch.Tensor | None = None  # sliced: this rank's slice of `flat`, then the flags if any
    stage: int = 0  # sliced: the collectives issued so far (1: scatter, 2: across replicas, 3: gather)


class StepAllReduce:
    """FTAR state for one attempt of one step."""

    def __init__(self, group: CrossReplicaGroup | None, participants: int, contribute: bool,
                 own: Callable[[torch.Tensor], None] | None = None, weight: float | None = None,
                 flags: Callable[[torch.Tensor], torch.Tensor] | None = None, buffers: FlatBuffers | None = None):
        """`own`: shown each bucket of this replica's own gradients before the exchange
        (ft/guard.py keeps their norm). `weight`: this replica's fraction of the step's
        samples (every member gives one, or none does): the sum is then the average.
        `flags(like)`: the step guard's NUM_FLAGS counts (ft/guard.py), asked for when the
        last bucket starts; they ride at its end and are summed over the members with it
        (`flag_sums`), so that agreeing on them costs no collective of its own. `buffers`:
        where buckets are packed, kept across steps by the caller (default: this step's own)."""
        if participants < 1:
            raise ValueError("a step needs at least one participant")
        if weight is not None and not 0.0 <= weight <= 1.0:
            raise ValueError(f"a replica's weight is a fraction of the step's samples, got {weight}")
        self.group = group
        self.participants = participants
        self.contribute = contribute
        self.weight = weight
        self.own = own
        self.flags = flags
        self.flag_sums: torch.Tensor | None = None  # after `finish`: the members' flags, summed
        self.error: str | None = None if group is not None else "no cross-replica group"
        self._pending: list[Started] = []
        self._flags_sent = False
        self.buffers = buffers if buffers is not None else FlatBuffers()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
            log.warning("cross-replica step failed: %s", reason)
        if self.group is not None:
            self.group.close()
        self.group = None

    def start(self, params: list[torch.nn.Parameter], last: bool = False,
              grads: list[torch.Tensor] | None = None) -> None:
        """Begin the all-reduce of one bucket of gradients (asynchronous); `finish` completes it
        and writes the average into the parameters' gradients. Buckets must be started in the
        same order on every member (the collectives pair up by order); `last`: the step's last
        bucket, which carries the flags. `grads`: what to send instead of the parameters'
        gradients (DDP's bucket as its hook saw it, before DDP wrote the gradients)."""
        if self.failed:
            return
        grads = self._grads(params, grads)
        n = sum(g.numel() for g in grads)
        slots = NUM_FLAGS if last and self.flags is not None else 0
        flat = self.buffers.get(("bucket", id(params[0]) if params else 0), n + slots, grads[0])
        if self.contribute:
            torch.cat([g.reshape(-1) for g in grads], out=flat[:n])
            if self.own is not None:
                self.own(flat[:n])
            if self.weight is not None and self.weight != 1.0:
                flat[:n].mul_(self.weight)
            if slots:
                assert self.flags is not None
                flat[n:].copy_(self.flags(flat))
        else:  # a member catching up sends zeros, flags included: it cannot make anyone skip
            flat.zero_()
        self._flags_sent = self._flags_sent or bool(slots)
        self._send(Started(params, flat, "bucket"))

    @staticmethod
    def _grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """`grads`, or the parameters' own gradients (zeros for a parameter unused this step, as DDP sends)."""
        if grads is not None:
            return grads
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [local_shard(p.grad) for p in params]  # type: ignore[arg-type]

    def advance(self) -> None:
        """Move on whatever waits for a collective to end (the exchange in slices does)."""

    def reduce_in_place(self, shard: torch.Tensor) -> None:
        """Sum `shard` (a reduce-scattered gradient shard, FSDP2's all-reduce hook) across the
        members in place and divide it by the participants (or sum weighted shares). On
        return the average is there for whatever reads `shard` next on the current stream:
        on the CPU the collective is waited for, on a GPU under NCCL the stream waits and the
        CPU goes on (`finish` checks that it completed). A failed step leaves it this
        replica's own: the step does not commit."""
        if self.failed:
            return
        if not self.contribute:
            shard.zero_()  # a member catching up adds nothing
        else:
            if self.own is not None:
                self.own(shard.reshape(-1))
            if self.weight is not None and self.weight != 1.0:
                shard.mul_(self.weight)
        if not self._send(Started([], shard, "shard")):
            return
        try:
            assert self.group is not None
            self.group.wait_on_stream(self._pending[-1].works)
        except Exception as e:  # RuntimeError from Gloo, TimeoutError from our wait
            self.fail(f"{type(e).__name__}: {e}")
            return
        if self.weight is None:
            shard.div_(self.participants)

    def _send(self, started: Started) -> bool:
        """Start the all-reduce of `started.flat`; False if the step failed."""
        try:
            # No local alias of the group: fail() must drop the only reference at once.
            assert self.group is not None
            COUNTER.ftar_entered()  # a hang names the member that never entered it (detect/hangs.py)
            started.works = self.group.allreduce_sum([started.flat])
            self._pending.append(started)
        except Exception as e:  # RuntimeError from Gloo/NCCL
            self.fail(f"{type(e).__name__}: {e}")
            return False
        return True

    def _send_flags(self) -> None:
        """The guard's flags on their own, where no bucket carried them (shards reduced in place)."""
        if self.flags is None or self._flags_sent or self.failed:
            return
        like = self._pending[-1].flat if self._pending else torch.zeros(1)  # the last tensor exchanged
        flat = self.flags(like).to(device=like.device, dtype=like.dtype) if self.contribute else \
            torch.zeros(NUM_FLAGS, dtype=like.dtype, device=like.device)
        self._flags_sent = True
        self._send(Started([], flat, "flags"))

    def finish(self) -> None:
        """Wait for every bucket started, then write the average back into the gradients."""
        self._send_flags()
        pending, self._pending = self._pending, []
        if self.failed:
            return
        try:
            assert self.group is not None
            for started in pending:
                self.group.wait(started.works)
                COUNTER.ftar_completed()
        except Exception as e:  # RuntimeError from Gloo/NCCL, TimeoutError from our wait
            self.fail(f"{type(e).__name__}: {e}")
            return
        for started in pending:
            if started.kind == "flags":
                self.flag_sums = started.flat
            elif started.kind == "bucket":
                self._write_back(started)

    def _write_back(self, started: Started) -> None:
        """The average of a bucket into its parameters' gradients."""
        grads, flat = self._grads(started.params, None), started.flat
        if flat.numel() > sum(g.numel() for g in grads):  # the last bucket: its flags
            self.flag_sums = flat[-NUM_FLAGS:]
        offset = 0
        for g in grads:
            n = g.numel()
            summed = flat[offset : offset + n].view_as(g)
            if self.weight is None:  # the division and the copy back in one pass
                torch.div(summed, self.participants, out=g)
            else:
                g.copy_(summed)
            offset += n

    def agree(self, bad: bool, device: torch.device) -> bool:
        """Whether any member found its step `bad` (one 1-element all-reduce, after `finish`);
        False with the step failed if the collective fails."""
        if self.failed:
            return False
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        try:
            assert self.group is not None
            COUNTER.ftar_entered()
            self.group.wait(self.group.allreduce_sum([flag]))
            COUNTER.ftar_completed()
        except Exception as e:
            self.fail(f"{type(e).__name__}: {e}")
            return False
        return bool(flag.item() > 0)

    def allreduce_gradients(self, params: Iterable[torch.nn.Parameter],
                            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Average the gradients of `params` over the participants (or by weight), in place, all at once."""
        plist = [p for p in params if p.requires_grad]
        for bucket in bucket_params(plist, bucket_bytes):
            self.start(bucket)
        self.finish()


def bucket_params(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """`params` (those that take gradients) in buckets of one dtype/device and at most
    `bucket_bytes`, sized by what each rank holds (a DTensor's local shard)."""
    plist = [p for p in params if p.requires_grad]
    return [[plist[i] for i in idx] for idx in plan_buckets([local_shard(p) for p in plist], bucket_bytes)]
