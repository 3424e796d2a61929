"""How the cross-replica exchange hides behind backward when the replica has ranks of its own.

A replica of several processes reduces its gradients inside itself (DDP, FSDP2) and then
across replicas, as HSDP does. Each cross-replica all-reduce can start as soon as the
reduction inside the replica of its gradients is done, while backward goes on:

- **DDP** over every rank of the replica: the exchange reduces each of Transom's buckets
  inside the replica too (`ddp_exchange`, FTConfig.ddp_exchange): "wide", one all-reduce
  over every rank of every replica (the quorum's group is built that wide,
  ft/process_group.py), which sends what DDP over all the ranks would; or "slices", as
  HSDP: a reduce-scatter inside the replica, slice k across replicas by rank k, an
  all-gather inside the replica (`StepAllReduce`, ft/ftar.py), for networks whose links
  inside a replica are much faster than those between replicas. DDP's communication hook
  (`DDPReduced`) then reduces nothing: it tells `GradientsReady` (ft/backward.py) which
  gradients are final and moves the slices on.
  Transom's buckets are the same on every replica, whatever DDP's bucketing (which DDP
  rebuilds from the order of the first pass, so a joiner's differs for a step); they
  start from the thread running backward, in order, as soon as all their gradients are
  in; those not started by the end of the pass start then.
  DDP over part of the world (e.g. with tensor parallelism beside it) keeps DDP's own
  reduction in the hook (torch's `allreduce_hook`); each bucket is then exchanged whole
  once DDP averaged all its gradients.
  Either way the step's quorum is taken in DDP's first bucket, before anything leaves: the
  leader hands the answer to the other ranks in a collective of the replica (none under
  a lease), so every rank must take it at the same point of its sequence of collectives (one rank waiting
  there while another waits in DDP's finaliser for a bucket the first has not sent would
  never end).
- **FSDP2**: FSDP2's all-reduce hook, the mechanism made for HSDP, hands over each
  group's reduce-scattered shard as its reduce-scatter ends (`ShardsReduced`); the shard
  is averaged across replicas in place (`StepAllReduce.reduce_in_place`) before FSDP2
  divides it and makes the sharded gradients of it. Rank k of every replica holds shard
  k, so the exchange is shard-wise and keeps the replicas bit-identical. Every member
  reduces the same groups in the same order, as under HSDP: a module that one replica's
  data skips and another's does not would pair different shards (DDP's
  `find_unused_parameters` has the same limit).

Where neither applies (a comm hook the script registered itself, FSDP2 groups with a
per-parameter mesh, parameters that are neither), the exchange runs whole at the end of
the backward pass, as before. The commit vote and the fault handling do not change: a
failed peer fails the step's all-reduce, and the step does not commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from transom.ft.backward import GradientsReady
from transom.ft.step_values import QuorumOutcome

log = logging.getLogger("transom.ft")


class DDPReduced:
    """DDP's communication hook: the news of each bucket's gradients to `ready`, and with
    them the reduction inside the replica, or not (`sliced`: the exchange does it)."""

    def __init__(self, ddp: DistributedDataParallel, ready: GradientsReady,
                 open_step: Callable[[], QuorumOutcome | None], reduces: bool):
        """`open_step`: the part of the exchange before any gradient moves (the quorum);
        `reduces`: DDP averages inside the replica (else the exchange does)."""
        self.ready, self.open_step, self.reduces = ready, open_step, reduces
        self.group = ddp.process_group
        ddp.register_comm_hook(None, self._hook)

    # No annotations: DDP compares them with its own types, and this module's are strings.
    def _hook(self, _state, bucket):
        """One of DDP's buckets is ready (the thread running backward)."""
        if not self.ready.active():  # no exchange in this pass: DDP's own average, as without Transom
            return self._average(bucket, report=False)
        outcome = self.open_step()  # once per step; on every rank before its first bucket leaves (above)
        if self.reduces:
            self.ready.drain()  # buckets whose reduction ended start here
            return self._average(bucket, report=True)
        # The exchange reduces inside the replica too (wide, or in slices: ftar.StepAllReduce):
        # the gradients are final as they are, and DDP keeps them (torch's own no-op hook).
        self.ready.reduced(bucket.parameters(), bucket.gradients())
        self.ready.drain()
        if outcome is not None:
            outcome.ftar.advance()  # slices whose collective ended go on to their next one
        kept: torch.futures.Future = torch.futures.Future()
        kept.set_result(bucket.buffer())
        return kept

    def _average(self, bucket, report: bool):
        """DDP's default reduction (`allreduce_hook`) and, if `report`, the news once it is in."""
        params, grads = bucket.parameters(), bucket.gradients()
        buffer = bucket.buffer()
        buffer.div_(self.group.size())
        reduced = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            # Views of the bucket, which holds the replica's average once `fut` is waited for
            # (on a GPU the stream that reads them waits: `drain` does, on the training thread).
            if report:
                self.ready.reduced(params, grads, fut)
            return fut.value()[0]

        return reduced.then(done)


