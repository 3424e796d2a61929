"""A replica's side of Rebalance: the shares of the global batch it follows, the samples
they give each replica at a step, and the weight of its gradients in the exchange.

The coordinator publishes the shares in its quorum answers (transom/detect/rebalance.py has
the policy and the arithmetic). `trainer.batches()` (ft/data.py) declares that this replica
follows them (`follow`), asks for the samples per rank in force at each step (`counts`)
and says how many its rank took (`took`); the trainer feeds every answer in (`update`) and
asks for the exchange weight and the step's batch share (the detectors judge a rebalanced
replica's step per nominal batch).
A script with its own data loop never follows: its replica is never rebalanced, and while
it is a member nobody is (the coordinator publishes nominal shares).
"""

from __future__ import annotations

from transom.coordinator.models import QuorumResponse
from transom.detect.rebalance import ShareSchedule, exchange_weight, samples_per_rank


class BatchShares:
    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self.schedule = ShareSchedule()
        self.nominal: int | None = None  # the loader's batch size, once batches() follows the shares
        self.step_samples: int | None = None  # this step's batch on this rank
        self._memo: tuple[list[float] | None, list[int]] = (None, [])  # shares -> counts (O(replicas) to make)

    @property
    def following(self) -> bool:
        return self.nominal is not None

    def follow(self, batch_size: int) -> None:
        """The replica's batches follow the shares; `batch_size` is its nominal batch per rank."""
        self.nominal = batch_size

    def took(self, samples: int) -> None:
        self.step_samples = samples

    def batch_share(self) -> float | None:
        """This step's batch over the nominal one; None when they are the same (or unknown)."""
        if self.step_samples is None or self.nominal is None or self.step_samples == self.nominal:
            return None
        return round(self.step_samples / self.nominal, 6)

    def update(self, q: QuorumResponse) -> None:
        self.schedule.update(q.shares, q.shares_from)

    def counts(self, step: int) -> list[int] | None:
        """Samples per rank of each replica at `step`; None: every replica its nominal batch."""
        shares = self.schedule.at(step)
        if shares is None or self.nominal is None:
            return None
        if self._memo[0] is not shares:
            self._memo = (shares, samples_per_rank(shares, self.nominal, self.num_replicas))
        return self._memo[1]

    def weight(self, q: QuorumResponse, replica_id: int) -> float | None:
        """This replica's samples over all contributors' samples of the round's step (its
        gradients are scaled by it, so the sum is the mean over every sample; 0 for one that
        catches up); None with nominal shares (the sum is divided by the participants). Every
        member decides alike: the shares of the round's step are the same for all."""
        counts = self.counts(q.max_step)
        if counts is None:
            return None
        if replica_id in q.recovering:
            return 0.0
        return exchange_weight(counts, [m for m in q.members if m not in q.recovering], replica_id)
