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
final, so the cross-replica exchange of that bucket starts while backward goes on
(ft/ftar.py). Without DDP inside the replica a gradient is final once accumulated. Under
DDP it is final once DDP's communication hook (ft/inner_reduction.py) saw its bucket, or
once DDP averaged that bucket inside the replica where the exchange leaves that to DDP:
the hook says so through `reduced`, from whichever thread completed the reduction, and
the training thread takes that news at its next hook or at the end of the pass (`drain`),
so every bucket starts from the training thread, in bucket order.

Parameters that autograd never sees directly (FSDP2's sharded DTensor parameters, whose
gradients FSDP assigns after its reduce-scatter) get no hook; for such a model `covered`
is False, and the pass is seen instead through a hook on the gradient of the model's
output, the first gradient of the pass. FSDP2 queues its own end-of-backward callback
(`_root_post_backward_final_callback`, which waits for the reduce-scatters and sets the
sharded gradients) from its hook on that same output; firing from our second queueing
runs after it, so under FSDP2 too the exchange is done when `backward()` returns and
clipping after it sees the replicas' average. FSDP2's shards are exchanged by its own
all-reduce hook as each group's reduce-scatter ends (ft/inner_reduction.py); only where
that hook cannot be set are they exchanged whole at the end.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch
from torch.autograd import Variable


def _is_plain_leaf(p: torch.Tensor) -> bool:
    return p.requires_grad and type(p.data) is torch.Tensor  # not a DTensor or another subclass


def _first_grad_tensor(output: object) -> torch.Tensor | None:
    """The first tensor that requires grad in a model's output (a tensor, or a tuple, list or
    dict of outputs, nested)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for item in items:
        found = _first_grad_tensor(item)
        if found is not None:
            return found
    return None


class GradientsReady:
    def __init__(self, model: torch.nn.Module, on_ready: Callable[[], None], active: Callable[[], bool]):
        """`on_ready()` runs at the end of each backward pass through `model` while `active()`."""
        self._on_ready, self._active = on_ready, active
        params = [p for p in model.parameters() if p.requires_grad]
        self.covered = bool(params) and all(_is_plain_leaf(p) for p in params)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params] if self.covered else []
        if params and not self.covered:  # sharded parameters: watch the output's gradient instead
            self._handles.append(model.register_forward_hook(self._watch_output))
        self._queued = False
        self._buckets: Sequence[Sequence[torch.Tensor]] = []
        self._bucket_of: dict[int, int] = {}
        self._on_bucket: Callable[[int], None] | None = None
        self._waiting: list[int] = []  # per bucket: gradients not final yet this pass
        self.started = 0  # buckets handed to on_bucket this pass, in order
        self._by_accumulation = True  # a gradient is final once accumulated (no DDP inside)
        self._reduced: collections.deque = collections.deque()  # DDP's news, from any thread
        self._final: dict[int, torch.Tensor] = {}  # under DDP: the gradient averaged inside the replica

    def track(self, buckets: Sequence[Sequence[torch.Tensor]], on_bucket: Callable[[int], None],
              by_accumulation: bool = True) -> None:
        """Also call `on_bucket(i)` once every gradient of `buckets[i]` is final, in bucket
        order (a bucket ready early waits for those before it: every replica must start its
        collectives in the same order). `by_accumulation` False: final when `reduced` says so."""
        self._buckets, self._on_bucket, self._by_accumulation = buckets, on_bucket, by_accumulation
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
        self.reset()

    def reset(self) -> None:
        """A new step: forget a callback that never ran and the buckets of the last pass."""
        self._queued = False
        self._waiting = [len(b) for b in self._buckets]
        self.started = 0
        self._reduced.clear()
        self._final.clear()

    def active(self) -> bool:
        """Whether this backward pass ends with the exchange (not under no_sync, inside a step)."""
        return self._active()

    def reduced(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                done: torch.futures.Future | None = None) -> None:
        """`grads` (of `params`) are averaged inside the replica, once `done` is waited for
        (a CUDA future: the reading stream waits); any thread may say so."""
        self._reduced.append((params, grads, done))

    def final_grads(self, index: int) -> list[torch.Tensor] | None:
        """Under DDP: the gradients of bucket `index` as DDP averaged them inside the replica
        (it writes the parameters' own only at the end of the pass); None otherwise."""
        if self._by_accumulation:
            return None
        return [self._final[id(p)] for p in self._buckets[index]]

    def drain(self) -> None:
        """Count the gradients `reduced` reported (on the training thread: buckets start here).
        Outside an exchanging pass (after the trainer closed, DDP's hook still reduces) the
        news is dropped."""
        if not self._active():
            self._reduced.clear()
            return
        while self._reduced:
            params, grads, done = self._reduced.popleft()
            if done is not None:
                done.wait()  # complete already; on a GPU this orders the current stream after it
            for p, g in zip(params, grads):
                if id(p) in self._bucket_of:
                    self._final[id(p)] = g
                    self._count(id(p))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _watch_output(self, _module, _args, output) -> None:
        """A forward pass that backward will go through: hook the first output tensor's gradient."""
        if not torch.is_grad_enabled():
            return
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(self._output_grad)

    def _output_grad(self, grad: torch.Tensor) -> None:
        self._hook(grad)  # the pass started: queue the end-of-pass callback (no buckets here)

    def _hook(self, param: torch.Tensor) -> None:
        if not self._queued:  # the pass's first hook: whether it exchanges holds for the whole pass
            if not self._active():
                return
            self._queued = True
            Variable._execution_engine.queue_callback(self._requeue)
        if self._by_accumulation:
            self._count(id(param))
        else:
            self.drain()

    def _count(self, key: int) -> None:
        i = self._bucket_of.get(key)
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
        if not self._by_accumulation:
            self.drain()  # DDP's finaliser waited for every bucket: all reported by now
        self._on_ready()