def ddp_exchange(model: torch.nn.Module, choice: str) -> str | None:
    """How the exchange reduces `model`'s gradients inside the replica too: `choice`
    (FTConfig.ddp_exchange, "wide" or "slices") where `model` is DDP over every rank of the
    replica's world of several ranks; None where DDP averages inside the replica itself."""
    if not isinstance(model, DistributedDataParallel) or not dist.is_initialized():
        return None
    if dist.get_world_size() < 2 or dist.get_world_size(model.process_group) != dist.get_world_size():
        return None  # DDP over part of the world (e.g. with tensor parallelism beside it)
    return choice


class ShardsReduced:
    """FSDP2's all-reduce hook on every FSDP module: each reduce-scattered shard to `on_shard`."""

    def __init__(self, modules: list[Any], on_shard: Callable[[torch.Tensor], None], active: Callable[[], bool]):
        self._on_shard, self._active = on_shard, active
        for m in modules:
            m.set_all_reduce_hook(self._hook)

    def _hook(self, shard: torch.Tensor) -> None:
        if self._active():  # not under trainer.no_sync() (FSDP2 reduces nothing then anyway)
            self._on_shard(shard)


def fsdp_modules(model: torch.nn.Module) -> list[Any] | None:
    """The FSDP2 modules whose all-reduce hook can carry every gradient of `model`, or None:
    every parameter that takes a gradient is an FSDP2 one (a DTensor under an FSDP module)
    and every FSDP module has one parameter group."""
    modules: list[Any] = [m for m in model.modules() if callable(getattr(m, "set_all_reduce_hook", None))]
    if not modules:
        return None
    managed: set[int] = set()
    for m in modules:
        state = m._get_fsdp_state()  # torch's FSDPModule API: its groups hold its parameters
        groups = list(getattr(state, "_fsdp_param_groups", None) or [])
        if len(groups) > 1:
            return None
        for group in groups:
            managed.update(id(fp.sharded_param) for fp in group.fsdp_params)
    params = [p for p in model.parameters() if p.requires_grad]
    return modules if params and all(id(p) in managed for p in params) else None


def attach(model: torch.nn.Module, ready: GradientsReady, buckets: list, on_bucket: Callable[[int], None],
           on_shard: Callable[[torch.Tensor], None], open_step: Callable[[], QuorumOutcome | None],
           ddp_how: str | None) -> str:
    """Overlap the exchange with backward as `model` allows; returns how (for the log):
    "buckets" (no reduction inside the replica), "ddp wide" or "ddp slices" (`ddp_how`, from
    `ddp_exchange`: the exchange reduces inside the replica too), "ddp", "fsdp", or "end"."""
    if isinstance(model, DistributedDataParallel):
        try:
            DDPReduced(model, ready, open_step, reduces=ddp_how is None)
        except RuntimeError as e:  # the script registered a hook of its own: DDP takes one
            log.warning("DDP already has a communication hook (%s): the exchange waits for the end of backward", e)
            return "end"
        ready.track(buckets, on_bucket, by_accumulation=False)
        return f"ddp {ddp_how}" if ddp_how else "ddp"
    if ready.covered:
        ready.track(buckets, on_bucket)
        return "buckets"
    modules = fsdp_modules(model)
    if modules is None:
        return "end"
    return "fsdp" if _hooked(modules, on_shard, ready.active) else "end"


def _hooked(modules: list[Any], on_shard: Callable[[torch.Tensor], None], active: Callable[[], bool]) -> bool:
    try:
        ShardsReduced(modules, on_shard, active)
    except ValueError as e:  # e.g. native HSDP given a stream; fall back for every module
        for m in modules:
            m.set_all_reduce_hook(None)
        log.warning("FSDP2's all-reduce hook cannot be set (%s): the exchange waits for the end of backward", e)
        return False
    return True
