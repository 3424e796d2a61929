"""`ReplicaState`: everything a replica must hold to go on where another left off, in one place.

A replica's state is the committed step, the model's and the optimizer's state dicts, the
AMP `GradScaler`'s (its scale decides which steps are skipped, so replicas must agree on it),
the sampler's position, the script's `extra_state` (an LR scheduler, anything with
`state_dict()` / `load_state_dict()`) and the RNG states (torch CPU, the device's CUDA
generator, Python's `random`). The same dict serves every path that moves state: a peer
serving a recovering replica (ft/wire.py encodes it, no pickle), a checkpoint
(ft/checkpointing.py), a spare catching up. One encoding, so a field added here travels
everywhere.

    {"step": int, "model": {...}, "optimizer": {...}, "scaler": {...} | None,
     "sampler": {...} | None, "extra": {...} | None, "rng": {...}}

`apply` loads such a dict into the live objects; it checks the shape first and raises
`IncompatibleState` (a `CheckpointError`'s sibling in transom.errors) with what does not
fit, before anything changed when it can. Fields missing from an older state (no scaler,
no sampler) leave the live object as it is.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from transom.errors import IncompatibleState


def rng_state(device: torch.device) -> dict:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


class ReplicaState:
    """The live objects of one rank of a replica, captured and restored as one dict."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
                 scaler: Any = None, sampler: Any = None, extra: Any = None):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.scaler, self.sampler, self.extra = scaler, sampler, extra
        self.on_applied: Callable[[], None] | None = None  # after any state was loaded (ft/shared_values.py)

    def capture(self, step: int) -> dict[str, Any]:
        """The state after `step` committed steps (references to live tensors: the caller
        copies them, as the checkpoint snapshot and the wire encoder do)."""
        return {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": _state_of(self.scaler),
            "sampler": _state_of(self.sampler),
            "extra": _state_of(self.extra),
            "rng": rng_state(self.device),
        }

    def apply(self, state: Any) -> int:
        """Load `state` (as `capture` made it) into the live objects; its step."""
        if not isinstance(state, dict) or not {"model", "optimizer"} <= state.keys():
            raise IncompatibleState("the state holds no model and optimizer")
        step = _step_of(state)
        if self.scaler is not None and state.get("scaler") is not None and not _enabled(self.scaler):
            raise IncompatibleState("the state has a GradScaler's scale but this script's scaler is disabled")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            raise IncompatibleState(f"the state does not fit this model or optimizer: {e}") from e
        self._apply_rest(state)
        return step

    def apply_small(self, state: Any) -> int:
        """Load everything but the model and the optimizer (a catching-up replica's first
        round, ft/catchup.py); its step."""
        step = _step_of(state)
        self._apply_rest(state)
        return step

    def _apply_rest(self, state: dict) -> None:
        for name, live in (("scaler", self.scaler), ("sampler", self.sampler), ("extra", self.extra)):
            if live is not None and state.get(name) is not None:
                live.load_state_dict(state[name])
        if state.get("rng") is not None:  # absent in a state saved by the checkpoint engine directly
            set_rng_state(state["rng"], self.device)
        if self.on_applied is not None:
            self.on_applied()


def _step_of(state: Any) -> int:
    step = state.get("step") if isinstance(state, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise IncompatibleState(f"the state's step is {step!r}, not a step number")
    return step


def _state_of(obj: Any) -> dict | None:
    if obj is None:
        return None
    if not _enabled(obj):  # a disabled GradScaler's state_dict() is empty: nothing to carry
        return None
    return obj.state_dict()


def _enabled(obj: Any) -> bool:
    is_enabled = getattr(obj, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True
