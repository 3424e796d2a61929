"""`StepHooks`: the places where a step offers tests and demos a fault, behind one object.

The production step calls `hooks.<point>(...)` at each such place and nothing else; the
default object does nothing there. Only when `TRANSOM_FAULT` asks for a fault for this
attempt of this replica (transom/inject.py) does `for_replica` build `InjectedFaults`,
which fires the fault at its point. So a fault is injected through the harness, never
through an `if` in the step, and a newcomer reading the step sees where faults can land
without reading how they are made.

Each point names where it sits (the `phase` of a fault in inject.py):

    forward     the step begins                     (step)
    allreduce   before the cross-replica all-reduce (step; the peers already wait in it)
    gradients   before the exchange, on this rank's first gradient (step)
    end         the step's end, before the vote    (step; its busy time so far)
    update      after the optimizer step            (step; the first parameter)
    catchup     a committed step while catching up  (how many recorded)
    serve       a peer asks for a snapshot chunk    (how many asked; the state server's thread)
    checkpoint  before a checkpoint's first object  (step; the checkpoint engine's thread)
"""

from __future__ import annotations

import os
from typing import Any

from transom import inject
from transom.contract import ENV_FAULT, ENV_NODE_NAME, ReplicaEnv


class StepHooks:
    """No fault anywhere: what production runs."""

    def forward(self, step: int) -> None:
        pass

    def allreduce(self, step: int) -> None:
        pass

    def gradients(self, step: int, grad: Any) -> None:
        pass

    def end(self, step: int, busy_s: float) -> None:
        pass

    def update(self, step: int, model: Any) -> None:
        """After step `step`'s update of `model` (a fault's target: its first parameter)."""

    def catchup(self, recorded: int) -> None:
        pass

    def serve(self, chunk: int) -> None:
        pass

    def checkpoint(self, step: int) -> None:
        pass


NO_HOOKS = StepHooks()


class InjectedFaults(StepHooks):
    """The one fault TRANSOM_FAULT gave this attempt, fired at its point on its rank."""

    def __init__(self, fault: inject.Fault, rank: int):
        self.fault, self.rank = fault, rank

    def forward(self, step: int) -> None:
        self.fault.maybe_fire(step, self.rank, "forward")

    def allreduce(self, step: int) -> None:
        self.fault.maybe_fire(step, self.rank, "allreduce")

    def gradients(self, step: int, grad: Any) -> None:
        self.fault.maybe_fire(step, self.rank, "gradients", target=grad)

    def end(self, step: int, busy_s: float) -> None:
        self.fault.maybe_fire(step, self.rank, "end", elapsed_s=busy_s)

    def update(self, step: int, model: Any) -> None:
        # The parameter is looked up here: a model's parameters() walks its modules, which
        # costs every step of a job without faults a tenth of a millisecond on a small model.
        self.fault.maybe_fire(step, self.rank, "update", target=next(model.parameters()))

    def catchup(self, recorded: int) -> None:
        self.fault.maybe_fire(recorded, self.rank, "catchup")

    def serve(self, chunk: int) -> None:
        self.fault.maybe_fire(chunk, self.rank, "serve")

    def checkpoint(self, step: int) -> None:
        self.fault.maybe_fire(step, self.rank, "checkpoint")


def for_replica(env: ReplicaEnv, rank: int) -> StepHooks:
    """The hooks of rank `rank` of the incarnation `env` describes: the fault its environment's
    TRANSOM_FAULT holds for its attempt (replicas that are threads of one process each have an
    environment of their own: tests/integration/threaded_job.py)."""
    return from_environ(env.attempt, env.replica_id, rank, {ENV_FAULT: env.fault, ENV_NODE_NAME: env.node_name})


def from_environ(attempt: int, replica: int, rank: int, environ: dict[str, str] | None = None) -> StepHooks:
    """The hooks for this attempt of replica `replica`'s rank `rank`: NO_HOOKS unless
    TRANSOM_FAULT holds a fault for it."""
    fault = inject.from_environ(attempt, environ if environ is not None else dict(os.environ), replica=replica)
    return InjectedFaults(fault, rank) if fault is not None else NO_HOOKS
