"""A rank's digest of the input it trains on (ft/input_digest.py): what changes it, what it costs,
and which forward pass the trainer's hook takes it from."""

from __future__ import annotations

import time

import pytest
import torch

from transom.errors import UsageError
from transom.ft.input_digest import SAMPLE, InputDigest, digest


def value(t: torch.Tensor) -> int | None:
    pending = digest(t)
    return pending.value() if pending is not None else None


def test_equal_inputs_have_one_digest_and_any_change_makes_another():
    x = torch.randint(50_000, (8, 256), generator=torch.Generator().manual_seed(0))
    assert value(x) == value(x.clone()) and isinstance(value(x), int) and -(2**63) <= value(x) < 2**63
    changed = x.clone()
    changed[5, 17] += 1
    others = [changed, x.flip(0), x.reshape(16, 128), x.view(torch.float64), x.to(torch.int32)]
    digests = {value(x), *(value(o) for o in others)}
    assert len(digests) == 1 + len(others)  # one element, the order, the shape, the dtype each count


def test_the_digest_is_of_the_values_not_of_their_layout_and_any_dtype_has_one():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    assert value(x.t()) == value(x.t().contiguous())
    for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int16):
        assert value((x * 10).to(dtype)) is not None
    assert value(x > 0) is not None


def test_the_sum_is_the_weighted_sum_of_the_raw_bits_mod_2_to_the_64():
    """Integer arithmetic, so every device and kernel gets the same number (checked here
    against Python's own integers)."""
    x = torch.tensor([3, -1, 2**62, 7], dtype=torch.int64)
    total, varied = digest(x).values.tolist()
    weights = [((i * 0x9E3779B97F4A7C15) % 2**64) | 1 for i in range(4)]
    expected = sum(w * v for w, v in zip(weights, x.tolist())) % 2**64
    assert total % 2**64 == expected and varied == 1


def test_a_constant_input_is_no_evidence_and_gives_no_digest():
    assert value(torch.ones(8, 128)) is None and value(torch.zeros(4, dtype=torch.int64)) is None
    assert value(torch.empty(0)) is None


def test_a_large_input_is_sampled_and_costs_a_fraction_of_a_millisecond():
    images = torch.randn(64, 3, 224, 224, generator=torch.Generator().manual_seed(2))  # 38 MB
    assert images.numel() > 100 * SAMPLE
    value(images)
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        value(images)
        took.append(time.perf_counter() - t0)
    # 0.1-0.6 ms on the development box; hashing every byte would take ~40 ms. Generous: the
    # test shares two cores with others.
    assert min(took) < 0.005, took


# --- the trainer's hook -----------------------------------------------------------------------------
class Steps:
    """The trainer's side: the step being trained, None between steps."""

    def __init__(self):
        self.now: int | None = None

    def __call__(self) -> int | None:
        return self.now


def test_the_first_forward_that_records_gradients_in_a_due_step_is_digested():
    model, steps = torch.nn.Linear(4, 1), Steps()
    inputs = InputDigest(model, True, steps)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    model(x)  # between steps: not looked at
    steps.now = 0
    with torch.no_grad():
        model(y)  # evaluation
    model(x)
    model(y)  # a later micro-batch of the step
    assert inputs.value(0) == value(x) is not None
    steps.now = 3  # not due (detect/step_rows.py: the first three, then every 50th)
    model(x)
    assert inputs.value(3) is None
    steps.now = 50
    model(input=y)  # a keyword argument is looked at too
    assert inputs.value(50) == value(y) and inputs.value(0) is None  # only the newest step is kept


class TakesABatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.linear(batch["x"])


def test_a_batch_passed_whole_is_digested_by_its_first_tensor():
    model, steps = TakesABatch(), Steps()
    inputs = InputDigest(model, True, steps)
    x = torch.randn(8, 4)
    steps.now = 0
    model({"name": "shard-3", "x": x, "y": torch.randn(8)})
    assert inputs.value(0) == value(x)


def test_the_hook_sees_the_input_the_script_passed_before_other_hooks_change_it():
    model, steps = torch.nn.Linear(4, 1), Steps()
    model.register_forward_pre_hook(lambda _m, args: (args[0] * 2,))
    inputs = InputDigest(model, True, steps)
    x = torch.randn(8, 4)
    steps.now = 1
    model(x)
    assert inputs.value(1) == value(x)


def test_the_script_can_name_its_input_and_then_the_hook_takes_none():
    model, steps = torch.nn.Linear(4, 1), Steps()
    inputs = InputDigest(model, True, steps)
    with pytest.raises(UsageError):
        inputs.take([1, 2, 3])  # outside a step
    steps.now = 0
    inputs.take([5, 9, 1, 4])  # sample indices
    model(torch.randn(8, 4))
    assert inputs.value(0) == value(torch.tensor([5, 9, 1, 4]))
    steps.now = 1
    model(torch.randn(8, 4))
    assert inputs.value(1) is None and len(model._forward_pre_hooks) == 0
    with pytest.raises(TypeError, match="a tensor or a sequence of sample indices"):
        inputs.take({"not": "indices"})


def test_with_detection_off_nothing_is_hooked_and_close_removes_the_hook():
    model, steps = torch.nn.Linear(4, 1), Steps()
    steps.now = 0
    off = InputDigest(model, False, steps)
    model(torch.randn(8, 4))
    off.take(torch.arange(4))
    assert off.value(0) is None and len(model._forward_pre_hooks) == 0
    on = InputDigest(model, True, steps)
    assert len(model._forward_pre_hooks) == 1
    on.close()
    assert len(model._forward_pre_hooks) == 0
