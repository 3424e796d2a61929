"""The script's own state that must travel with the replica: values such as nanoGPT's
`best_val_loss`, and several stateful objects passed as one `extra_state`.

`extra_state` (FaultTolerant) is replica state: a peer that serves a recovering replica,
a checkpoint and its restore all carry it (ft/state.py), so a script's counters survive a
failure as its weights do. It takes one object with `state_dict()` / `load_state_dict()`
(an LR scheduler), or a dict of them by name; `ScriptState` holds plain values:

    script = ft.ScriptState(best_val_loss=1e9)
    with ft.FaultTolerant(model, opt, ctx, extra_state={"lr": scheduler, "script": script}) as trainer:
        ...
        if val_loss < script["best_val_loss"]:
            script["best_val_loss"] = val_loss

Values are what the state encoding carries without pickle (ft/wire.py): numbers, strings,
booleans, None, tensors, and lists and dicts of them. Anything else is refused when set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from transom.errors import UsageError

_PLAIN = (int, float, str, bool, type(None))


def _check(value: Any, where: str) -> None:
    if isinstance(value, _PLAIN) or torch.is_tensor(value):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise UsageError(f"ScriptState: {where} has a key {k!r} that is not a string")
            _check(v, f"{where}[{k!r}]")
        return
    raise UsageError(f"ScriptState: {where} is a {type(value).__name__}; it holds numbers, strings, booleans, "
                     "None, tensors, and lists and dicts of them (nothing that would need pickle)")


class ScriptState(dict):
    """A dict of the script's values that is replica state (pass it in `extra_state`)."""

    def __init__(self, **values: Any):
        super().__init__()
        self.update(values)

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise UsageError(f"ScriptState keys are strings, got {key!r}")
        _check(value, key)
        super().__setitem__(key, value)

    def update(self, *args: Any, **values: Any) -> None:
        for key, value in dict(*args, **values).items():
            self[key] = value

    def state_dict(self) -> dict[str, Any]:
        return dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clear()
        self.update(state)


class StateBundle:
    """Several stateful objects as one: a dict by name of their state dicts."""

    def __init__(self, parts: Mapping[str, Any]):
        for name, part in parts.items():
            if not isinstance(name, str) or not callable(getattr(part, "state_dict", None)) \
                    or not callable(getattr(part, "load_state_dict", None)):
                raise UsageError(f"extra_state[{name!r}] needs state_dict() and load_state_dict() "
                                 "(wrap plain values in ft.ScriptState)")
        self.parts = dict(parts)

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, part in self.parts.items():
            if name in state:  # a part added since the state was saved keeps its own
                part.load_state_dict(state[name])


def bundle(extra: Any) -> Any:
    """`extra_state` as FaultTolerant keeps it: a dict of stateful objects becomes one."""
    if isinstance(extra, Mapping) and not callable(getattr(extra, "state_dict", None)):
        return StateBundle(extra)
    return extra
