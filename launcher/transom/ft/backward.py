"""`GradientsReady`: run a callback once at the end of every backward pass through a model.

The cross-replica exchange must see the replica's final gradients and must be done before
the script touches them (gradient clipping, `GradScaler.unscale_`), which happens between
`loss.backward()` and `optimizer.step()`. So the exchange runs at the end of the backward
pass, the way DDP finalises its reduction: the first parameter whose gradient is
accumulated queues an autograd engine callback, which runs once the whole graph is done.

The callback queues itself a second time before it fires. DDP queues its own finaliser
(the wait for its in-replica all-reduce) only when its last bucket is ready, later than
our first hook; engine callbacks run in the order queued, and one queued from inside a
callback runs after all those queued before it. Firing from the second queueing therefore
sees gradients DDP has finished averaging inside the replica.

With `track`, it also reports each bucket of gradients as soon as all of its gradients are
accumulated, so the cross-replica exchange of that bucket starts while backward goes on
(ft/ftar.py). That is right only where the accumulated gradient is the replica's final
one: a model without DDP inside the replica (DDP reduces after our hook runs; there the
exchange waits for the end of the pass).

Parameters that autograd never sees directly (FSDP2's sharded DTensor parameters, whose
gradients FSDP assigns after its reduce-scatter) get no hook; for such a model `covered`
is False and the trainer exchanges in `optimizer.step()` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd import Variable


def _is_plain_leaf(p: torch.Tensor) -> bool:
    return p.requires_grad and type(p.data) is torch.Tensor  # not a DTensor or another subclass


class GradientsReady:
    def __init__(self, model: torch.nn.Module, on_ready: Callable[[], None], active: Callable[[], bool]):
        """`on_ready()` runs at the end of each backward pass through `model` while `active()`."""
        self._on_ready, self._active = on_ready, active
        params = [p for p in model.parameters() if p.requires_grad]
        self.covered = bool(params) and all(_is_plain_leaf(p) for p in params)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params] if self.covered else []
        self._queued = False
        self._buckets: Sequence[Sequence[torch.Tensor]] = []
        self._bucket_of: dict[int, int] = {}
        self._on_bucket: Callable[[int], None] | None = None
        self._waiting: list[int] = []  # per bucket: gradients not accumulated yet this pass
        self.started = 0  # buckets handed to on_bucket this pass, in order

    def track(self, buckets: Sequence[Sequence[torch.Tensor]], on_bucket: Callable[[int], None]) -> None:
        """Also call `on_bucket(i)` once every gradient of `buckets[i]` is accumulated, in
        bucket order (a bucket ready early waits for those before it: every replica must
        start its collectives in the same order)."""
        self._buckets, self._on_bucket = buckets, on_bucket
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
        self.reset()

    def reset(self) -> None:
        """A new step: forget a callback that never ran and the buckets of the last pass."""
        self._queued = False
        self._waiting = [len(b) for b in self._buckets]
        self.started = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, param: torch.Tensor) -> None:
        if not self._active():
            return
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._requeue)
        i = self._bucket_of.get(id(param))
        if i is None or self._on_bucket is None:
            return
        self._waiting[i] -= 1
        while self.started < len(self._buckets) and self._waiting[self.started] <= 0:
            self.started += 1
            self._on_bucket(self.started - 1)

    def _requeue(self) -> None:
        Variable._execution_engine.queue_callback(self._fire)  # after DDP's finaliser (see above)

    def _fire(self) -> None:
        self._queued = False
        self._on_ready()
