"""A rank's digest of the input it trains on: the evidence that replicas train on distinct data.

A script whose batches are seeded by `ctx.rank` alone trains every replica on the same data,
and nothing fails (detect/duplicates.py, which compares the digests in the coordinator). So,
on the steps `input_digest_due` names (detect/step_rows.py: the first three, then every 50th),
each rank digests its step's input and the digest goes out with its signal row (ft/guard.py):

- by default, the first tensor argument of the model's first forward pass of the step that
  records gradients (or the first tensor in a dict, list or tuple argument: `model(batch)`),
  taken by a forward pre-hook run before any other, so it sees what the script passed (the
  later micro-batches of gradient accumulation, evaluation under `no_grad` and forward
  passes between steps are not looked at);
- or what the script names: `trainer.fingerprint_input(x)` (a tensor, or the sample indices),
  for a loop whose model input is not its data. The first call removes the hook for good.

`digest`: up to SAMPLE elements of the tensor, evenly strided (all of a smaller one), their
raw bits as int64, each times a fixed odd 64-bit weight of its position, summed with
wrap-around. Integer sums do not depend on the order of summation, so the number is the same
on every device and kernel; any changed element, and any reordering, changes it. It is a few
small kernels on the tensor's device; the host reads the result at the end of the step
(`value`, after the vote has synchronised anyway), so the forward pass waits for nothing.
The shape and dtype are hashed in with it on the host. A sample whose elements are all equal
(a mask of ones, zeros) gives no digest: identical by nature, it is no evidence of a sampler.

It is taken on 3 steps plus one in 50, and the hook on any other forward pass returns at
once (its cost: docs/benchmarks.md, "What one coordinator request costs").
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from transom.detect.step_rows import input_digest_due
from transom.errors import UsageError

SAMPLE = 1 << 14  # elements digested at most; below torch's grain size, so CPU ops need no thread pool
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2^64 / phi as int64: the weights spread over all bits
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[torch.device, torch.Tensor] = {}


def _weights_on(device: torch.device) -> torch.Tensor:
    """SAMPLE fixed odd weights on `device` (made once per device): i * golden | 1, mod 2^64."""
    w = _weights.get(device)
    if w is None:
        w = _weights[device] = (torch.arange(SAMPLE, dtype=torch.int64) * _GOLDEN | 1).to(device)
    return w


@dataclass(frozen=True)
class Pending:
    """A digest still on the device: [weighted sum, 1 if the sample varies]."""

    values: torch.Tensor
    shape: tuple[int, ...]
    dtype: str

    def value(self) -> int | None:
        """The digest as a signed 64-bit integer (None: a constant input); reads the device."""
        total, varied = self.values.tolist()
        if not varied:
            return None
        text = f"{self.dtype}{self.shape}{total}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def digest(tensor: torch.Tensor) -> Pending | None:
    """The digest of `tensor`, computed where it lives and not read yet (None: nothing to
    digest, e.g. an empty or sparse tensor)."""
    to_local = getattr(tensor, "to_local", None)  # a DTensor's: its shard
    local: torch.Tensor = to_local() if callable(to_local) else tensor
    if (local.layout != torch.strided or local.numel() == 0 or local.device.type == "meta"
            or local.element_size() not in _INT_OF_SIZE):
        return None
    flat = local.detach().reshape(-1)  # a view of a contiguous batch (a copy of a non-contiguous one)
    stride = -(-flat.numel() // SAMPLE)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])[::stride].to(torch.int64)
    total = (bits * _weights_on(bits.device)[: bits.numel()]).sum()
    varied = (bits != bits[0]).any().to(torch.int64)
    return Pending(torch.stack([total, varied]), tuple(local.shape), str(local.dtype))


def as_tensor(data: Any) -> torch.Tensor:
    """`trainer.fingerprint_input`'s argument as a tensor: a tensor, or a sequence (or array) of
    numbers such as sample indices. TypeError for anything else."""
    if isinstance(data, torch.Tensor):
        return data
    try:
        return torch.as_tensor(data)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"fingerprint_input takes a tensor or a sequence of sample indices, "
                        f"not {type(data).__name__}") from None


def _first_tensor(values: tuple, nested: bool = True) -> torch.Tensor | None:
    """The first tensor among `values`, or inside the first dict, list or tuple among them
    that holds one (one level down: a batch passed whole)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
        inner = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else None
        if nested and inner is not None and (found := _first_tensor(tuple(inner), nested=False)) is not None:
            return found
    return None


class InputDigest:
    """One rank's input digests for one trainer; `close()` removes its hook."""

    def __init__(self, model: torch.nn.Module, enabled: bool, step_now: Callable[[], int | None]):
        """`enabled` False (detection off: no signal rows): nothing is digested. `step_now`: the
        step being trained, None between steps."""
        self._enabled, self._step_now = enabled, step_now
        self._taken: tuple[int, Pending | None] | None = None  # (step, its input's digest)
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True) \
            if enabled else None

    def _pre_forward(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        step = self._step_now()
        if step is None or not torch.is_grad_enabled() or not input_digest_due(step) or self._has(step):
            return
        first = _first_tensor((*args, *kwargs.values()))
        self._taken = (step, digest(first) if first is not None else None)

    def _has(self, step: int) -> bool:
        # A retried step keeps its first try's digest: it trains on the same batch again.
        return self._taken is not None and self._taken[0] == step

    def take(self, data: Any) -> None:
        """The script names this step's input (`trainer.fingerprint_input`); from now on the
        hook takes nothing."""
        step = self._step_now()
        if step is None:
            raise UsageError("fingerprint_input() belongs inside a step, before optimizer.step()")
        self.close()
        if self._enabled and input_digest_due(step):
            pending = digest(as_tensor(data))
            self._taken = (step, pending)

    def value(self, step: int) -> int | None:
        """The digest of `step`'s input, read from the device now (the end of the step); None
        when the step is not due, nothing was taken, or the input was constant."""
        if self._taken is None or self._taken[0] != step or self._taken[1] is None:
            return None
        return self._taken[1].value()

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
