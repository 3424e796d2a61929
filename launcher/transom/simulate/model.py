"""What a simulated job is: its cluster, its failures, and how each strategy recovers; presets.

A *strategy* says, for a software fault and for a hardware fault (one that takes a node
away), what a failure costs as sequences of timed components:

- `job`: every replica stops (a whole-job restart; or the survivors waiting until the
  failure is detected and their communicators rebuilt);
- `replica`: only the failed replica is missing, the others train on (replica-level
  strategies), at (R-1)/R of the job's throughput;
- `rejoin`: every replica stops when the failed one comes back (a blocking state transfer);

and whether a failure rolls the job back to its last checkpoint (whole-job strategies). A
replica-level strategy with hot spares replaces a hardware-failed replica by a spare
(`spare_takeover`) while one is ready; a used spare is ready again `spare_refill_s` later.

Delays are seconds; every figure and its source is in docs/simulation.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

Components = tuple[tuple[str, float], ...]  # (component, seconds) in order


@dataclass(frozen=True)
class Costs:
    job: Components = ()
    replica: Components = ()
    rejoin: Components = ()


@dataclass(frozen=True)
class Strategy:
    name: str
    title: str
    software: Costs
    hardware: Costs
    rollback: bool  # a failure loses the work since the last checkpoint
    checkpoint_interval_s: float
    checkpoint_stall_s: float  # every replica waits this long per checkpoint
    spares: int = 0
    spare_takeover: Components = ()
    spare_refill_s: float = 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    gpus: int
    replicas: int
    failures_per_gpu_hour: float  # in wall-clock time, whatever the job does
    hardware_share: float  # of failures that take a node away (the rest: software, in place)
    strategies: tuple[Strategy, ...]
    days: float = 30.0
    headline: str = "transom"  # the strategy a preset is about

    @property
    def mtbf_minutes(self) -> float:
        return 60.0 / (self.failures_per_gpu_hour * self.gpus)

    def scaled(self, gpus: int) -> Scenario:
        """The same per-GPU failure rate and replica size on a cluster of `gpus` GPUs."""
        per_replica = self.gpus / self.replicas
        return replace(self, gpus=gpus, replicas=max(1, round(gpus / per_replica)))


# --- the strategies, with the delays of docs/simulation.md ------------------------------------------
# Whole-job restart as FT-HSDP describes synchronous recovery at ~100K GPUs: about 10 minutes.
SYNC_RESTART: Components = (("detection", 60.0), ("scheduling", 180.0), ("restart", 120.0),
                            ("checkpoint_load", 120.0), ("communicator_init", 90.0), ("first_step", 30.0))


def sync() -> Strategy:
    return Strategy("sync", "synchronous, whole-job restart", Costs(job=SYNC_RESTART), Costs(job=SYNC_RESTART),
                    rollback=True, checkpoint_interval_s=600.0, checkpoint_stall_s=5.0)


def transom_style() -> Strategy:
    """TRANSOM (Wu et al. 2023): whole-job restart, automated (fast detection, the restart
    done by the operator) and asynchronous in-memory checkpoints, loaded from memory."""
    restart: Components = (("detection", 30.0), ("scheduling", 180.0), ("restart", 60.0),
                           ("checkpoint_load", 30.0), ("communicator_init", 90.0), ("first_step", 30.0))
    return Strategy("transom_style", "TRANSOM: automatic restart, async checkpoints", Costs(job=restart),
                    Costs(job=restart), rollback=True, checkpoint_interval_s=300.0, checkpoint_stall_s=1.0)


def ft_hsdp() -> Strategy:
    """FT-HSDP: the survivors wait ~1 min (detection, communicator reconfiguration), the failed
    replica is rescheduled and restarted, and its rejoin stalls everyone ~2 min."""
    stall: Components = (("detection", 30.0), ("communicator_init", 30.0))
    down: Components = (("scheduling", 180.0), ("restart", 120.0), ("communicator_init", 90.0))
    in_place: Components = (("restart", 120.0), ("communicator_init", 90.0))
    rejoin: Components = (("rejoin", 120.0), ("first_step", 30.0))
    return Strategy("ft_hsdp", "FT-HSDP: replica-level restart, blocking rejoin",
                    Costs(job=stall, replica=in_place, rejoin=rejoin), Costs(job=stall, replica=down, rejoin=rejoin),
                    rollback=False, checkpoint_interval_s=1800.0, checkpoint_stall_s=1.0)


def transom(catch_up_s: float = 60.0, spares: int = 1) -> Strategy:
    """Transom as built (docs/simulation.md has the measured figures each delay rests on):
    a software fault restarts the replica in place while the others go on (their stall: the
    kill, under a second); a hardware fault stalls the survivors until it is detected (the
    heartbeat timeout, 30 s by default; a dead peer's closed sockets are often faster) and
    is taken over by a hot spare (0.3 s to a member, then the catch-up) or rescheduled; the
    rejoin stalls nobody (non-blocking catch-up)."""
    catch_up: Components = (("catch_up", catch_up_s),)
    return Strategy(
        "transom", "Transom: in-place restarts, hot spares, non-blocking catch-up",
        software=Costs(job=(("detection", 1.0),), replica=(("restart", 120.0), ("communicator_init", 90.0),
                                                          *catch_up)),
        hardware=Costs(job=(("detection", 31.0),), replica=(("scheduling", 180.0), ("restart", 120.0),
                                                           ("communicator_init", 90.0), *catch_up)),
        rollback=False, checkpoint_interval_s=1800.0, checkpoint_stall_s=0.1, spares=spares,
        spare_takeover=(("spare_takeover", 0.3), *catch_up), spare_refill_s=390.0)


def strategies() -> tuple[Strategy, ...]:
    return (sync(), transom_style(), ft_hsdp(), transom())


def llama3_strategy() -> Strategy:
    """Llama 3's: synchronous whole-job restarts, automated (the paper: >90% effective
    training time with 466 interruptions in 54 days)."""
    return replace(sync(), name="llama3", title="Llama 3: synchronous, automated restart", checkpoint_interval_s=300.0)


PRESETS: dict[str, Scenario] = {
    # ~98K GPUs in 12 replicas, one failure every ~18 minutes (FT-HSDP).
    "ft-hsdp-100k": Scenario("ft-hsdp-100k", gpus=98_304, replicas=12,
                             failures_per_gpu_hour=1 / (0.3 * 98_304), hardware_share=0.78,
                             strategies=strategies()),
    # 16,384 GPUs, 466 interruptions in 54 days, ~78% hardware (Llama 3).
    "llama3-16k": Scenario("llama3-16k", gpus=16_384, replicas=16,
                           failures_per_gpu_hour=466 / (54 * 24 * 16_384), hardware_share=0.78,
                           strategies=(llama3_strategy(), *strategies()), headline="llama3"),
}


@dataclass
class Result:
    strategy: str
    effective: float  # useful work over (wall time x the whole cluster)
    failures: int
    lost_gpu_hours: dict[str, float] = field(default_factory=dict)  # by component
    gpu_hours: float = 0.0
