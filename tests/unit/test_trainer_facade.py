"""FaultTolerant offers every script-facing aid of its LoopAids (ft/loop_aids.py) by name,
with the aid's own documentation, so that `help(trainer.aside)` says what it does."""

from __future__ import annotations

import inspect

from transom.ft.loop_aids import LoopAids
from transom.ft.trainer import FaultTolerant

# Read-outs the trainer's stages use, not the script.
NOT_OFFERED = {"exchanges_at_backward", "step", "replica_id"}


def public_members(cls: type) -> dict[str, object]:
    return {name: member for name, member in vars(cls).items() if not name.startswith("_")}


def test_every_aid_is_offered_with_its_documentation():
    aids = {name: member for name, member in public_members(LoopAids).items() if name not in NOT_OFFERED}
    assert aids, "LoopAids has no public members?"
    trainer = public_members(FaultTolerant)
    missing = sorted(set(aids) - set(trainer))
    assert not missing, f"LoopAids members FaultTolerant does not offer: {missing}"
    for name, member in aids.items():
        assert inspect.getdoc(trainer[name]) == inspect.getdoc(member), name
        assert inspect.getdoc(member), f"LoopAids.{name} has no docstring"
