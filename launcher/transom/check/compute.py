"""The compute check: does the device multiply matrices right?

A fixed, seeded float32 workload (REPEATS products of SIZE x SIZE matrices) is multiplied
on the device by its ordinary matmul (cuBLAS on a GPU) and compared with a reference
computed another way: in float64, on the CPU, as blockwise sums of elementwise products,
with no matmul kernel involved, so a fault in that kernel or in the device cannot appear
in both. The value is the largest error of any element relative to the size of the sum
it came from (|A| |B|, the scale of a dot product's rounding error), which random inputs
whose products nearly cancel cannot inflate.

A device that computes wrong (a bad SM, corrupted firmware, a failing HBM stack under load)
shows errors of order 1; a sound one, of order 1e-7. TF32 (a 10-bit mantissa, errors near
1e-3) is turned off for the check: it is a choice of precision, not a fault.
The injected fault `corrupt` (transom/inject.py) adds CORRUPTION to one element of the
device's result, as such a device would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from transom.check.context import Budget, CheckContext
from transom.check.result import CheckResult, measured, timed_out

NAME = "compute"
SIZE = 256
REPEATS = 8  # distinct seeded products: a fault that hits some tiles of some launches only
SEED = 33
BLOCK = 16  # columns of A per step of the reference: 256 x 16 x 256 float64 (8 MiB) at a time
# float32's unit roundoff (6e-8) times a length-256 dot product's worst-case growth is
# 1.5e-5 of |A| |B|; rounding never reaches this, a wrong device exceeds it by orders of
# magnitude, and TF32 (were it on) would exceed it too.
TOLERANCE = 1e-4
CORRUPTION = 1e3  # what the injected fault adds to one element: far beyond any rounding


def check(context: CheckContext, budget: Budget) -> CheckResult:
    import torch

    corrupt = any(f.action == "corrupt" and f.due(context.run_index) for f in context.faults)
    worst = 0.0
    with _exact_float32(torch, context.device):
        for i in range(REPEATS):
            if budget.over():  # the runner has reported it timed out: stop using the device
                break
            generator = torch.Generator().manual_seed(SEED + i)
            a = torch.randn(SIZE, SIZE, generator=generator)
            b = torch.randn(SIZE, SIZE, generator=generator)
            product = torch.matmul(a.to(context.device), b.to(context.device))
            if corrupt and i == 0:
                product.view(-1)[SIZE + 1] += CORRUPTION
            reference, scale = _reference(torch, a, b)
            error = ((product.cpu().double() - reference).abs() / scale).max().item()
            worst = max(worst, error)
    if budget.over():
        return timed_out(NAME, budget.given)
    expected = f"<= {TOLERANCE:.0e}"
    return measured(NAME, worst, worst <= TOLERANCE, expected, f"max relative error {worst:.3g}")


def _reference(torch: Any, a: Any, b: Any) -> tuple[Any, Any]:
    """A @ B and |A| @ |B| in float64, as sums over blocks of columns of broadcast products
    (no matmul kernel)."""
    a64, b64 = a.double(), b.double()
    reference = torch.zeros(SIZE, SIZE, dtype=torch.float64)
    scale = torch.zeros(SIZE, SIZE, dtype=torch.float64)
    for k in range(0, SIZE, BLOCK):
        terms = a64[:, k:k + BLOCK, None] * b64[None, k:k + BLOCK, :]
        reference += terms.sum(dim=1)
        scale += terms.abs_().sum(dim=1)
    return reference, scale.clamp_(min=torch.finfo(torch.float64).tiny)


@contextlib.contextmanager
def _exact_float32(torch: Any, device: str) -> Iterator[None]:
    """TF32 off for the check on a GPU (restored after): the check measures the device, not
    a precision the job may have chosen."""
    if device != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
