"""Every chaos scenario by name: the ones scenarios.py runs on one job each, and those with a
harness of their own (oom.py, bad_node.py), which build on scenarios.py's."""

from __future__ import annotations

from chaos.bad_node import bad_node
from chaos.job import Verdict
from chaos.oom import oom
from chaos.scenarios import SCENARIOS, STEPS, run
from chaos.world import World

OWN_HARNESS = {"oom": oom, "bad_node": bad_node}
NAMES = [*SCENARIOS, *OWN_HARNESS]


def run_named(world: World, name: str, steps: int = STEPS) -> Verdict:
    if name in OWN_HARNESS:
        return OWN_HARNESS[name](world, steps)
    return run(world, name, SCENARIOS[name], steps)
