"""Replicas that train on the same data: the input digests of one step, compared.

The port most scripts get first trains every replica on the same batches, and nothing fails:
nanoGPT seeds its batch sampler with `seed_offset = ddp_rank`, and under Transom every
replica is a small world of its own with ranks 0..world_size-1, so replica 1's rank 0 draws
exactly what replica 0's rank 0 draws. The replicas average identical gradients, the job
trains on 1/N of the data it pays for, and ends "bit-identical" with a clean exit.

Every rank digests the input it trains on, on the steps `input_digest_due` names
(ft/input_digest.py; detect/step_rows.py owns the schedule), and the digest travels in its
signal row. Two (replica, rank) pairs with one digest at one step trained on identical
inputs: ranks of different replicas (seeded by the rank alone), or different ranks of one
replica (seeded by the replica alone, a sampler bug inside the replica).

The finding is the job's, not a verdict against any replica: nothing is restarted or
excluded, because a replica that lies could otherwise forge one against an honest replica
(a forged digest can at most raise this warning). It is made once per job, at the first step
that shows it; ranks that report the same digest of that step later join it (the finding
grows, it is not made again). Memory is bounded: the digests of the newest `MAX_STEPS` due
steps, each at most one per (replica, rank) that can report it (the coordinator bounds
both), and nothing else.

Pure logic, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from transom.detect.step_rows import input_digest_due

MAX_STEPS = 8  # due steps whose digests are kept (the newest): 350 steps at one digest every 50
MAX_NAMED = 16  # replicas or ranks a message names; the rest are counted
CHECKED = "Nothing is restarted"  # a warning, not a verdict
FIX_ACROSS = ("seed or shard the data by the data-parallel rank across replicas (trainer.data_rank / "
              "trainer.data_world_size, or trainer.generator(micro_step)), not by ctx.rank alone")
FIX_WITHIN = ("seed or shard the data by the data-parallel rank (trainer.data_rank / trainer.data_world_size, "
              "or trainer.generator(micro_step)), not by the replica alone; tensor-parallel peers do share "
              "their inputs")
NOT_THE_DATA = "if the model's first tensor argument is not the data, give the data to trainer.fingerprint_input()"


@dataclass(frozen=True)
class DuplicateData:
    """The job's finding: ranks that trained on identical inputs at `step`."""

    step: int
    replicas: tuple[int, ...]  # the replicas of those ranks, sorted
    ranks: tuple[int, ...]  # their ranks (within their replicas), sorted
    message: str

    def summary(self) -> dict:
        """As status.training.duplicateData and `transom run`'s summary show it."""
        return {"step": self.step, "replicas": list(self.replicas), "message": self.message}


def message(step: int, replicas: Iterable[int], ranks: Iterable[int]) -> str:
    """What a user reads: who trained on what, and the fix."""
    replicas, ranks = sorted(replicas), sorted(ranks)
    if len(replicas) > 1:
        who = f"replicas {_names(replicas)}"
        fix = FIX_ACROSS
    else:
        who = f"ranks {_names(ranks)} of replica {replicas[0]}"
        fix = FIX_WITHIN
    return f"{who} trained on identical inputs at step {step}: {fix}. {CHECKED}; {NOT_THE_DATA}."


def _names(ids: list[int]) -> str:
    """"0 and 1", "0, 1 and 2", "0, 1, ..., 15 and 9 more"."""
    shown = [str(i) for i in ids[:MAX_NAMED]]
    if len(ids) > MAX_NAMED:
        return f"{', '.join(shown)} and {len(ids) - MAX_NAMED} more"
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


@dataclass
class _Step:
    """One due step's digests: each (replica, rank) once, and who holds each digest."""

    by_rank: dict[tuple[int, int], int] = field(default_factory=dict)
    by_digest: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


class DuplicateInputs:
    def __init__(self, max_steps: int = MAX_STEPS):
        self.max_steps = max_steps
        self._steps: dict[int, _Step] = {}
        self._first: tuple[int, int] | None = None  # (step, digest) of the finding
        self._replicas: set[int] = set()  # of the finding's ranks
        self._ranks: set[int] = set()
        self._finding: DuplicateData | None = None  # built from the sets when they change

    def observe(self, step: int, replica: int, rank: int, digest: int) -> bool:
        """Take one rank's digest of `step`'s input; True when it makes the job's finding (once).
        A digest of a step that is not due, or older than every step kept, is not taken."""
        kept = self._kept(step)
        if kept is None or (replica, rank) in kept.by_rank:
            return False  # a rank's first digest of a step stands (a restarted one trains it again)
        kept.by_rank[(replica, rank)] = digest
        holders = kept.by_digest.setdefault(digest, [])
        holders.append((replica, rank))
        if self._first is None and len(holders) > 1:
            self._first = (step, digest)
            self._join(holders)
            return True
        if self._first == (step, digest):
            self._join([(replica, rank)])
        return False

    @property
    def finding(self) -> DuplicateData | None:
        if self._first is not None and self._finding is None:
            step = self._first[0]
            self._finding = DuplicateData(step, tuple(sorted(self._replicas)), tuple(sorted(self._ranks)),
                                          message(step, self._replicas, self._ranks))
        return self._finding

    def _join(self, holders: list[tuple[int, int]]) -> None:
        for replica, rank in holders:
            if replica not in self._replicas or rank not in self._ranks:
                self._replicas.add(replica)
                self._ranks.add(rank)
                self._finding = None  # named anew when next read

    def _kept(self, step: int) -> _Step | None:
        """The record of `step`, made if it is due and not older than every step kept."""
        if not input_digest_due(step):
            return None
        if step not in self._steps:
            if len(self._steps) >= self.max_steps:
                oldest = min(self._steps)
                if step < oldest:
                    return None
                del self._steps[oldest]
            self._steps[step] = _Step()
        return self._steps[step]
