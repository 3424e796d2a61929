"""The smallest write that turns the job's status as the API server has it into the one a
plan computed: a JSON patch (RFC 6902) of the members that changed.

A merge patch of the whole status sends every replica's entry on every change, and a
2,000-pod job's status is tens of kilobytes. Here a changed member of `status` is set with
`add` (which replaces an existing member), and in `status.replicas`, when the ids are the
same and in the same order, only the entries that changed are replaced, each guarded by a
`test` of its id at that index: a list changed meanwhile by someone else fails the patch
(422) and the next pass writes again from a fresh read. Members the plan no longer sets are
left alone, as a merge patch would leave them; `training` is the coordinator's and never
touched. No change, no operations: the pass writes nothing.
"""

from __future__ import annotations

from typing import Any

# Lists of entries keyed by "id" that are patched entry by entry.
KEYED_LISTS = ("replicas",)


def status_ops(current: dict[str, Any] | None, wanted: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON patch operations on the job (paths from its root) from `current` (the job's
    `status` as read, None if it has none) to `wanted` (the operator's part)."""
    if current is None:
        return [{"op": "add", "path": "/status", "value": wanted}] if wanted else []
    ops: list[dict[str, Any]] = []
    for key, value in wanted.items():
        if key == "training" or current.get(key) == value:
            continue
        if key in KEYED_LISTS and _same_ids(current.get(key), value):
            for index, (was, now) in enumerate(zip(current[key], value)):
                if was != now:
                    path = f"/status/{key}/{index}"
                    ops += [{"op": "test", "path": f"{path}/id", "value": now["id"]},
                            {"op": "replace", "path": path, "value": now}]
        else:
            ops.append({"op": "add", "path": f"/status/{_escape(key)}", "value": value})
    return ops


def _same_ids(current: Any, wanted: list[dict[str, Any]]) -> bool:
    return (isinstance(current, list) and len(current) == len(wanted)
            and all(isinstance(c, dict) and c.get("id") == w.get("id") for c, w in zip(current, wanted)))


def _escape(key: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
