"""The hot spares of `transom run` (`--spares N`), kept as the operator keeps a TrainingJob's
`spec.spareReplicas`: launchers whose workers load the script's model and wait (launch/spare.py).

A spare takes a failed replica's place by its labels file (launch/local_pods.py), as the
replica's next generation; no process starts on that recovery path. A spare used up is
started again once the replica it took over has caught up (or after REFILL_WAIT_S): on one
machine its start-up (imports, the model's build) would take the cores the catch-up and the
healthy replicas need; on Kubernetes the operator refills at once, on other nodes.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from transom.launch.local_pods import LocalPods

REFILL_WAIT_S = 60.0  # the longest a used spare waits to be replaced while a replica catches up


class SparePool:
    def __init__(self, pods: LocalPods, max_generations: int, say: Callable[[str], None]):
        self.pods = pods
        self.max_generations = max_generations
        self.say = say
        self.waiting: dict[int, tuple[subprocess.Popen, Path]] = {}  # spare id -> its launcher, its podinfo dir
        self._generation: dict[int, int] = {}
        self._refills: dict[int, tuple[float, int]] = {}  # spare id -> (when, replica) it took over

    def __bool__(self) -> bool:
        """Whether a spare is waiting to take over."""
        return bool(self.waiting)

    def launchers(self) -> list[subprocess.Popen]:
        return [proc for proc, _ in self.waiting.values()]

    def start(self, spare_id: int) -> None:
        """A spare's next launcher, waiting for the labels file that names its replica."""
        generation = self._generation.get(spare_id, -1) + 1
        self._generation[spare_id] = generation
        self.waiting[spare_id] = self.pods.start_spare(spare_id, generation)

    def restart_ended(self) -> None:
        """Start again each spare whose launcher ended, while it has generations left."""
        for spare_id, (proc, _) in list(self.waiting.items()):
            if proc.poll() is None:
                continue
            del self.waiting[spare_id]
            if self._generation[spare_id] + 1 < self.max_generations:
                self.say(f"spare {spare_id} launcher exited with {proc.returncode}; starting it again")
                self.start(spare_id)
            else:
                self.say(f"spare {spare_id} launcher exited with {proc.returncode}; no more spare {spare_id}")

    def take(self, replica: int, generation: int) -> tuple[int, subprocess.Popen]:
        """A waiting spare, promoted to (`replica`, `generation`): its id and launcher."""
        spare_id = min(self.waiting)
        proc, podinfo = self.waiting.pop(spare_id)
        self.pods.promote(f"spare-{spare_id}-g{self._generation[spare_id]}", podinfo, replica, generation)
        self._refills[spare_id] = (time.monotonic(), replica)
        return spare_id, proc

    def refills_due(self) -> bool:
        return bool(self._refills)

    def refill(self, caught_up: set[int]) -> None:
        """Start the spares used up, once the replica each took over is in `caught_up`, or
        REFILL_WAIT_S after it took over."""
        for spare_id, (used, replica) in list(self._refills.items()):
            if replica in caught_up or time.monotonic() - used > REFILL_WAIT_S:
                del self._refills[spare_id]
                self.start(spare_id)
