"""Script values set aside, shared with every replica: what one replica's evaluation found
(nanoGPT's `best_val_loss`) must be every replica's, or it is lost when that replica
catches up from a peer that never saw it.

An evaluation runs on one replica in `trainer.aside()` (ft/loop_aids.py). The values of
`ft.ScriptState`s in `extra_state` that it changed there travel with its next quorum
request (`shared`, at most 16 KiB of JSON: numbers, strings, booleans, None, lists and
dicts; a tensor set aside stays this replica's); the coordinator hands them to every member
of the next decision, and each rank sets them when the answer arrives, before anything is
served or captured in that step. So every replica holds them from the same step on, the
peers' states that a catching-up replica loads have them, and so do checkpoints.

A replica that catches up loads a peer's snapshot, which may be older than the values it
received meanwhile: the values received are set again after every state it loads.

Trust: the values are data for the job's own script on the other replicas; nothing runs
them, and Transom itself never acts on them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from transom.coordinator.models import MAX_SHARED_BYTES
from transom.ft.script_state import ScriptState, StateBundle

log = logging.getLogger("transom.ft")


def _script_states(extra: Any) -> dict[str, ScriptState]:
    if isinstance(extra, ScriptState):
        return {"": extra}
    if isinstance(extra, StateBundle):
        return {name: part for name, part in extra.parts.items() if isinstance(part, ScriptState)}
    return {}


def _json_copy(value: Any) -> Any:
    """`value` as JSON carries it; None if it cannot travel (a tensor)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


class SharedValues:
    def __init__(self, extra: Any):
        self._states = _script_states(extra)
        self._outgoing: dict[str, Any] = {}
        self._received: dict[str, Any] = {}  # every value a decision handed us, set again after a load

    def before_aside(self) -> dict[str, dict[str, Any]]:
        return {name: {k: _json_copy(v) for k, v in state.items()} for name, state in self._states.items()}

    def after_aside(self, before: dict[str, dict[str, Any]]) -> None:
        """Queue what the work aside changed for the next quorum request."""
        for name, state in self._states.items():
            for key, value in state.items():
                now = _json_copy(value)
                if now is None and value is not None:
                    log.warning("ScriptState %r: %r set aside is not JSON (a tensor?); it stays this replica's",
                                name, key)
                elif key not in before.get(name, {}) or before[name][key] != now:
                    self._outgoing[f"{name}/{key}"] = now
        if len(json.dumps(self._outgoing)) > MAX_SHARED_BYTES:
            log.warning("script values set aside exceed %d bytes of JSON; they stay this replica's", MAX_SHARED_BYTES)
            self._outgoing = {}

    def take(self) -> dict[str, Any] | None:
        """The values for the next quorum request (once)."""
        out, self._outgoing = self._outgoing or None, {}
        return out

    def apply(self, shared: dict[str, Any] | None) -> None:
        """Set the values a decision handed every member."""
        if shared:
            self._received.update(shared)
            self._set(shared)

    def reapply(self) -> None:
        """After a peer's state was loaded (it may predate values we received)."""
        self._set(self._received)

    def _set(self, values: dict[str, Any]) -> None:
        for path, value in values.items():
            name, _, key = path.partition("/")
            state = self._states.get(name)
            if state is not None and key:
                state[key] = value
