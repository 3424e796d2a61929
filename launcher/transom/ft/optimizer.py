"""`FTOptimizer`: the script's optimizer as `trainer.optimizer`, so the loop keeps its idiom.

    loss.backward()          # at its end: the step's quorum, FTAR across replicas
    clip_grad_norm_(...)     # optional: sees the averaged gradients
    optimizer.step()         # the commit vote; the wrapped optimizer steps only a committed step
    optimizer.zero_grad()

`step()` finishes the trainer's step (FaultTolerant._finish: vote, LR scaling for missing
replicas, the checkpoint that is due) and is the only place the wrapped optimizer's own
`step()` is called. `trainer.last_step_committed` tells the loop whether the step counted.

AMP: the wrapper declares `_step_supports_amp_scaling`, GradScaler's contract for
optimizers that handle scaling themselves, so `scaler.step(optimizer)` always calls this
`step()` and hands it `found_inf` and `grad_scale` as attributes, instead of skipping the
call when it found inf/NaN. That lets the step end on every replica the same way: the
averaged gradients are the same everywhere, so every replica finds the same inf, counts
the step without updating the parameters (as plain AMP does), and `scaler.update()` backs
the scale off identically. `grad_scale` is set when `unscale_` was not called by the
script; the gradients are then unscaled here.

Everything else (param_groups, state, state_dict, add_param_group, hooks) is the wrapped
optimizer's, so LR schedulers and GradScaler work on either object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, overload

import torch

from transom.errors import UsageError


class FTOptimizer(torch.optim.Optimizer):
    # Optimizer.__init__ is not called on purpose: this object owns no parameters or state;
    # every attribute not defined here is the wrapped optimizer's (__getattr__).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, finish: Any):
        """`finish(before_optimizer, update)`: the trainer's end of a step; returns committed."""
        self.__dict__["_wrapped"] = optimizer
        self.__dict__["_finish"] = finish

    def __getattr__(self, name: str) -> Any:
        wrapped = self.__dict__.get("_wrapped")
        if wrapped is None:  # mid-construction or mid-copy: nothing to delegate to yet
            raise AttributeError(name)
        return getattr(wrapped, name)

    @property
    def wrapped(self) -> torch.optim.Optimizer:
        return self.__dict__["_wrapped"]

    # Optimizer declares these as plain attributes; here they are the wrapped optimizer's,
    # read-only: the setters refuse, with the AttributeError a property without one raises.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.wrapped.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        _read_only("param_groups")

    @property
    def state(self) -> Any:
        return self.wrapped.state

    @state.setter
    def state(self, value: Any) -> None:
        _read_only("state")

    @property
    def defaults(self) -> dict[str, Any]:
        return self.wrapped.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        _read_only("defaults")

    def state_dict(self) -> dict[str, Any]:
        return self.wrapped.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wrapped.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.wrapped.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapped.zero_grad(set_to_none=set_to_none)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """End the step: vote, and step the wrapped optimizer if the step commits (and the
        scaler, if any, found the gradients finite)."""
        if closure is not None:
            raise UsageError("trainer.optimizer.step() takes no closure: the step's gradients are exchanged "
                             "across replicas once, at the end of backward()")
        found_inf = self.__dict__.get("found_inf")
        grad_scale = self.__dict__.get("grad_scale")
        # One host sync, as GradScaler's own skip decision makes.
        update = found_inf is None or not bool(found_inf.item())

        def unscale() -> None:
            if grad_scale is not None:
                inv = grad_scale.double().reciprocal().float()
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(inv.to(p.grad.device))

        self._finish(unscale if update else None, update)
        return None

    def __repr__(self) -> str:
        return f"FTOptimizer({self.wrapped!r})"


def _read_only(name: str) -> NoReturn:
    raise AttributeError(f"FTOptimizer.{name} is the wrapped optimizer's: set it there (trainer.optimizer.wrapped)")
