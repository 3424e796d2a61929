"""The seeded discrete-event simulation of one scenario under one strategy.

Failures arrive as a Poisson process in wall-clock time at `failures_per_gpu_hour x gpus`
(hardware fails whether the job trains or waits), each hardware-class with probability
`hardware_share`, each on a replica drawn uniformly. Between two events nothing changes,
so the simulation jumps from event to event and integrates:

- every replica stopped (a job-level stall under way): all GPUs' time is lost to the
  component of the oldest stall under way;
- otherwise the job trains at (replicas up)/R of full speed; a missing replica's GPUs are
  lost to the component of its own recovery;
- a failure under a rolling-back strategy loses the work since the last checkpoint (the
  `rollback` component), and a failure during a whole-job restart starts it over;
- a checkpoint every `checkpoint_interval_s` stalls every replica `checkpoint_stall_s`.

The effective training time is the useful work over the wall time of the whole cluster;
useful work plus every component's lost time adds up to the cluster's time (checked).
"""

from __future__ import annotations

import heapq
import random

from transom.simulate.model import Components, Result, Scenario, Strategy


class _Timeline:
    """A sequence of components, from `start` on; `at(t)` is the one under way."""

    def __init__(self, start: float, parts: Components):
        self.parts, self.ends, t = parts, [], start
        for _, seconds in parts:
            t += seconds
            self.ends.append(t)
        self.start, self.end = start, t

    def at(self, t: float) -> str:
        for (name, _), end in zip(self.parts, self.ends):
            if t < end:
                return name
        return self.parts[-1][0]


class Simulation:
    def __init__(self, scenario: Scenario, strategy: Strategy, seed: int):
        self.sc, self.st = scenario, strategy
        self.rng = random.Random(seed)
        self.t = 0.0
        self.work = 0.0  # seconds of full-speed training
        self.saved = 0.0  # work in the last checkpoint
        self.lost: dict[str, float] = {}  # GPU-seconds by component
        self.stalls: list[_Timeline] = []  # job-level, under way
        self.down: dict[int, _Timeline] = {}  # replica -> its recovery
        self.spares_ready = [0.0] * strategy.spares  # when each spare slot is ready
        self.failures = 0

    def _lose(self, component: str, gpu_seconds: float) -> None:
        self.lost[component] = self.lost.get(component, 0.0) + gpu_seconds

    def _advance(self, until: float) -> None:
        dt = until - self.t
        if dt <= 0:
            return
        sc = self.sc
        if self.stalls:
            oldest = min(self.stalls, key=lambda s: s.start)
            self._lose(oldest.at(self.t), dt * sc.gpus)
        else:
            per_replica = sc.gpus / sc.replicas
            for line in self.down.values():
                self._lose(line.at(self.t), dt * per_replica)
            self.work += dt * (sc.replicas - len(self.down)) / sc.replicas
        self.t = until

    def _next_boundary(self) -> float:
        ends = [s.end for s in self.stalls] + [d.end for d in self.down.values()]
        return min(ends, default=float("inf"))

    def _settle(self) -> None:
        """Finish what ended at self.t: stalls, and recoveries (whose rejoin may stall all)."""
        self.stalls = [s for s in self.stalls if s.end > self.t]
        for replica in [r for r, d in self.down.items() if d.end <= self.t]:
            del self.down[replica]
            rejoin = self._costs_of_last.get(replica)
            if rejoin:
                self.stalls.append(_Timeline(self.t, rejoin))

    def _fail(self) -> None:
        self.failures += 1
        st, sc = self.st, self.sc
        hardware = self.rng.random() < sc.hardware_share
        costs = st.hardware if hardware else st.software
        replica = self.rng.randrange(sc.replicas)
        if st.rollback:
            if not self.stalls:
                self._lose("rollback", (self.work - self.saved) * sc.gpus)
                self.work = self.saved
            self.stalls = [_Timeline(self.t, costs.job)]  # the whole job restarts (again)
            return
        if costs.job:
            self.stalls.append(_Timeline(self.t, costs.job))
        start = self.t + sum(s for _, s in costs.job)
        parts = costs.replica
        ready = [i for i, t in enumerate(self.spares_ready) if t <= self.t]
        if hardware and ready:
            self.spares_ready[ready[0]] = self.t + st.spare_refill_s
            parts = st.spare_takeover
        if parts:
            self.down[replica] = _Timeline(start, parts)
            self._costs_of_last[replica] = costs.rejoin

    def run(self) -> Result:
        sc, st = self.sc, self.st
        end = sc.days * 86400.0
        rate = sc.failures_per_gpu_hour * sc.gpus / 3600.0
        self._costs_of_last: dict[int, Components] = {}
        events: list[tuple[float, str]] = [(self.rng.expovariate(rate), "failure")]
        if st.checkpoint_interval_s > 0:
            events.append((st.checkpoint_interval_s, "checkpoint"))
        heapq.heapify(events)
        while True:
            when = min(events[0][0], self._next_boundary(), end)
            self._advance(when)
            self._settle()
            if when >= end:
                break
            while events and events[0][0] <= self.t:
                _, kind = heapq.heappop(events)
                if kind == "failure":
                    self._fail()
                    heapq.heappush(events, (self.t + self.rng.expovariate(rate), "failure"))
                else:
                    if not self.stalls:  # a job that is not training takes no checkpoint
                        self.saved = self.work
                        if st.checkpoint_stall_s > 0:
                            self.stalls.append(_Timeline(self.t, (("checkpoint_save", st.checkpoint_stall_s),)))
                    heapq.heappush(events, (self.t + st.checkpoint_interval_s, "checkpoint"))
        total = end * sc.gpus
        accounted = self.work * sc.gpus + sum(self.lost.values())
        assert abs(accounted - total) <= 1e-6 * total, (accounted, total)
        return Result(strategy=st.name, effective=self.work / end, failures=self.failures,
                      lost_gpu_hours={k: v / 3600.0 for k, v in sorted(self.lost.items())}, gpu_hours=total / 3600.0)


def simulate(scenario: Scenario, strategy: Strategy, seed: int = 0) -> Result:
    return Simulation(scenario, strategy, seed).run()
