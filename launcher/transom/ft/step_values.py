"""The typed values a step's stages hand each other (ft/trainer.py sequences them).

    exchange (ft/exchange.py)  --QuorumOutcome-->  recovery (ft/recovery.py), commit (ft/commit.py)
    commit.vote                --StepVote-->       the trainer: apply the update, or count a failure
    commit.record              --StepRecord-->     exchange: what the next quorum request reports

A stage neither calls another nor calls back into the trainer for the step's work; it
returns one of these and the trainer passes it on.
"""

from __future__ import annotations

from dataclasses import dataclass

from transom.coordinator.models import QuorumResponse, StepReport
from transom.ft.ftar import StepAllReduce


@dataclass(frozen=True)
class QuorumOutcome:
    """The cross-replica half of a step: its quorum, and the all-reduce of its gradients."""

    quorum: QuorumResponse
    ftar: StepAllReduce  # failed() and error say whether the gradients arrived
    recovering: bool  # this replica catches up this round: it contributed zeros
    changed: bool  # the quorum differs from the last step's: its group was rebuilt


@dataclass(frozen=True)
class StepVote:
    """The vote of a step's end, the same on every rank of the replica."""

    committed: bool  # every rank's exchange succeeded: the step counts
    skip: bool = False  # committed without an update: the guard judged the step bad (ft/guard.py)
    loss: float | None = None  # the guard's view of the step, for the detectors
    norm: float | None = None


@dataclass(frozen=True)
class StepRecord:
    """A finished step as the next quorum request reports it."""

    failed: bool = False
    report: StepReport | None = None  # a committed step trained on this replica's own batch
    commit_quorum_id: int = -1  # the quorum of the last committed step
