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

Parameters that autograd never sees directly (FSDP2's sharded DTensor parameters, whose
gradients FSDP assigns after its reduce-scatter) get no hook; for such a model `covered`
is False and the trainer exchanges in `optimizer.step()` instead.
"""

from __future__ import annotations

from collections.abc import Callable

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

    def reset(self) -> None:
        """Forget a callback that never ran (a backward pass that raised before its end)."""
        self._queued = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, _param: torch.Tensor) -> None:
        if self._queued or not self._active():
            return
        self._queued = True
        Variable._execution_engine.queue_callback(self._requeue)

    def _requeue(self) -> None:
        Variable._execution_engine.queue_callback(self._fire)  # after DDP's finaliser (see above)

    def _fire(self) -> None:
        self._queued = False
        self._on_ready()
