"""Split a training state into flat named tensors and a JSON skeleton, and back.

The state a script saves is nested: `{"model": model.state_dict(), "optimizer":
opt.state_dict(), "step": 120, "rng": {...}}`. Optimizer state dicts have integer keys and
tuples; the optimizer's own state appears only after its first step. So a checkpoint does
not rely on a template of the live objects: it stores every tensor under a flat key
(`model/fc.weight`, `optimizer/state/0/exp_avg`) and the rest as a JSON skeleton in the
manifest, where each tensor is `{"__tensor__": key}`. JSON rather than pickle: loading a
checkpoint from shared storage must never run code.

Pure Python; tensors are recognised by `is_tensor` (passed in, so this imports no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

TENSOR, DICT, TUPLE = "__tensor__", "__dict__", "__tuple__"


def _key_part(key: Any) -> str:
    text = str(key)
    return text.replace("%", "%25").replace("/", "%2F")


def flatten(obj: Any, is_tensor: Callable[[Any], bool]) -> tuple[dict[str, Any], Any]:
    """(tensors by flat key, JSON skeleton). TypeError names the path of anything else."""
    tensors: dict[str, Any] = {}

    def walk(value: Any, path: str) -> Any:
        if is_tensor(value):
            key = path or "value"
            tensors[key] = value
            return {TENSOR: key}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and k not in (TENSOR, DICT, TUPLE) for k in value):
                return {k: walk(v, f"{path}/{_key_part(k)}" if path else _key_part(k)) for k, v in value.items()}
            items = []
            for k, v in value.items():
                if not isinstance(k, (str, int, bool)) and k is not None:
                    raise TypeError(f"{path or '<root>'}: dict key {k!r} is not a str or int")
                items.append([k, walk(v, f"{path}/{_key_part(k)}" if path else _key_part(k))])
            return {DICT: items}
        if isinstance(value, (list, tuple)):
            out = [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(value)]
            return {TUPLE: out} if isinstance(value, tuple) else out
        raise TypeError(f"{path or '<root>'}: cannot checkpoint a {type(value).__name__} "
                        "(tensors, numbers, strings, None, lists, tuples and dicts only)")

    skeleton = walk(obj, "")
    return tensors, skeleton


def unflatten(skeleton: Any, tensors: Mapping[str, Any]) -> Any:
    """The nested object `flatten` took apart; KeyError names a missing tensor."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if TENSOR in skeleton and len(skeleton) == 1:
            return tensors[skeleton[TENSOR]]
        if TUPLE in skeleton and len(skeleton) == 1:
            return tuple(unflatten(v, tensors) for v in skeleton[TUPLE])
        if DICT in skeleton and len(skeleton) == 1:
            return {k: unflatten(v, tensors) for k, v in skeleton[DICT]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    return skeleton
