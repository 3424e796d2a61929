"""What a joiner expects a source's manifest to hold (transom.ft.expected), without I/O.

The honest manifest of every torch.optim optimizer a joiner can replay fits a joiner whose
optimizer already stepped (every key, dtype and shape as its own) and one that never did
(its optimizer state made at the first step, bounded by the rule for it); one tensor more,
larger, of another dtype or shape, or missing, does not.
"""

from __future__ import annotations

import pytest
import torch

from transom.checkpoint import structure
from transom.ft import transfer
from transom.ft.expected import LAZY_ENTRIES, ExpectedState

OPTIMIZERS = {
    "SGD with momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam with amsgrad": lambda ps: torch.optim.Adam(ps, amsgrad=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps),
    "RMSprop centered with momentum": lambda ps: torch.optim.RMSprop(ps, centered=True, momentum=0.9),
    "NAdam": lambda ps: torch.optim.NAdam(ps),
    "Adafactor": lambda ps: torch.optim.Adafactor(ps),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps),
}


def replica(make_optimizer, steps: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(dtype)
    opt = make_optimizer(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, dtype=dtype)).float().pow(2).mean().backward()
        opt.step()
    return model, opt


def manifest_of(state: dict, **replace: torch.Tensor) -> transfer.SnapshotManifest:
    tensors, skeleton = structure.flatten(state, torch.is_tensor)
    tensors = {k: v.detach().clone() for k, v in {**tensors, **replace}.items()}
    return transfer.publish(5, tensors, skeleton, chunk_bytes=4096).manifest


def snapshot_of(model, opt, **replace: torch.Tensor) -> transfer.SnapshotManifest:
    return manifest_of({"step": 5, "model": model.state_dict(), "optimizer": opt.state_dict()}, **replace)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("joiner_steps", [0, 1], ids=["fresh joiner", "joiner that stepped"])
def test_the_honest_manifest_fits(name, joiner_steps):
    source = replica(OPTIMIZERS[name], steps=2, seed=1)
    expected = ExpectedState.of(*replica(OPTIMIZERS[name], steps=joiner_steps))
    manifest = snapshot_of(*source)
    assert expected.mismatch(manifest) is None
    assert manifest.total_bytes <= expected.max_total_bytes


def test_float32_moments_of_bfloat16_parameters_fit_a_fresh_joiner():
    source_model, source_opt = replica(lambda ps: torch.optim.AdamW(ps), steps=1, dtype=torch.bfloat16, seed=1)
    moments = {f"optimizer/state/{i}/{k}": v.float() for i, s in source_opt.state_dict()["state"].items()
               for k, v in s.items() if k != "step"}
    expected = ExpectedState.of(*replica(lambda ps: torch.optim.AdamW(ps), steps=0, dtype=torch.bfloat16))
    assert expected.mismatch(snapshot_of(source_model, source_opt, **moments)) is None


def lies(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    w = model.state_dict()["0.weight"]
    return {
        "another shape": {"model/0.weight": w.reshape(8, 16)},
        "another dtype": {"model/0.weight": w.double()},
        "a tensor the model lacks": {"model/extra": torch.zeros(4)},
        "a tensor outside the model and optimizer": {"rng/torch": torch.zeros(5056, dtype=torch.uint8)},
        "optimizer state larger than its parameter": {"optimizer/state/0/exp_avg": torch.zeros(129)},
        "more optimizer state than an optimizer keeps": {f"optimizer/state/0/m{i}": w for i in range(LAZY_ENTRIES)},
        "optimizer state of a parameter the optimizer lacks": {"optimizer/state/4/exp_avg": torch.zeros(1)},
        "optimizer state under a padded index": {"optimizer/state/00/exp_avg": w},
        "optimizer state nested": {"optimizer/state/0/exp_avg/x": w},
    }


@pytest.mark.parametrize("lie", list(lies(*replica(lambda ps: torch.optim.AdamW(ps), steps=0))))
def test_a_tensor_more_larger_or_different_does_not_fit_a_fresh_joiner(lie):
    source = replica(lambda ps: torch.optim.AdamW(ps), steps=2, seed=1)
    expected = ExpectedState.of(*replica(lambda ps: torch.optim.AdamW(ps), steps=0))
    assert expected.mismatch(snapshot_of(*source, **lies(*source)[lie])) is not None


def test_optimizer_state_a_joiner_holds_must_be_exactly_its_own():
    source_model, source_opt = replica(lambda ps: torch.optim.AdamW(ps, amsgrad=True), steps=2, seed=1)
    joiner = replica(lambda ps: torch.optim.AdamW(ps), steps=1)  # stepped: it holds its state, no amsgrad
    expected = ExpectedState.of(*joiner)
    assert "optimizer/state/0/max_exp_avg_sq" in expected.mismatch(snapshot_of(source_model, source_opt))
    assert ExpectedState.of(*replica(lambda ps: torch.optim.AdamW(ps), steps=0)).mismatch(
        snapshot_of(source_model, source_opt)) is None  # fresh, it cannot tell: the rule for state it lacks


def test_a_parameter_missing_does_not_fit():
    model, opt = replica(lambda ps: torch.optim.AdamW(ps), steps=1, seed=1)
    sd = dict(model.state_dict())
    del sd["2.bias"]
    manifest = manifest_of({"step": 5, "model": sd, "optimizer": opt.state_dict()})
    assert ExpectedState.of(*replica(lambda ps: torch.optim.AdamW(ps), steps=0)).mismatch(manifest) == \
        "model/2.bias is missing"
