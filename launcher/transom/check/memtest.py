"""The memory check (a memtest): does the device's memory hold what is written to it?

`memory_bytes` of int32 are allocated on the device and written with a pattern, each
element (i mod PATTERN_MOD) from its own index, so a stuck bit, a cell that leaks into its
neighbour or an address line that maps two elements to one cell reads back wrong. The
whole buffer is read back, inverted in place (every bit flipped, so each cell holds both
values of each bit) and read back again. On a GPU a slice is also copied into pinned host
memory and checked there: the DMA path a checkpoint snapshot takes. Reading back goes
slice by slice (CHUNK_ELEMENTS), so the check needs little memory beyond its buffer. The
value is the number of elements that read back wrong; any is a failure.
"""

from __future__ import annotations

from typing import Any

from transom.check.context import Budget, CheckContext
from transom.check.result import CheckResult, measured, skipped, timed_out

NAME = "memory"
# Prime, so the pattern's period lines up with no power-of-two address boundary.
PATTERN_MOD = 2**31 - 1
CHUNK_ELEMENTS = 4 << 20  # 16 MiB of int32 (and its int64 pattern) per slice read back
PINNED_BYTES = 64 << 20  # GPU: what is copied to pinned host memory and checked there


def check(context: CheckContext, budget: Budget) -> CheckResult:
    import torch

    n = context.memory_bytes // 4
    if n == 0:
        return skipped(NAME, "no memory to test (memory_bytes 0)")
    buffer = torch.empty(n, dtype=torch.int32, device=context.device)
    for start, end in _slices(n):
        if budget.over():
            return timed_out(NAME, budget.given)
        buffer[start:end] = _pattern(torch, start, end, context.device)
    bad = _mismatches(torch, buffer, context.device, budget, inverted=False)
    buffer.bitwise_not_()
    bad += _mismatches(torch, buffer, context.device, budget, inverted=True)
    if context.device == "cuda" and not budget.over():
        bad += _pinned_mismatches(torch, buffer)
    del buffer
    if context.device == "cuda":  # the caching allocator would keep the buffer from the job's workers
        torch.cuda.empty_cache()
    if budget.over():
        return timed_out(NAME, budget.given)
    size = f"{context.memory_bytes / (1 << 20):.0f} MiB"
    return measured(NAME, float(bad), bad == 0, "0 mismatching elements",
                    f"{bad} of {n} elements read back wrong in {size} of {context.device} memory")


def _slices(n: int) -> list[tuple[int, int]]:
    return [(start, min(start + CHUNK_ELEMENTS, n)) for start in range(0, n, CHUNK_ELEMENTS)]


def _pattern(torch: Any, start: int, end: int, device: str) -> Any:
    """Elements [start, end) of the pattern: each its index mod PATTERN_MOD, as int32."""
    if end <= PATTERN_MOD:  # below the modulus (any buffer under 8 GiB): the index itself, made directly
        return torch.arange(start, end, dtype=torch.int32, device=device)
    return torch.arange(start, end, dtype=torch.int64, device=device).remainder_(PATTERN_MOD).to(torch.int32)


def _mismatches(torch: Any, buffer: Any, device: str, budget: Budget, inverted: bool) -> int:
    bad = 0
    for start, end in _slices(buffer.numel()):
        if budget.over():  # the runner has reported it timed out: let the device go
            break
        expected = _pattern(torch, start, end, device)
        if inverted:
            expected.bitwise_not_()
        bad += int((buffer[start:end] != expected).sum().item())
    return bad


def _pinned_mismatches(torch: Any, buffer: Any) -> int:
    """A slice of the (inverted) buffer copied to pinned host memory, checked on the CPU."""
    n = min(buffer.numel(), PINNED_BYTES // 4)
    host = torch.empty(n, dtype=torch.int32, pin_memory=True)
    host.copy_(buffer[:n], non_blocking=True)
    torch.cuda.current_stream().synchronize()
    expected = _pattern(torch, 0, n, "cpu").bitwise_not_()
    return int((host != expected).sum().item())
