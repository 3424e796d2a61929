"""Split a training state into flat named tensors and a JSON skeleton, and back.

The state a script saves is nested: `{"model": model.state_dict(), "optimizer":
opt.state_dict(), "step": 120, "rng": {...}}`. Optimizer state dicts have integer keys and
tuples; the optimizer's own state appears only after its first step. So a checkpoint does
not rely on a template of the live objects: it stores every tensor under a flat key
(`model/fc.weight`, `optimizer/state/0/exp_avg`) and the rest as a JSON skeleton in the
manifest, where each tensor is `{"__tensor__": key}`. JSON rather than pickle: loading a
checkpoint from shared storage must never run code.

A tensor that is one rank's shard of a larger one (an FSDP2 DTensor) is stored as its local
part; `localize` returns that part and a small JSON description (placements, global
shape), kept next to the key, from which `rebuild` makes the sharded tensor again on load.

Pure Python; tensors are recognised by `is_tensor` (passed in, so this imports no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

TENSOR, DICT, TUPLE, META = "__tensor__", "__dict__", "__tuple__", "__meta__"
MAX_DEPTH = 64  # nesting of a skeleton read back from storage or a peer
Localize = Callable[[Any], "tuple[Any, dict | None]"]  # tensor -> (what to store, description)
Rebuild = Callable[[Any, dict], Any]  # (stored tensor, description) -> tensor to return


def _key_part(key: Any) -> str:
    text = str(key)
    return text.replace("%", "%25").replace("/", "%2F")


def flatten(obj: Any, is_tensor: Callable[[Any], bool], localize: Localize | None = None,
            prefix: str = "") -> tuple[dict[str, Any], Any]:
    """(tensors by flat key, JSON skeleton). TypeError names the path of anything else.

    Keys start with `prefix` (which keeps the shards of one checkpoint apart).
    """
    tensors: dict[str, Any] = {}

    def walk(value: Any, path: str) -> Any:
        if is_tensor(value):
            key = prefix + (path or "value")
            if key in tensors:  # {1: a, "1": b}: both would be stored under one key
                raise TypeError(f"{path or '<root>'}: two entries map to the checkpoint key {key!r} "
                                "(keys that differ only in type, like 1 and '1')")
            meta = None
            if localize is not None:
                value, meta = localize(value)
            tensors[key] = value
            return {TENSOR: key, META: meta} if meta else {TENSOR: key}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and k not in (TENSOR, DICT, TUPLE, META) for k in value):
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


def tensor_keys(skeleton: Any) -> list[str]:
    """The tensor keys a skeleton refers to, in order; ValueError if it is not one `flatten`
    could have made (a skeleton read from storage or a peer is data to check, not to trust)."""
    keys: list[str] = []

    def walk(node: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ValueError(f"skeleton nested deeper than {MAX_DEPTH}")
        if isinstance(node, list):
            for v in node:
                walk(v, depth + 1)
        elif isinstance(node, dict):
            if TENSOR in node:
                if not isinstance(node[TENSOR], str) or not set(node) <= {TENSOR, META}:
                    raise ValueError(f"bad tensor reference {str(node)[:200]}")
                keys.append(node[TENSOR])
            elif DICT in node:
                items = node[DICT]
                if len(node) != 1 or not isinstance(items, list) or not all(
                        isinstance(i, list) and len(i) == 2 and isinstance(i[0], (str, int, bool, type(None)))
                        for i in items):
                    raise ValueError("bad dict entry in skeleton")
                for _, v in items:
                    walk(v, depth + 1)
            elif TUPLE in node:
                if len(node) != 1 or not isinstance(node[TUPLE], list):
                    raise ValueError("bad tuple in skeleton")
                walk(node[TUPLE], depth + 1)
            else:
                for v in node.values():
                    walk(v, depth + 1)
        elif node is not None and not isinstance(node, (bool, int, float, str)):
            raise ValueError(f"skeleton holds a {type(node).__name__}")

    walk(skeleton, 0)
    if len(set(keys)) != len(keys):
        raise ValueError("skeleton refers to a tensor twice")
    return keys


def unflatten(skeleton: Any, tensors: Mapping[str, Any], rebuild: Rebuild | None = None) -> Any:
    """The nested object `flatten` took apart; KeyError names a missing tensor.

    A tensor stored with a description goes through `rebuild`; without one, the stored
    (local) tensor is returned as it is.
    """
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if TENSOR in node and set(node) <= {TENSOR, META}:
                value = tensors[node[TENSOR]]
                meta = node.get(META)
                return rebuild(value, meta) if meta and rebuild is not None else value
            if TUPLE in node and len(node) == 1:
                return tuple(walk(v) for v in node[TUPLE])
            if DICT in node and len(node) == 1:
                return {k: walk(v) for k, v in node[DICT]}
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(skeleton)
